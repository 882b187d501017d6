"""``AsyncLLMEngine``: the engine loop on its own thread, streaming deltas to asyncio queues.

The boundary is message-shaped: the front end sends ``("add", parent, children)`` and
``("abort", request_id)`` messages into an inbox; the engine thread drains it between steps and
posts each ``RequestOutput`` delta to the request's queue. Nothing else crosses, so the engine
core could move into its own process without touching either side.

Failures (docs/reliability.md): a request that fails on its own ends with ``RequestOutput.error``
and its stream raises :class:`~kvforge.errors.RequestFailedError`; every other stream carries on. An
exception that escapes a step is device-wide: the engine is dead, every stream raises
:class:`EngineDeadError` at once, and :attr:`AsyncLLMEngine.dead` is set for whoever must react
(the server stops).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, AsyncIterator

from kvforge.config import EngineConfig
from kvforge.engine import LLMEngine
from kvforge.errors import RequestFailedError, RequestFailure, is_device_error
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can be served any more."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.dead = threading.Event()  # set once the engine loop has failed

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        return cls(LLMEngine(config))

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

    def get_stats(self) -> dict[str, Any]:
        """A snapshot of engine counters (read without stopping the loop: values may be a step old)."""
        return self.engine.get_stats()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()  # its ranks (worker processes, actors)

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                          priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request (``ValueError`` naming the field for bad input) and return the
        async iterator of its output deltas. Closing the iterator early aborts the request.

        Tokenization and validation run in a worker thread, never on the event loop.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        parent, children = await asyncio.to_thread(self.engine.process_inputs, request_id, prompt, params,
                                                   priority=priority, stream_deltas=True)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            if self.error is not None:  # died after the first check: nothing would ever answer
                raise EngineDeadError(f"the engine has stopped: {self.error!r}")
            self._queues[request_id] = (loop, q)
        self._send(("add", parent, children))
        return self._stream(request_id, q)

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's output deltas (see :meth:`add_request`)."""
        async for out in await self.add_request(prompt, params, request_id, priority):
            yield out

    async def _stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                    if item.error is not None:
                        raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks return to the pool at the next step); unknown ids are ignored."""
        with self._lock:
            self._queues.pop(request_id, None)
        self._send(("abort", request_id))

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    def _post(self, request_id: str, item: Any) -> None:
        self._post_many([(request_id, item)])

    def _post_many(self, items: list[tuple[str, Any]]) -> None:
        """Hand items to their requests' queues: one wake-up of each event loop for the whole batch
        (a step's outputs), not one per request; a request's items keep their order."""
        batches: dict[Any, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for request_id, item in items:
                target = self._queues.get(request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    # -- the engine thread ------------------------------------------------------------------------
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
                    self._post(parent.request_id, exc)
                except Exception as exc:  # a bug in one request's admission is not the engine's death
                    if is_device_error(exc):
                        raise
                    logger.exception("adding request %s failed", parent.request_id)
                    self._post(parent.request_id, RequestFailedError(RequestFailure.from_exception(exc, "add_request")))
            elif message[0] == "abort":
                self.engine.abort_request(message[1])

    def _run(self) -> None:
        try:
            self.engine.bind_thread()
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_health()  # a rank that dies while idle ends the engine too
                    self.engine.release_finished()  # aborted while idle: the ranks forget them now
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._post_many([(out.request_id, out) for out in outputs])
        except BaseException as exc:  # the engine is dead: fail every waiting request
            logger.exception("engine loop failed")
            self.error = exc
            with self._lock:
                ids = list(self._queues)
            for rid in ids:
                self._post(rid, EngineDeadError(f"the engine has stopped: {exc!r}"))
            self.dead.set()


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
