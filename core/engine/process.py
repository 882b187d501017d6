"""``EngineProcessClient``: the engine core in a process of its own, behind ``AsyncLLMEngine``'s interface.

``kvforge serve`` serves through one of these (``--engine-in-process`` keeps the engine on a thread of
the server's process instead). The server's process keeps HTTP, the chat template, tokenization for
``/tokenize`` and the SSE streams; the engine core process (``python -m kvforge.engine.core``) builds
the ``LLMEngine`` (its ranks too), validates and tokenizes requests, schedules, runs the model and
detokenizes. They share no interpreter, so streaming thousands of chunks a second no longer takes
the engine loop's time (one GIL per process). The boundary is message-shaped, over a Unix socket:
the typed messages of ``kvforge.engine.messages``. A step's outputs cross as ``OutputDelta``s that
carry a request's prompt only once (``PromptSent`` / ``PromptCache``).

An ``AddRequest`` is answered first with ``Admitted`` or ``Refused`` (the ``ValueError`` that names
the bad field), so a bad request is a 400 before any stream starts. If the core process dies, every
open stream gets ``EngineDeadError``, ``dead`` is set (``/health`` answers 503) and the server stops.
So it does when the core goes silent for longer than ``step_timeout_s`` (a step that never ends, a
stopped process): every message counts as a sign of life (``kvforge.engine.watchdog``), and the process is
then killed. docs/server.md.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing.connection
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, AsyncIterator

from kvforge.config import EngineConfig
from kvforge.engine.messages import (
    AbortRequest,
    AddLora,
    AddRequest,
    Admitted,
    Call,
    CallReply,
    CheckStructuredOutputs,
    Dead,
    EngineCall,
    GetStats,
    ListLoras,
    PromptCache,
    Ready,
    Refused,
    RemoveLora,
    StartFailed,
    StepOutputs,
    Stop,
)
from kvforge.engine.request_streams import RequestStreams, StreamingFront
from kvforge.engine.stats import EngineStats
from kvforge.engine.watchdog import StepWatchdog
from kvforge.errors import EngineDeadError
from kvforge.kv_events import KVEventLog, KVEventPage
from kvforge.lora.request import LoRARequest
from kvforge.outputs import RequestOutput
from kvforge.rank.executor import stop_processes
from kvforge.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

#: the first item of an admitted request's stream (``Admitted``): outputs follow
_ADMITTED = object()
#: seconds an engine call (stats, a grammar check) may take before it fails
RPC_TIMEOUT_S = 60.0
#: seconds the core process gets to stop by itself before it is terminated, then killed
STOP_GRACE_S = 10.0


class EngineProcessClient(StreamingFront):
    """What the server needs of an engine, with the engine in a child process."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = 3600.0, step_timeout_s: float | None = None):
        from kvforge.model.loader import load_model_config, resolve_model_source
        from kvforge.model.tokenizer_source import tokenizer_for

        self.config = config
        self.error: BaseException | None = None
        self.dead = threading.Event()
        self.streams = RequestStreams()
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._dying = threading.Lock()
        self.watchdog = StepWatchdog(step_timeout_s, self._die, "engine core process") if step_timeout_s else None
        self.kv_events = KVEventLog.for_config(config)  # (its ZMQ socket bound here, before the core starts)
        key = os.urandom(16)
        self._dir = tempfile.mkdtemp(prefix="kvforge-core-")
        address = os.path.join(self._dir, "core.sock")
        listener = multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=key)
        env = dict(os.environ, KVFORGE_CORE_AUTHKEY=key.hex(),
                   KVFORGE_LOG_LEVEL=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvforge.engine.core", address], env=env)
        try:
            self.conn = self._accept(listener, start_timeout_s)
            self.conn.send(config)
            # the front end's own facts, read while the core builds its engine
            self.model_source = resolve_model_source(config.model, config.load_format)
            self.tokenizer = tokenizer_for(config, self.model_source, load_model_config(self.model_source))
            facts = self._first_message(start_timeout_s)
        except BaseException:
            listener.close()
            self._stop_process()
            raise
        listener.close()
        self.max_model_len: int = facts.max_model_len
        self.vocab_size: int = facts.vocab_size
        self.modalities: tuple[str, ...] = facts.modalities
        self._prompts = PromptCache()  # the reader thread's
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name="kvforge-core-reader", daemon=True)
        self._running = False

    # -- starting ---------------------------------------------------------------------------------
    def _accept(self, listener: Any, timeout_s: float) -> multiprocessing.connection.Connection:
        accepted: dict[str, Any] = {}

        def accept() -> None:
            try:
                accepted["conn"] = listener.accept()
            except OSError as exc:
                accepted["error"] = exc

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(timeout=0.1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine core process exited ({self._how()}) before connecting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core process did not connect within {timeout_s:.0f} s")
        if "error" in accepted:
            raise RuntimeError(f"accepting the engine core process failed: {accepted['error']!r}")
        return accepted["conn"]

    def _first_message(self, timeout_s: float) -> Ready:
        """Wait for "ready" (the engine is built) or the error that stopped it, re-raised here."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine core process exited ({self._how()}) while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core process was not ready within {timeout_s:.0f} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the engine core process exited ({self._how()}) while starting") from None
        if isinstance(msg, StartFailed):
            raise msg.error
        if not isinstance(msg, Ready):
            raise RuntimeError(f"the engine core process sent {type(msg).__name__} before it was ready")
        return msg

    def _how(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    # -- facts ------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._running and self.error is None

    def check_structured_outputs(self, so: StructuredOutputsParams) -> None:
        """Compile a constraint in the engine (cached there); ``ValueError`` if it is invalid."""
        self._call(CheckStructuredOutputs(so))

    def get_stats(self) -> EngineStats:
        return self._call(GetStats())

    def kv_events_since(self, since: int, limit: int = 1000) -> KVEventPage | None:
        """Up to ``limit`` KV event batches numbered ``since`` on (the core's steps sent them); None: off."""
        return self.kv_events.since(since, limit) if self.kv_events is not None else None

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter in the engine (blocking); ``ValueError`` if it is bad."""
        return self._call(AddLora(lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._call(RemoveLora(lora_int_id))

    def list_loras(self) -> list[LoRARequest]:
        return self._call(ListLoras())

    def _call(self, call: EngineCall) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        try:
            self._send(Call(call_id, call))
            return future.result(timeout=RPC_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._running:
            self._running = True
            self._reader.start()
            if self.watchdog is not None:
                self.watchdog.start()

    def shutdown(self, timeout: float = STOP_GRACE_S) -> None:
        self._closing = True
        if self.watchdog is not None:
            self.watchdog.stop()
        try:
            self._send(Stop())
        except (OSError, EngineDeadError):
            pass
        stalled = self.watchdog is not None and self.error is not None
        self._stop_process(0.0 if stalled else timeout)  # a stalled core will not stop by itself
        try:
            self.conn.close()
        except (OSError, AttributeError):
            pass

    def _stop_process(self, grace: float = STOP_GRACE_S) -> None:
        stop_processes([self.proc], grace)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.kv_events is not None:
            self.kv_events.close()

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                          priority: int = 0, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Queue a request in the engine and return its output deltas; ``ValueError`` naming the field
        for bad input (the engine validates it and answers before any output). Closing the iterator
        early aborts the request."""
        q = self.streams.open(request_id, self._check_alive)
        try:
            self._send(AddRequest(request_id, prompt, params, priority, lora_request))
            first = await q.get()
        except BaseException:  # the client went away (cancelled), or the engine is gone
            self.abort(request_id)
            raise
        if isinstance(first, BaseException):
            self.streams.close(request_id)
            raise first
        assert first is _ADMITTED, first  # NOTE: the core answers every AddRequest first
        return self.streams.stream(request_id, q, self._abort_in_engine)

    def _abort_in_engine(self, request_id: str) -> None:
        self._prompts.forget(request_id)
        try:
            self._send(AbortRequest(request_id))
        except (OSError, EngineDeadError):  # gone: nothing left to abort
            pass

    def _send(self, message: object) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                raise EngineDeadError(f"the engine core process is gone: {exc!r}") from None

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        error: BaseException | None = None
        while error is None:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                if self._closing or self.error is not None:
                    return
                error = RuntimeError(f"the engine core process died ({self._how()})")
                break
            if self.error is not None:  # the watchdog gave up on it: what still comes is too late
                return
            if self.watchdog is not None:
                self.watchdog.beat()
            if isinstance(msg, StepOutputs):
                # NOTE: a delta of a request whose stream is closed (aborted meanwhile) is dropped here,
                # so that its prompt is not kept for outputs that will never be asked for
                items: list[tuple[str, Any]] = [(d.request_id, self._prompts.output(d)) for d in msg.deltas
                                                if self.streams.is_open(d.request_id)]
                items += [(r.request_id, r.error) for r in msg.refused]
                if items:
                    self.streams.post_many(items)
                if msg.kv_events is not None and self.kv_events is not None:
                    self.kv_events.append(msg.kv_events)
            elif isinstance(msg, Admitted):
                self.streams.post(msg.request_id, _ADMITTED)
            elif isinstance(msg, Refused):
                self.streams.post(msg.request_id, msg.error)
            elif isinstance(msg, CallReply):
                future = self._calls.get(msg.call_id)
                if future is not None and msg.ok:
                    future.set_result(msg.value)
                elif future is not None:
                    future.set_exception(msg.error)
            elif isinstance(msg, Dead):
                error = RuntimeError(msg.message)
        self._die(error)

    def _die(self, error: BaseException) -> None:
        """The core is dead (it said so, its connection broke, or the watchdog gave up on it): fail every
        stream and call, once."""
        with self._dying:
            if self.error is not None:
                return
            self.error = error
        logger.error("engine core process (pid %d): %s", self.proc.pid, error)
        self.dead.set()  # before any stream learns of it: whoever sees the error also sees `dead`
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine has stopped: {error!r}"))
        self.streams.post_many([(rid, EngineDeadError(f"the engine has stopped: {error!r}"))
                                for rid in self.streams.ids()])
