"""``RequestStreams``: each request's asyncio queue of outputs, fed from another thread.

The engine thread (``AsyncLLMEngine``) or the reader of the engine core process
(``EngineProcessClient``) hands over a step's outputs in one call: one wake-up of each event loop per
step, not one per request, and a request's items keep their order. An item is a ``RequestOutput`` or
an exception that ends the stream.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Callable

from kvforge.errors import EngineDeadError, RequestFailedError


class RequestStreams:
    def __init__(self) -> None:
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str, check: Callable[[], None] | None = None) -> asyncio.Queue:
        """The queue of a new request (``ValueError`` if the id is in use). ``check()`` runs under the
        lock: an error it raises (the engine died meanwhile) leaves nothing registered."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            if check is not None:
                check()
            self._queues[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def is_open(self, request_id: str) -> bool:
        return request_id in self._queues  # a dict lookup: atomic, no lock needed

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._queues)

    def post(self, request_id: str, item: Any) -> None:
        self.post_many([(request_id, item)])

    def post_many(self, items: list[tuple[str, Any]]) -> None:
        """Hand items to their requests' queues (thread-safe); items of unknown requests are dropped."""
        batches: dict[Any, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for request_id, item in items:
                target = self._queues.get(request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    async def stream(self, request_id: str, q: asyncio.Queue, abort: Callable[[str], None]
                     ) -> AsyncIterator[Any]:
        """The request's outputs until it finishes; an exception item is raised, a failed request raises
        ``RequestFailedError``. Leaving early calls ``abort(request_id)``."""
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
            self.close(request_id)
            if not finished:
                abort(request_id)


class StreamingFront:
    """What an engine front end built on ``RequestStreams`` shares: ``generate`` over its
    ``add_request``, ``abort``, and the liveness check. Subclasses set ``streams`` and ``error`` and
    define ``add_request`` and ``_abort_in_engine``."""

    streams: RequestStreams
    error: BaseException | None

    async def add_request(self, prompt: Any, params: Any, request_id: str, priority: int = 0,
                          lora_request: Any = None) -> AsyncIterator[Any]:
        raise NotImplementedError

    def _abort_in_engine(self, request_id: str) -> None:
        raise NotImplementedError

    async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0,
                       lora_request: Any = None) -> AsyncIterator[Any]:
        """Stream a request's output deltas (see ``add_request``)."""
        async for out in await self.add_request(prompt, params, request_id, priority, lora_request=lora_request):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks return to the pool at the engine's next step); finished and
        unknown ids are ignored."""
        self.streams.close(request_id)
        self._abort_in_engine(request_id)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
