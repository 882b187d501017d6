"""``LLMEngine``: the synchronous engine loop (schedule -> run -> update -> outputs)."""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import AbstractSet, Any

import torch

from kvforge.builder import component, kv_tiers, validate_plugin_tables
from kvforge.config import EngineConfig
from kvforge.engine.output_processor import OutputProcessor, ParentState
from kvforge.engine.request_factory import RequestFactory
from kvforge.engine.stats import EngineStats, engine_stats
from kvforge.engine.structured_output import StructuredOutputManager
from kvforge.errors import RequestFailure, is_device_error
from kvforge.lora.registry import LoRARegistry, check_lora_request
from kvforge.lora.request import LoRARequest
from kvforge.model import quantization
from kvforge.model.interface import capabilities_of
from kvforge.model.loader import load_model_config, resolve_model_source
from kvforge.model.tokenizer_source import tokenizer_for
from kvforge.outputs import RequestOutput
from kvforge.plugin_manager import get_plugin_manager
from kvforge.rank.executor import Executor, default_backend
from kvforge.rank.memory_budget import RELEASE_WAIT_S, release_device_memory
from kvforge.rank.messages import (
    BatchState,
    CaptureCudaGraphs,
    DetermineNumBlocks,
    InitializeCache,
    InitializeSwapSpace,
)
from kvforge.rank.model_runner import ModelRunner
from kvforge.rank.worker import WorkerSpec
from kvforge.request import Request
from kvforge.sampler import NO_TOKEN
from kvforge.sampling_params import SamplingParams
from kvforge.scheduler import ModelRunnerOutput, SchedulerOutput
from kvforge.spec_decode.decoder import SpecDecoder
from kvforge.spec_decode.drafter import Drafter
from kvforge.spec_decode.policy import SpecDecodeStats
from kvforge.step_result import Failed, Finished

logger = logging.getLogger(__name__)

#: the failure of a request whose sampler row had nothing to sample (``NO_TOKEN``)
NOTHING_TO_SAMPLE = RequestFailure(
    "no token can be sampled: the request's constraints (structured_outputs, allowed_token_ids, bad_words, "
    "logit_bias, logits_processors) exclude every token at this step, or its logits are NaN", 400)


class LLMEngine:
    """Builds the components named by an :class:`EngineConfig` and runs requests to completion."""

    def __init__(self, config: EngineConfig):
        self.config = config
        pm = self.plugin_manager = get_plugin_manager()
        validate_plugin_tables(pm, config)
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.bind_thread()
        torch.manual_seed(config.seed)

        self.source = resolve_model_source(config.model, config.load_format)
        mc = self.model_config = load_model_config(self.source)
        if config.quantization is not None or mc.quantization_config is not None:
            method = quantization.resolve(quantization.registered(pm), config.quantization, mc)
            if method != config.quantization:  # the method that loads the checkpoint's quantization_config
                config = self.config = dataclasses.replace(config, quantization=method)
        self.tokenizer = tokenizer_for(config, self.source, mc)
        self.eos_token_ids = tuple(mc.eos_token_ids)

        self.executor = self._build_executor(pm, config, mc)
        self._step_watch = self.executor.step_watch()  # while waiting for a step: a rank gone ends the wait
        try:
            self._initialize(pm, config, mc)
        except BaseException:
            self.executor.shutdown()
            if getattr(self, "kv_cache", None) is not None and self.kv_cache.tier is not None:
                self.kv_cache.tier.close()  # (a disk tier's thread and its directory's lock)
            raise
        pm.hook.engine_created(engine=self)

    def _kv_sliding_window(self, mc: Any) -> int | None:
        """The window the KV manager may free blocks behind: the model's, when every layer has one and
        no draft model shares the block ids (its catch-up reads and writes positions of its own,
        which may lie behind the window)."""
        draft = getattr(self.spec.drafter, "model_config", None) if self.spec is not None else None
        return None if draft is not None else mc.kv_sliding_window

    def _kv_window_arg(self, mc: Any) -> dict[str, Any]:
        """``sliding_window=`` for the KV manager, only when there is one: a manager written before the
        argument existed keeps working for every other model."""
        window = self._kv_sliding_window(mc)
        return {} if window is None else {"sliding_window": window}

    def _build_executor(self, pm: Any, config: EngineConfig, mc: Any) -> Executor:
        """The executor named by ``distributed_executor_backend`` (default: vLLM's rule), with its ranks built."""
        spec = WorkerSpec(config, self.source, mc, config.tensor_parallel_size, config.pipeline_parallel_size)
        name = config.distributed_executor_backend or default_backend(spec.world_size, self.device)
        cls = pm.get("executor", name)
        if spec.world_size > 1 and not cls.supports_multiple_ranks:
            raise ValueError(f"distributed_executor_backend={name!r} runs one rank; tensor_parallel_size x "
                             f"pipeline_parallel_size is {spec.world_size}")
        return component(pm, "executor", name, config, spec=spec)

    def _initialize(self, pm: Any, config: EngineConfig, mc: Any) -> None:
        executor = self.executor
        driver = executor.driver
        self.device = driver.device  # the driver rank's (the last pipeline stage's first GPU)
        self.bind_thread()
        attn_name, attn_cls = driver.attn_name, driver.attn_cls
        self._logits_processors: dict[str, Any] = {}
        sampler = component(pm, "sampler", config.sampler, config, vocab_size=mc.vocab_size, device=self.device,
                            logits_processors=self._logits_processor)
        self.runner = ModelRunner(executor, sampler, vocab_size=mc.vocab_size, device=self.device)
        self.spec = SpecDecoder.build(pm, config, sampler, vocab_size=mc.vocab_size, device=self.device,
                                      dtype=self.dtype)
        if self.spec is not None:
            self.spec.attach(self.runner, config, mc)  # (a drafter that reads hidden states has them captured)
            driver.extra_bytes_per_block = self.spec.kv_bytes_per_block

        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length "
                             f"({mc.max_position_embeddings})")
        max_len = config.max_model_len or mc.max_position_embeddings
        num_blocks = min(executor.call(DetermineNumBlocks(  # every rank holds every block: the fewest any can hold
            num_blocks_override=config.num_gpu_blocks_override,
            kv_cache_memory_gib=config.kv_cache_memory_gib, gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            max_model_len=max_len)))
        capacity = num_blocks * config.block_size
        if max_len > capacity:
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len={max_len} exceeds the KV cache capacity of {capacity} tokens "
                                 f"({num_blocks} blocks of {config.block_size}); lower it or give the cache more memory")
            logger.warning("max_model_len capped at the KV cache capacity: %d tokens", capacity)
            max_len = capacity
        self.max_model_len = max_len
        executor.call(InitializeCache(num_blocks, config.max_num_batched_tokens, config.max_num_seqs, max_len))
        if self.spec is not None:
            self.spec.drafter.initialize(num_blocks=num_blocks, block_size=config.block_size,
                                    max_num_seqs=config.max_num_seqs, max_model_len=max_len)
        wanted = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self.async_scheduling = wanted and attn_cls.capabilities.supports_async_scheduling
        if wanted and not self.async_scheduling:
            logger.info("async scheduling off: attention backend %s plans on the host per step", attn_name)
        self.cuda_graph_capture_s = None
        decode_graphs = attn_cls.capabilities.supports_cuda_graphs
        piecewise_tokens = config.piecewise_graph_tokens()  # (attention runs eagerly: any backend)
        if self.device.type == "cuda" and not config.enforce_eager and (decode_graphs or piecewise_tokens):
            graph_qs = attn_cls.capabilities.cuda_graph_query_lens
            spec_q = tuple(q for q in ((1 + self.spec.k,) if self.spec is not None else ())
                           if graph_qs is None or q in graph_qs)
            self.cuda_graph_capture_s = max(executor.call(
                CaptureCudaGraphs(config.max_num_seqs, max_len, spec_q, decode_graphs, piecewise_tokens)))
        num_cpu_blocks = min(executor.call(InitializeSwapSpace(config.swap_space)))
        self.kv_cache = component(pm, "kv_cache_manager", config.kv_cache_manager, config, num_blocks=num_blocks,
                                  block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                  num_cpu_blocks=num_cpu_blocks, **self._kv_window_arg(mc))
        tiers = kv_tiers(pm, config, executor)  # tiers beyond the GPU for prefix-cached blocks, fastest first
        if tiers is not None:
            self.kv_cache.attach_tier(tiers)
        if config.enable_kv_events and not self.kv_cache.enable_kv_events():  # taken each step by the front end
            logger.warning("enable_kv_events: the %s KV cache manager records no KV events", config.kv_cache_manager)
        # max_loras only with LoRA on: a scheduler written before it existed keeps working without
        self.scheduler = component(pm, "scheduler", config.scheduler, config, kv_cache=self.kv_cache,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_len,
                                   **({"max_loras": config.max_loras} if config.enable_lora else {}))
        self.lora = (LoRARegistry(config, executor, lambda: {r.lora_int_id for r in self.scheduler.requests.values()})
                     if config.enable_lora else None)
        self.attn_backend_name = attn_name
        self.num_blocks = num_blocks
        self.outputs = OutputProcessor(self.tokenizer)
        self._failed: list[Failed] = []  # failed since the last outputs were made; reported with the next
        self.last_runner_output = ModelRunnerOutput()
        self._inflight: tuple[SchedulerOutput, Any] | None = None  # a launched step not yet applied
        #: pipeline parallelism: steps through the stages at once (over disjoint requests); 1 otherwise.
        #: Speculative decoding and beam search need each step's tokens before the next: one at a time.
        self.max_in_flight = config.pipeline_parallel_size if self.spec is None else 1
        self._pipeline: collections.deque[tuple[SchedulerOutput, Any]] = collections.deque()
        self.num_overlapped_steps = 0  # pipelined steps launched while another was in flight
        self._compiling: dict[str, Request] = {}  # sequences whose grammar is still compiling
        #: inputs beyond text the model takes (its class's ModelCapabilities.modalities)
        self.modalities: tuple[str, ...] = capabilities_of(pm.get("model", mc.architecture)).modalities
        self.inputs = RequestFactory(config, mc, self.tokenizer, pm, max_model_len=max_len,
                                     eos_token_ids=self.eos_token_ids,
                                     model_dir=self.source.path if self.source.kind == "hf_dir" else None)
        self.num_prompt_tokens = self.num_generation_tokens = 0
        #: requests each rank holds block tables for, read whenever the engine goes idle
        self.rank_batch_requests = [0] * executor.world_size
        logger.info("engine ready: model=%s attention=%s scheduler=%s device=%s dtype=%s blocks=%d max_model_len=%d "
                    "ranks=%d (%s)", self.source.name, attn_name, config.scheduler, self.device, self.dtype, num_blocks,
                    max_len, executor.world_size, executor.name)

    @property
    def drafter(self) -> Drafter | None:
        """The speculative drafter (None without ``speculative_config``)."""
        return self.spec.drafter if self.spec is not None else None

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters (None without ``speculative_config``)."""
        return self.spec.stats if self.spec is not None else None

    def check_health(self) -> None:
        """Raise ``WorkerFailure`` if a rank of the engine is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the engine's ranks (worker processes, actors); idempotent."""
        self.executor.shutdown()

    def release(self) -> None:
        """Shut down and give back all held on the device (weights, KV caches, graphs); the owner's, idempotent."""
        self.shutdown()
        driver = getattr(self.executor, "driver", None)
        if driver is not None:
            driver.release()
        if self.spec is not None:
            self.spec.shutdown()
        self._pipeline.clear()  # steps in flight hold device tensors, as does the last one's output
        self.last_runner_output = ModelRunnerOutput()
        # a driver stuck in a collective of a dead rank: its device's work never ends, do not wait for it
        release_device_memory(self.device, wait_s=0.0 if not getattr(driver, "left_groups", True)
                              else RELEASE_WAIT_S)
        if self.kv_cache.tier is not None:  # after the ranks' stores finished their writes
            self.kv_cache.tier.close()

    def bind_thread(self) -> None:
        """Make the engine's device the current CUDA device of the calling thread (the current device is
        per thread: streams, events, Triton launches and graphs all use it). Call it in every thread that
        runs :meth:`step`."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def _logits_processor(self, name: str) -> Any:
        """The engine's instance of a registered logits processor (built on first use)."""
        proc = self._logits_processors.get(name)
        if proc is None:
            proc = component(self.plugin_manager, "logits_processor", name, self.config,
                             vocab_size=self.model_config.vocab_size, device=self.device)
            self._logits_processors[name] = proc
        return proc

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; ``ValueError`` naming the field."""
        return self.inputs.tokenize(prompt)

    def process_inputs(self, request_id: str | None, prompt: str | list[int] | dict,
                       params: SamplingParams | None = None, *, arrival_time: float | None = None,
                       priority: int = 0, stream_deltas: bool = False, final_only: bool = False,
                       lora_request: LoRARequest | None = None) -> tuple[ParentState, list[Request]]:
        """Tokenize and validate a request without touching the scheduler (safe from another thread).

        ``stream_deltas``: each output holds only what is new; ``final_only``: only the finished
        output is reported; ``lora_request``: the adapter to run under (``enable_lora``). Raises
        ``ValueError`` naming the field for bad input.
        """
        return self.inputs.make(request_id, prompt, params, arrival_time=arrival_time, priority=priority,
                                stream_deltas=stream_deltas, final_only=final_only, lora_request=lora_request)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        return self.inputs.structured_outputs

    def add_processed(self, parent: ParentState, children: list[Request]) -> None:
        """Queue a request made by :meth:`process_inputs` (engine thread only). All or nothing: an id
        in use (the request's or one of its ``n`` samples') is a ``ValueError`` and adds nothing."""
        for rid in (parent.request_id, *(r.request_id for r in children)):
            if rid in self.outputs.parents or rid in self.outputs.seqs or rid in self.scheduler.requests:
                raise ValueError(f"request_id: {rid!r} is already in use")
        lora = children[0].lora_request if children else None
        if lora is not None and self.lora is not None:  # registered on the ranks on first use
            self.lora.ensure(lora)
        for req in children:
            self.scheduler.add(req)
            if req.grammar is not None and not req.grammar.usable:
                self._compiling[req.request_id] = req
        self.outputs.add(parent, children)

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, **kwargs: Any) -> str:
        """Validate and queue a request; returns its id. Raises ``ValueError`` naming the field."""
        parent, children = self.process_inputs(request_id, prompt, params, **kwargs)
        self.add_processed(parent, children)
        return parent.request_id

    # -- LoRA adapters (enable_lora; docs/lora.md) -----------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter on every rank ahead of its requests; False if it already is.
        ``ValueError`` naming the field for a bad adapter (LoRA off, a bad path, a rank over the limit)."""
        lora = check_lora_request(self.config, lora_request)
        if lora is None or self.lora is None:
            raise ValueError("lora_request: expected kvforge.LoRARequest, got None")
        return self.lora.ensure(lora, revive=True)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter (its running requests finish with it); False if it is not registered."""
        return self.lora.remove(lora_int_id) if self.lora is not None else False

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters, least recently used first."""
        return self.lora.list() if self.lora is not None else []

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.scheduler.abort(self.outputs.remove(rid))

    def has_unfinished_requests(self) -> bool:
        # a step in flight whose requests have all ended (aborted, stopped) is applied by the next step
        return self.scheduler.has_unfinished() or bool(self._pipeline) or (
            self._inflight is not None and any(not r.finished for r in self._inflight[0].scheduled))

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that made progress.

        With async scheduling the step launched here is usually left running on the GPU, and the
        outputs returned are those of the step before it, applied while this one runs:

            schedule(N+1) -> launch(N+1) -> wait for N, apply its tokens, outputs -> advance(N+1)

        Step N+1 is scheduled before N's tokens are known: each request that samples in N holds a
        placeholder token (``Request.append_placeholder``) that N+1 reads from the device.
        """
        if self.max_in_flight > 1:
            return self._step_pipelined()
        outputs: list[RequestOutput] = []
        prev = self._inflight  # only ever a step that passed _may_overlap
        self._fail_bad_grammars()
        sched_out = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.scheduled(sched_out)
        handle = self.runner.launch(sched_out, self.kv_cache, prev=prev[1] if prev is not None else None)
        for rid, failure in handle.errors.items():  # before advance(): no placeholder for a failed request
            self.fail_request(rid, failure)
        if prev is not None:
            outputs += self._complete(prev)
        self.scheduler.advance(sched_out)
        self._inflight = None
        # speculation: the next step can only verify drafts proposed from this step's tokens, so a
        # step is overlapped only when the policy wants no drafts next
        driven = self.scheduler.driven_ids
        k_next = self.spec.next_num_drafts(self.scheduler.running, driven) if self.spec is not None else 0
        if (self.async_scheduling and not sched_out.is_empty and self._may_overlap(sched_out, driven)
                and not sched_out.draft_token_ids and not k_next):
            self._inflight = (sched_out, handle)
        else:
            outputs += self._complete((sched_out, handle))
            if self.spec is not None and (decoding := self._decoding()):
                self.spec.propose(k_next, decoding, self.kv_cache, self.max_model_len, pad=self.runner.graphs is not None)
        if self._inflight is None and not self.scheduler.has_unfinished():
            self.release_finished()
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline parallelism: up to ``max_in_flight`` (one per stage) launched steps over disjoint
        requests, so that stage s works on step N while stage s + 1 works on step N - 1. A request
        whose step is in flight is ``held``: the scheduler leaves it out until that step is applied.
        The oldest step is applied when the pipeline is full, or when nothing new could be launched."""
        outputs: list[RequestOutput] = []
        self._fail_bad_grammars()
        sched_out = self.scheduler.schedule()
        handle = self.runner.launch(sched_out, self.kv_cache)
        for rid, failure in handle.errors.items():
            self.fail_request(rid, failure)
        self.scheduler.advance(sched_out)
        if not sched_out.is_empty:
            for req in sched_out.scheduled:
                req.held = True
            self.num_overlapped_steps += bool(self._pipeline)  # launched while another was in flight
            self._pipeline.append((sched_out, handle))
        # beam search reads each step's result before it extends its beams: nothing stays in flight
        driven = self.scheduler.driven_ids
        flush = bool(driven) and any(r.request_id in driven for r in sched_out.scheduled)
        while self._pipeline and (len(self._pipeline) >= self.max_in_flight or sched_out.is_empty or flush):
            done = self._pipeline.popleft()
            for req in done[0].scheduled:
                req.held = False
            outputs += self._complete(done)
            if not flush:
                break
        if not self._pipeline and not self.scheduler.has_unfinished():
            self.release_finished()
        return outputs

    def release_finished(self) -> None:
        """Tell the ranks about requests that ended since the last step (done when idle: no step would),
        and read back what each rank still holds (``get_stats()["rank_batch_requests"]``)."""
        ids = self.scheduler.take_finished_ids()
        if self.lora is not None:  # adapters removed while in use go once their requests have ended
            self.lora.release_retired()
        if ids:
            self.runner.release(ids)
            self.rank_batch_requests = [s["requests"] for s in self.executor.call(BatchState())]

    def _decoding(self) -> list[Request]:
        """Running requests whose next step decodes one token of their own (drafts may join it)."""
        driven = self.scheduler.driven_ids
        return [r for r in self.scheduler.running if not r.finished and r.request_id not in driven
                and r.num_tokens - r.num_computed_tokens == 1]

    @staticmethod
    def _may_overlap(sched_out: SchedulerOutput, driven: AbstractSet[str]) -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host: none of
        its requests reads its own sampled tokens on the host to build the next step (a driven one's
        caller chooses its next token from this step's logprobs)."""
        for req in sched_out.scheduled:
            p = req.sampling_params
            if (req.request_id in driven or req.forks or req.grammar is not None or req.bad_words_token_ids
                    or p.logits_processors or p.min_tokens or p.presence_penalty or p.frequency_penalty
                    or p.repetition_penalty != 1.0):
                return False
        return True

    def _complete(self, step: tuple[SchedulerOutput, Any]) -> list[RequestOutput]:
        """Wait for a launched step; the scheduler applies its tokens (a :class:`StepResult`), the
        output processor detokenizes and finds stop strings, the scheduler ends those; then outputs."""
        sched_out, handle = step
        runner_out = handle.result(self._step_watch)
        self.last_runner_output = runner_out  # beam search reads the beams' logprobs here
        sampled = runner_out.sampled_token_ids
        for rid in [rid for rid, toks in sampled.items() if toks[-1] == NO_TOKEN]:
            del sampled[rid]
            self.fail_request(rid, NOTHING_TO_SAMPLE)
        if self.spec is not None:
            self.spec.record(sched_out, sampled)
        result = self.scheduler.update(sched_out, runner_out)
        for new in result.new_tokens:
            req = new.request
            if req.grammar is not None and not req.finished and (end := self._advance_grammar(req)) is not None:
                result.finished.append(end)
            self.num_generation_tokens += len(new.token_ids)
            if len(req.output_token_ids) == len(new.token_ids):  # its first tokens: its prompt is done
                self.num_prompt_tokens += req.num_prompt_tokens
        result.failed, self._failed = self._failed, []  # since the last outputs: launch, sampling, grammar
        decisions = self.outputs.detokenize(result, runner_out)
        for stop in decisions.stops:
            result.finished.append(self.scheduler.stop(stop.request, stop.stop,
                                                       num_output_tokens=stop.num_output_tokens))
        for rid, failure in decisions.failures:  # reported with the next outputs, as any later failure
            self.fail_request(rid, failure)
        return self.outputs.make_outputs(result, decisions)

    def _advance_grammar(self, req: Request) -> Finished | None:
        """Advance the grammar by the step's new tokens (several when drafts were accepted); returns
        the request's end when the grammar terminated."""
        g = req.grammar
        try:
            for token in req.output_token_ids[g.num_accepted:]:
                if not g.accept(token):
                    self.fail_request(req.request_id, RequestFailure(
                        "structured_outputs: the grammar rejected a sampled token", 500))
                    return None
                g.num_accepted += 1
                if g.terminated:
                    return self.scheduler.stop(req)
        except Exception as exc:
            if is_device_error(exc):
                raise
            self.fail_request(req.request_id, RequestFailure.from_exception(exc, "structured_outputs"))
        return None

    def fail_request(self, seq_id: str, failure: RequestFailure) -> None:
        """End a request that failed on its own, with all its ``n`` samples: their blocks are freed now
        and the failure is reported in the request's next output. Every other request carries on."""
        seq = self.outputs.seqs.get(seq_id)
        ids = [s.request.request_id for s in seq.parent.seqs] if seq is not None else [seq_id]
        self._failed += self.scheduler.fail_requests(ids, failure)
        logger.warning("request %s failed: %s", seq.parent.request_id if seq is not None else seq_id,
                       failure.message)

    def _fail_bad_grammars(self) -> None:
        """End the sequences whose constraint failed to compile or timed out (a 400: the request's fault)."""
        for rid, req in list(self._compiling.items()):
            if req.finished or req.grammar.ready:
                del self._compiling[rid]
                if not req.finished and req.grammar.error is not None:
                    self.fail_request(rid, RequestFailure(req.grammar.error, 400))

    def get_stats(self) -> EngineStats:
        return engine_stats(self.kv_cache.stats(), self.scheduler.stats(), num_prompt_tokens=self.num_prompt_tokens,
                            num_generation_tokens=self.num_generation_tokens,
                            spec_decode=self.spec.stats.as_dict() if self.spec is not None else None,
                            rank_batch_requests=list(self.rank_batch_requests))
