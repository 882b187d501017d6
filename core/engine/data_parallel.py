"""``DataParallelEngine``: N engine replicas, each a Ray actor, behind the ``AsyncLLMEngine`` interface.

``kvforge serve --data-parallel-size N`` serves through one of these: one front end (the HTTP server,
tokenization for the chat template, the metrics) and N full engines (each with its own ranks when
``tensor_parallel_size`` or ``pipeline_parallel_size`` is more than 1). Each request goes to the
replica that holds most of its prompt's prefix unless it is busier (``kvforge.engine.prefix_router``: matched
blocks minus ``load_weight`` times requests in flight; with no prefix held anywhere, the least busy); its
outputs stream back through a Ray streaming generator. The replicas record KV events for that (whatever
``enable_kv_events`` says), which a thread here reads every :data:`KV_EVENTS_PERIOD_S`; with
``enable_kv_events`` they also go to this front end's log, each batch naming its replica
(``data_parallel_rank``). Ray is imported only here (``pip install 'kvforge[ray]'``). docs/distributed.md.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Protocol, TypeVar, cast

import msgspec

from kvforge.config import EngineConfig
from kvforge.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvforge.engine.input_checks import tokenize_prompt
from kvforge.engine.prefix_router import (
    DEFAULT_LOAD_WEIGHT,
    Candidate,
    PrefixIndex,
    best,
    check_load_weight,
    prompt_block_hashes,
)
from kvforge.engine.stats import COUNT_KEYS, EngineStats
from kvforge.kv_events import KVEventLog, KVEventPage
from kvforge.lora.request import LoRARequest
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from ray import ObjectRef

logger = logging.getLogger(__name__)

#: a prompt as the front ends take it (``EngineClient.add_request``)
Prompt = str | list[int] | dict
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

#: seconds between the health checks of the replicas
HEALTH_PERIOD_S = 1.0
#: seconds between two reads of the replicas' KV events
KV_EVENTS_PERIOD_S = 0.1


class ReplicaActor:
    """One engine replica inside a Ray actor (an async actor: many requests stream at once)."""

    def __init__(self, config: EngineConfig, step_timeout_s: float | None = None):
        # a replica's own watchdog marks it dead when it stalls; ``check`` then reports it
        self.engine = AsyncLLMEngine.from_config(config, step_timeout_s=step_timeout_s)
        self.engine.start()

    def info(self) -> dict[str, Any]:
        return {"max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size,
                "modalities": self.engine.modalities}

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(prompt, params, request_id, priority, lora_request=lora_request):
            yield out

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.get_stats()

    def kv_events_since(self, since: int, limit: int) -> KVEventPage | None:
        return self.engine.kv_events_since(since, limit)

    def check(self) -> None:
        if self.engine.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.engine.error!r}")

    def check_structured_outputs(self, so: StructuredOutputsParams) -> None:
        self.engine.check_structured_outputs(so)

    def shutdown(self) -> None:
        self.engine.shutdown()


# What a ReplicaActor's Ray handle offers: each method's ``.remote(...)`` returns a reference to its result
# (Ray types a handle's methods only for actors decorated with ``ray.method``, which would import Ray here).
class _Remote(Protocol[R_co]):
    def remote(self, *args: object) -> ObjectRef[R_co]: ...


class _OutputRefs(Protocol):
    """Ray's ``ObjectRefGenerator`` of a streaming call: each item a reference to the next output."""

    def __anext__(self) -> Awaitable[ObjectRef[RequestOutput]]: ...


class _StreamingCall(Protocol):
    def remote(self, *args: object) -> _OutputRefs: ...


class _StreamingMethod(Protocol):
    def options(self, *, num_returns: str) -> _StreamingCall: ...


class _ReplicaHandle(Protocol):
    info: _Remote[dict[str, Any]]
    generate: _StreamingMethod
    add_lora: _Remote[bool]
    remove_lora: _Remote[bool]
    list_loras: _Remote[list[LoRARequest]]
    abort: _Remote[None]
    stats: _Remote[EngineStats]
    kv_events_since: _Remote[KVEventPage | None]
    check: _Remote[None]
    check_structured_outputs: _Remote[None]
    shutdown: _Remote[None]


class DataParallelEngine:
    """What the server needs of an engine (``AsyncLLMEngine``'s interface), over ``size`` replicas."""

    def __init__(self, config: EngineConfig, size: int, step_timeout_s: float | None = None,
                 load_weight: float = DEFAULT_LOAD_WEIGHT):
        """``load_weight``: what a request in flight costs a replica's score, in matched prefix blocks."""
        self.load_weight = check_load_weight(load_weight)
        try:
            import ray
        except ImportError:
            raise ValueError("data_parallel_size > 1 needs Ray, which is not installed "
                             "(pip install 'kvforge[ray]')") from None
        from kvforge.model.loader import load_model_config, resolve_model_source
        from kvforge.model.tokenizer_source import tokenizer_for

        self._ray, self.size, self.config = ray, size, config
        self.kv_events = KVEventLog.for_config(config)  # (its ZMQ socket bound here, before any replica starts)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init()
        # the facts the front end reads (AsyncLLMEngine's properties): plain attributes here
        self.model_source = resolve_model_source(config.model, config.load_format)
        self.tokenizer = tokenizer_for(config, self.model_source, load_model_config(self.model_source))
        cuda = config.torch_device.type == "cuda"
        per_replica = config.tensor_parallel_size * config.pipeline_parallel_size
        # a replica's ranks run inside its actor, on the devices Ray gave it
        # the replicas record KV events for the routing; only this front end publishes them
        replica_config = config.replace(distributed_executor_backend="mp" if per_replica > 1 else None,
                                        device="cuda" if cuda else config.device, enable_kv_events=True,
                                        kv_events_endpoint=None)
        actor = ray.remote(ReplicaActor).options(num_gpus=per_replica if cuda else 0, num_cpus=0 if cuda else 1,
                                                 max_concurrency=1000)
        self.replicas = [cast(_ReplicaHandle, actor.remote(replica_config, step_timeout_s)) for _ in range(size)]
        try:
            infos = ray.get([r.info.remote() for r in self.replicas])
        except Exception as exc:
            self.shutdown()
            raise RuntimeError(f"a data-parallel replica failed to start: {exc}") from exc
        self.max_model_len: int = min(i["max_model_len"] for i in infos)
        self.vocab_size: int = infos[0]["vocab_size"]
        self.modalities: tuple[str, ...] = tuple(infos[0]["modalities"])
        self.in_flight = [0] * size  # requests each replica is serving now
        self.routed = [0] * size  # requests sent to each replica since start
        self.prefixes = [PrefixIndex() for _ in range(size)]  # what each replica holds (guarded by _prefix_lock)
        self._prefix_lock = threading.Lock()
        self._events_since = [0] * size  # the next KV event batch to read from each replica
        self.error: BaseException | None = None
        self.dead = threading.Event()
        self._running = False
        self._stop = threading.Event()

    @property
    def is_running(self) -> bool:
        return self._running and self.error is None

    def check_structured_outputs(self, so: StructuredOutputsParams) -> None:
        self._results([self.replicas[0].check_structured_outputs.remote(so)])

    def _results(self, refs: list[ObjectRef[R]]) -> list[R]:
        """The replicas' answers, with a replica's error re-raised as itself."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter on every replica; ``ValueError`` if it is bad."""
        return any(self._results([r.add_lora.remote(lora_request) for r in self.replicas]))

    def remove_lora(self, lora_int_id: int) -> bool:
        return any(self._results([r.remove_lora.remote(lora_int_id) for r in self.replicas]))

    def list_loras(self) -> list[LoRARequest]:
        return self._results([r.list_loras.remote() for r in self.replicas])[0]

    def get_stats(self) -> EngineStats:
        """The replicas' counters added up (usage: their mean; the speculative-decoding stats: the first
        replica's), every replica's ranks in turn, plus each replica's routed requests."""
        parts = self._ray.get([r.stats.remote() for r in self.replicas], timeout=10)
        total = parts[0].copy()
        for key in COUNT_KEYS:
            total[key] = sum(p[key] for p in parts)
        total["kv_cache_usage"] = sum(p["kv_cache_usage"] for p in parts) / len(parts)
        merged: dict[int, int] = {}
        for p in parts:
            for prio, n in p["waiting_by_priority"].items():
                merged[prio] = merged.get(prio, 0) + n
        total["waiting_by_priority"] = merged
        total["rank_batch_requests"] = [n for p in parts for n in p["rank_batch_requests"]]
        total["data_parallel_routed"] = list(self.routed)
        return total

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._running:
            self._running = True
            threading.Thread(target=self._watch, name="kvforge-dp-health", daemon=True).start()
            threading.Thread(target=self._follow_kv_events, name="kvforge-dp-kv-events", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(HEALTH_PERIOD_S):
            for i, replica in enumerate(self.replicas):
                try:
                    self._ray.get(replica.check.remote(), timeout=30)
                except Exception as exc:
                    self.error = RuntimeError(f"data-parallel replica {i} failed: {exc}")
                    logger.error("%s", self.error)
                    self.dead.set()
                    return

    def _follow_kv_events(self) -> None:
        """Each replica's KV events into its prefix index (and, with ``enable_kv_events``, into the log)."""
        while not self._stop.wait(KV_EVENTS_PERIOD_S):
            try:
                pages = self._ray.get([r.kv_events_since.remote(since, 1000)
                                       for r, since in zip(self.replicas, self._events_since)], timeout=10)
            except Exception:  # a replica gone: the health check ends the engine
                continue
            for i, page in enumerate(pages):
                if page is None:
                    continue
                with self._prefix_lock:
                    if page.first > self._events_since[i]:  # batches dropped before they were read: start anew
                        self.prefixes[i].clear()
                    for _, batch in page.batches:
                        self.prefixes[i].apply(batch)
                self._events_since[i] = page.next
                if self.kv_events is not None:
                    for _, batch in page.batches:
                        self.kv_events.append(msgspec.structs.replace(batch, data_parallel_rank=i))

    def kv_events_since(self, since: int, limit: int = 1000) -> KVEventPage | None:
        """Every replica's KV event batches (``data_parallel_rank``: its index), numbered in the order read;
        None: ``enable_kv_events`` is off."""
        return self.kv_events.since(since, limit) if self.kv_events is not None else None

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop.set()
        log = getattr(self, "kv_events", None)  # (a failed start shuts down before everything is set)
        if log is not None:
            log.close()
        ray = self._ray
        for replica in getattr(self, "replicas", []):
            try:
                ray.get(replica.shutdown.remote(), timeout=timeout)
            except Exception:  # already gone
                pass
            ray.kill(replica)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str,
                          priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Send the request to the replica :func:`~kvforge.engine.prefix_router.best` picks; ``ValueError``
        naming the field for bad input (the replica validates it, and its first answer is awaited here)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        hashes = await self._block_hashes(prompt, lora_request)
        with self._prefix_lock:
            choice = best([Candidate(k, self.prefixes[k].matched(hashes), self.in_flight[k], self.routed[k])
                           for k in range(self.size)], self.load_weight)
            assert choice is not None  # NOTE: size >= 1
            i = choice.index
            self.prefixes[i].replay(hashes)
        self.in_flight[i] += 1
        self.routed[i] += 1
        gen = self.replicas[i].generate.options(num_returns="streaming").remote(prompt, params, request_id, priority,
                                                                                  lora_request)
        try:
            first = await self._next(gen)
        except BaseException:
            self.in_flight[i] -= 1
            raise
        return self._stream(i, request_id, gen, first)

    async def _block_hashes(self, prompt: Prompt, lora_request: LoRARequest | None) -> list[int]:
        """The prompt's block hashes as the replicas' KV managers compute them; none for a prompt whose
        hashes carry an extra key (an adapter, images) or that is bad (its replica will refuse it)."""
        if lora_request is not None or (isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None):
            return []
        try:
            if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
                _, ids = await asyncio.to_thread(tokenize_prompt, self.tokenizer, prompt)  # as the replica will
            else:
                _, ids = tokenize_prompt(None, prompt)
        except ValueError:
            return []
        return prompt_block_hashes(ids, self.config.block_size)

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        async for out in await self.add_request(prompt, params, request_id, priority, lora_request):
            yield out

    async def _next(self, gen: _OutputRefs) -> RequestOutput | None:
        """The generator's next output (None at its end), with a replica's error re-raised as itself."""
        try:
            ref = await gen.__anext__()
            return await ref
        except StopAsyncIteration:
            return None
        except self._ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    async def _stream(self, i: int, request_id: str, gen: _OutputRefs, first: RequestOutput | None
                      ) -> AsyncIterator[RequestOutput]:
        out, finished = first, False
        try:
            while out is not None:
                finished = out.finished
                yield out
                if finished:
                    return
                out = await self._next(gen)
            finished = True
        finally:
            self.in_flight[i] -= 1
            if not finished:
                self.replicas[i].abort.remote(request_id)

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:  # only the one serving it knows it; the others ignore the id
            replica.abort.remote(request_id)

