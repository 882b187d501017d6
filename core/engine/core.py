"""The engine core process of :class:`~kvforge.engine.process.EngineProcessClient`:
``python -m kvforge.engine.core ADDRESS`` (the key in ``KVFORGE_CORE_AUTHKEY``).

It connects back to the front end, receives the ``EngineConfig``, builds the engine and answers
``Ready`` (or ``StartFailed``), then serves the front end's messages until told to stop or the front
end is gone. Requests are validated and tokenized on a small thread pool, never on the engine loop;
each step's outputs cross in one message. The messages are ``kvforge.engine.messages``'s types.
"""
from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

from kvforge.config import EngineConfig
from kvforge.engine.async_engine import AsyncLLMEngine
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.messages import (
    ENGINE_CALLS,
    AbortRequest,
    AddRequest,
    Admitted,
    Beat,
    Call,
    CallReply,
    Dead,
    PromptSent,
    Ready,
    Refused,
    StartFailed,
    StepOutputs,
    Stop,
)
from kvforge.kv_events import EventBatch, KVEventLog
from kvforge.log_format import configure_logging, inherited_format

logger = logging.getLogger("kvforge.engine.core")

#: seconds between the loop's heartbeats to the front end (``kvforge.engine.watchdog``) when it sends nothing else
BEAT_S = 0.5


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineCore(AsyncLLMEngine):
    """``AsyncLLMEngine``'s loop with its outputs going to the front end's connection."""

    def __init__(self, config: EngineConfig, conn: multiprocessing.connection.Connection):
        super().__init__(LLMEngine(config), owns_engine=True)
        self.conn = conn
        self._conn_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvforge-admit")
        self._admit_lock = threading.Lock()
        self._admitting: set[str] = set()  # requests being validated
        self._cancelled: set[str] = set()  # ... and aborted meanwhile
        self._last_sent = 0.0  # monotonic time of the last message to the front end
        self._prompts = PromptSent()  # whose prompt the front end has (engine loop thread only)

    # -- AsyncLLMEngine's hand-overs, to the front end ------------------------------------------
    def _kv_event_log(self, config: EngineConfig) -> KVEventLog | None:
        return None  # the front end's process keeps the log and the ZMQ socket: the events go there

    def _emit(self, items: list[tuple[str, Any]], kv_events: EventBatch | None = None) -> None:
        deltas, refused = [], []
        for rid, item in items:
            if isinstance(item, BaseException):
                refused.append(Refused(rid, portable(item)))
            else:
                deltas.append(self._prompts.delta(item))
        self._reply(StepOutputs(deltas, refused, kv_events))

    def _on_abort(self, request_id: str) -> None:
        self._prompts.forget(request_id)

    def _on_dead(self, exc: BaseException) -> None:
        self._reply(Dead(f"{type(exc).__name__}: {exc}"))

    def _beat(self) -> None:
        # the front end's watchdog hears from the loop at least every BEAT_S (outputs count as beats)
        now = time.monotonic()
        if now - self._last_sent >= BEAT_S:
            self._reply(Beat())

    def _reply(self, message: object) -> None:
        with self._conn_lock:
            self._last_sent = time.monotonic()
            try:
                self.conn.send(message)
            except (BrokenPipeError, ConnectionError, OSError):  # the front end is gone
                pass

    # -- the front end's messages ---------------------------------------------------------------
    def serve(self) -> int:
        self._reply(Ready(self.max_model_len, self.vocab_size, self.modalities))
        self.start()
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the front end is gone
                break
            if isinstance(msg, AddRequest):
                with self._admit_lock:
                    self._admitting.add(msg.request_id)
                self._pool.submit(self._admit, msg)
            elif isinstance(msg, AbortRequest):
                with self._admit_lock:
                    if msg.request_id in self._admitting:
                        self._cancelled.add(msg.request_id)
                self.abort(msg.request_id)
            elif isinstance(msg, Call):
                self._pool.submit(self._call, msg)
            elif isinstance(msg, Stop):
                break
            else:
                logger.error("unknown message from the front end, ignored: %r", type(msg).__name__)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.shutdown()
        return 0 if self.error is None else 1

    def _admit(self, msg: AddRequest) -> None:
        """Validate and tokenize a request (off the engine loop), then queue it; the front end gets
        ``Admitted`` first, or ``Refused`` with the error (a ``ValueError`` names the field)."""
        request_id = msg.request_id
        try:
            parent, children = self.engine.process_inputs(request_id, msg.prompt, msg.params, priority=msg.priority,
                                                          stream_deltas=True, lora_request=msg.lora_request)
        except Exception as exc:
            with self._admit_lock:
                self._admitting.discard(request_id)
                self._cancelled.discard(request_id)
            self._reply(Refused(request_id, portable(exc)))
            return
        with self._admit_lock:
            self._admitting.discard(request_id)
            if request_id in self._cancelled:  # aborted while it was validated
                self._cancelled.discard(request_id)
                return
            self._reply(Admitted(request_id))
            self._send(("add", parent, children))

    def _call(self, msg: Call) -> None:
        try:
            if not isinstance(msg.call, ENGINE_CALLS):
                raise ValueError(f"unknown engine call {type(msg.call).__name__}")
            self._reply(CallReply(msg.call_id, True, msg.call.apply(self)))
        except Exception as exc:
            self._reply(CallReply(msg.call_id, False, portable(exc)))


def main(argv: list[str]) -> int:
    # a Ctrl-C reaches the whole process group: the front end drains, then sends "stop"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(os.environ.get("KVFORGE_LOG_LEVEL", "INFO"), inherited_format())  # the server's format
    conn = multiprocessing.connection.Client(argv[0], family="AF_UNIX",
                                             authkey=bytes.fromhex(os.environ["KVFORGE_CORE_AUTHKEY"]))
    config = conn.recv()
    try:
        core = EngineCore(config, conn)
    except BaseException as exc:
        logger.exception("the engine failed to start")
        try:
            conn.send(StartFailed(portable(exc)))
        except OSError:
            pass
        return 1
    return core.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
