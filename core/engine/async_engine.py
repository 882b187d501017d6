"""``AsyncLLMEngine``: the engine loop on its own thread, streaming deltas to asyncio queues.

The boundary is message-shaped: the front end sends ``("add", parent, children)`` and
``("abort", request_id)`` messages into an inbox; the engine thread drains it between steps and
hands each step's ``RequestOutput`` deltas over in one call (:meth:`AsyncLLMEngine._emit`). Nothing
else crosses, which is what lets ``kvforge.engine.core`` run the same loop in a process of its own,
its outputs going to a connection instead of to queues (``kvforge.engine.process``).

Failures (docs/reliability.md): a request that fails on its own ends with ``RequestOutput.error``
and its stream raises :class:`~kvforge.errors.RequestFailedError`; every other stream carries on. An
exception that escapes a step is device-wide: the engine is dead, every stream raises
:class:`EngineDeadError` at once, and :attr:`AsyncLLMEngine.dead` is set for whoever must react
(the server stops). With ``step_timeout_s`` a :class:`~kvforge.engine.watchdog.StepWatchdog` does the same for
a loop that stops making progress (a step that never ends).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator

from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.request_streams import RequestStreams, StreamingFront
from kvforge.engine.stats import EngineStats
from kvforge.engine.watchdog import IDLE_BEAT_S, StepWatchdog
from kvforge.errors import EngineDeadError, RequestFailedError, RequestFailure, is_device_error
from kvforge.kv_events import EventBatch, KVEventLog, KVEventPage
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError"]


class AsyncLLMEngine(StreamingFront):
    def __init__(self, engine: LLMEngine, step_timeout_s: float | None = None, *, owns_engine: bool = False):
        """``step_timeout_s``: mark the engine dead when a step (or the idle loop's beat) takes longer.
        ``owns_engine``: :meth:`shutdown` gives back the engine's device memory (``LLMEngine.release``);
        otherwise it only stops the ranks, and the engine's owner (an ``LLM``) releases it."""
        self.engine = engine
        self.owns_engine = owns_engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self.streams = RequestStreams()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.dead = threading.Event()  # set once the engine loop has failed
        self._dying = threading.Lock()
        self.watchdog = StepWatchdog(step_timeout_s, self._fail) if step_timeout_s else None
        self._takes_kv_events = engine.config.enable_kv_events  # (one check a step when off)
        self.kv_events = self._kv_event_log(engine.config)

    @classmethod
    def from_config(cls, config: EngineConfig, step_timeout_s: float | None = None) -> "AsyncLLMEngine":
        return cls(LLMEngine(config), step_timeout_s, owns_engine=True)

    # -- facts the front end needs -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def modalities(self) -> tuple[str, ...]:
        return self.engine.modalities

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_source(self) -> Any:
        return self.engine.source

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def check_structured_outputs(self, so: Any) -> None:
        """Compile a constraint now (thread-safe, cached); ``ValueError`` if it is invalid."""
        if self.engine.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, and this model has none")
        self.engine.structured_outputs.check(so)

    def get_stats(self) -> EngineStats:
        """A snapshot of engine counters (read without stopping the loop: values may be a step old)."""
        return self.engine.get_stats()

    def kv_events_since(self, since: int, limit: int = 1000) -> KVEventPage | None:
        """Up to ``limit`` KV event batches numbered ``since`` on; None: ``enable_kv_events`` is off."""
        return self.kv_events.since(since, limit) if self.kv_events is not None else None

    def _kv_event_log(self, config: EngineConfig) -> KVEventLog | None:
        """Where the steps' KV events go (``kvforge.engine.core`` sends them to its front end instead)."""
        return KVEventLog.for_config(config)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
            self._thread.start()
            if self.watchdog is not None:
                self.watchdog.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wakeup.set()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._thread is not None:  # a stalled loop may never return: wait for it only briefly
            self._thread.join(1.0 if self.dead.is_set() else timeout)
        if self.owns_engine and not self.dead.is_set():  # (a dead device may never finish a release)
            self.engine.release()
        else:
            self.engine.shutdown()  # its ranks (worker processes, actors)
        if self.kv_events is not None:
            self.kv_events.close()

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                          priority: int = 0, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request (``ValueError`` naming the field for bad input) and return the
        async iterator of its output deltas. Closing the iterator early aborts the request.

        Tokenization and validation run in a worker thread, never on the event loop.
        """
        self._check_alive()
        parent, children = await asyncio.to_thread(self.engine.process_inputs, request_id, prompt, params,
                                                   priority=priority, stream_deltas=True, lora_request=lora_request)
        # the engine may have died meanwhile: then nothing would ever answer
        q = self.streams.open(request_id, self._check_alive)
        self._send(("add", parent, children))
        return self.streams.stream(request_id, q, self._abort_in_engine)

    def _abort_in_engine(self, request_id: str) -> None:
        self._send(("abort", request_id))

    # -- LoRA adapters: run on the engine thread, between steps (blocking: call from a worker thread) ----
    def add_lora(self, lora_request: Any) -> bool:
        """Register an adapter on every rank (``LLMEngine.add_lora``); ``ValueError`` if it is bad."""
        return self._on_engine_thread(self.engine.add_lora, lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._on_engine_thread(self.engine.remove_lora, lora_int_id)

    def list_loras(self) -> list:
        return self._on_engine_thread(self.engine.list_loras)

    def _on_engine_thread(self, fn: Any, *args: Any) -> Any:
        if self._thread is None or not self._thread.is_alive():
            return fn(*args)
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, args, future))
        return future.result()

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # -- hand-overs from the engine thread (``kvforge.engine.core`` sends them to its front end) -----
    def _emit(self, items: list[tuple[str, Any]], kv_events: EventBatch | None = None) -> None:
        """A step's outputs, or a request's error, to the requests' streams (one wake-up per step), and
        the step's KV events to the log."""
        if items:
            self.streams.post_many(items)
        if kv_events is not None and self.kv_events is not None:
            self.kv_events.append(kv_events)

    def _on_dead(self, exc: BaseException) -> None:
        """The loop failed: every open stream raises ``EngineDeadError``."""
        self._emit([(rid, EngineDeadError(f"the engine has stopped: {exc!r}")) for rid in self.streams.ids()])

    def _on_abort(self, request_id: str) -> None:
        """A request was aborted (on the engine thread): none of its outputs come after this."""

    def _beat(self) -> None:
        """The loop is alive: it finished a step or an idle wait (``kvforge.engine.core`` tells its front end)."""
        if self.watchdog is not None:
            self.watchdog.beat()

    def _fail(self, exc: BaseException) -> None:
        """The engine is dead (its loop raised, or the watchdog saw it stall): once, whoever calls first."""
        with self._dying:
            if self.error is not None:
                return
            self.error = exc
            self._stop = True
        self.dead.set()  # before any stream learns of it: whoever sees the error also sees `dead`
        self._on_dead(exc)

    # -- the engine thread ------------------------------------------------------------------------
    def _take_kv_events(self) -> EventBatch | None:
        events = self.engine.kv_cache.take_kv_events()
        return EventBatch(time.time(), events) if events else None

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                _, parent, children = message
                try:
                    self.engine.add_processed(parent, children)
                except ValueError as exc:
                    self._emit([(parent.request_id, exc)])
                except Exception as exc:  # a bug in one request's admission is not the engine's death
                    if is_device_error(exc):
                        raise
                    logger.exception("adding request %s failed", parent.request_id)
                    failure = RequestFailure.from_exception(exc, "add_request")
                    self._emit([(parent.request_id, RequestFailedError(failure))])
            elif message[0] == "abort":
                self.engine.abort_request(message[1])
                self._on_abort(message[1])
            elif message[0] == "call":
                _, fn, args, future = message
                try:
                    future.set_result(fn(*args))
                except Exception as exc:  # the caller's error (a bad adapter), unless the device failed
                    future.set_exception(exc)
                    if is_device_error(exc):
                        raise

    def _run(self) -> None:
        try:
            self.engine.bind_thread()
            while not self._stop:
                self._beat()
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()  # a rank that dies while idle ends the engine too
                    self.engine.release_finished()  # aborted while idle: the ranks forget them now
                    self._wakeup.wait(timeout=IDLE_BEAT_S)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                kv_events = self._take_kv_events() if self._takes_kv_events else None
                if outputs or kv_events is not None:
                    self._emit([(out.request_id, out) for out in outputs], kv_events)
        except BaseException as exc:  # the engine is dead: fail every waiting request
            if self.error is None:  # (not after the watchdog gave up on it)
                logger.exception("engine loop failed")
            self._fail(exc)
