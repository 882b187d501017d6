"""Client disconnects abort the request at every stage: while the handler works (rendering, queueing,
waiting for a non-streamed answer), between the handler's return and the stream's first byte, and
mid-stream. Nothing is left behind: no queue entry, no running sequence, no KV block."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.responses import ContentStream
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Await ``work``, or cancel it when the client goes away first (its ``finally`` blocks abort what
    it started). A cancelled request gets 499, which no client reads."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the request itself is cancelled (the drain's timeout): so is its work
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)


class AbortingStreamingResponse(StreamingResponse):
    """A stream that runs ``on_close`` however it ends: finished, failed, cancelled by a disconnect,
    or never started because the client left before the first byte."""

    def __init__(self, content: ContentStream, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
