"""The engine core process of :class:`~kvforge.engine_process.EngineProcessClient`:
``python -m kvforge.engine_core ADDRESS`` (the key in ``KVFORGE_CORE_AUTHKEY``).

It connects back to the front end, receives the ``EngineConfig``, builds the engine and answers
``("ready", facts)`` (or ``("error", exc)``), then serves the front end's messages until told to stop
or the front end is gone. Requests are validated and tokenized on a small thread pool, never on the
engine loop; each step's outputs cross in one message. The message kinds are listed in
``kvforge.engine_process``.
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

from kvforge.async_engine import AsyncLLMEngine
from kvforge.config import EngineConfig
from kvforge.engine import LLMEngine
from kvforge.engine_process import ACCEPTED
from kvforge.log_format import configure_logging, inherited_format

logger = logging.getLogger("kvforge.engine_core")

#: seconds between the loop's heartbeats to the front end (``kvforge.watchdog``) when it sends nothing else
BEAT_S = 0.5
#: the calls the front end may make (EngineProcessClient's own methods of the same names)
RPC_METHODS = frozenset({"get_stats", "check_structured_outputs", "add_lora", "remove_lora", "list_loras"})


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
        super().__init__(LLMEngine(config))
        self.conn = conn
        self._conn_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvforge-admit")
        self._admit_lock = threading.Lock()
        self._admitting: set[str] = set()  # requests being validated
        self._cancelled: set[str] = set()  # ... and aborted meanwhile
        self._last_sent = 0.0  # monotonic time of the last message to the front end

    # -- AsyncLLMEngine's hand-overs, to the front end ------------------------------------------
    def _emit(self, items: list[tuple[str, Any]]) -> None:
        self._reply(("out", [(rid, portable(item) if isinstance(item, BaseException) else item)
                             for rid, item in items]))

    def _on_dead(self, exc: BaseException) -> None:
        self._reply(("dead", f"{type(exc).__name__}: {exc}"))

    def _beat(self) -> None:
        # the front end's watchdog hears from the loop at least every BEAT_S (outputs count as beats)
        now = time.monotonic()
        if now - self._last_sent >= BEAT_S:
            self._reply(("beat",))

    def _reply(self, message: tuple) -> None:
        with self._conn_lock:
            self._last_sent = time.monotonic()
            try:
                self.conn.send(message)
            except (BrokenPipeError, ConnectionError, OSError):  # the front end is gone
                pass

    # -- the front end's messages ---------------------------------------------------------------
    def serve(self) -> int:
        self._reply(("ready", {"max_model_len": self.max_model_len, "vocab_size": self.vocab_size}))
        self.start()
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the front end is gone
                break
            kind = msg[0]
            if kind == "add":
                with self._admit_lock:
                    self._admitting.add(msg[1])
                self._pool.submit(self._admit, *msg[1:])
            elif kind == "abort":
                with self._admit_lock:
                    if msg[1] in self._admitting:
                        self._cancelled.add(msg[1])
                self.abort(msg[1])
            elif kind == "rpc":
                self._pool.submit(self._rpc, *msg[1:])
            elif kind == "stop":
                break
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.shutdown()
        return 0 if self.error is None else 1

    def _admit(self, request_id: str, prompt: Any, params: Any, priority: int, lora_request: Any = None) -> None:
        """Validate and tokenize a request (off the engine loop), then queue it; the front end gets
        ``ACCEPTED`` first, or the error (a ``ValueError`` names the field)."""
        try:
            parent, children = self.engine.process_inputs(request_id, prompt, params, priority=priority,
                                                          stream_deltas=True, lora_request=lora_request)
        except Exception as exc:
            with self._admit_lock:
                self._admitting.discard(request_id)
                self._cancelled.discard(request_id)
            self._emit([(request_id, exc)])
            return
        with self._admit_lock:
            self._admitting.discard(request_id)
            if request_id in self._cancelled:  # aborted while it was validated
                self._cancelled.discard(request_id)
                return
            self._emit([(request_id, ACCEPTED)])
            self._send(("add", parent, children))

    def _rpc(self, call: int, method: str, args: tuple) -> None:
        try:
            if method not in RPC_METHODS:
                raise ValueError(f"unknown engine call {method!r}")
            self._reply(("reply", call, True, getattr(self, method)(*args)))
        except Exception as exc:
            self._reply(("reply", call, False, portable(exc)))


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
            conn.send(("error", portable(exc)))
        except OSError:
            pass
        return 1
    return core.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
