"""Readiness and the graceful drain: which requests the server admits, and how it stops.

The server is ``starting`` until the app's lifespan has started every engine (each one was ready,
model loaded, warmed up and its CUDA graphs captured, before it could be started), then ``ready``,
then ``draining`` once a shutdown is asked for (SIGTERM). ``/ready`` answers 200 only when ready;
``/health`` is liveness and stays 200 while draining, so that an orchestrator does not restart a pod
that is finishing its requests.

``Admission`` (ASGI middleware) answers 503 ``service_unavailable`` to a request that comes while the
server is starting or draining, except on ``OPEN_PATHS`` (probes, scrapes), and counts the requests it
admits, streams until their last byte. :meth:`Readiness.drain` waits for them within a timeout, then
cancels those left: each one's ``finally`` blocks abort its engine requests, and its client gets an
error (a 503, or on a started stream an error event and ``[DONE]``).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvforge.server.asgi import route_path, send_error
from kvforge.server.errors import error_event

logger = logging.getLogger("kvforge.server")

#: paths answered in every state: liveness, readiness, version and metrics
OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/metrics"})
STARTING, READY, DRAINING = "starting", "ready", "draining"


class Readiness:
    """The server's state (``starting`` -> ``ready`` -> ``draining``) and the requests in flight."""

    def __init__(self) -> None:
        self.state = STARTING
        #: called (on the event loop) when the server becomes ready; ``kvforge serve`` stops its
        #: "starting" responder there, just before uvicorn takes the sockets over
        self.on_ready: list[Callable[[], None]] = []
        self._running: dict[asyncio.Task, _Response] = {}  # admitted requests' tasks
        self._aborted: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def not_ready_reason(self) -> str | None:
        """Why ``/ready`` is not 200 (None when it is)."""
        if self.state == STARTING:
            return "the server is starting: the engines are not ready yet"
        if self.state == DRAINING:
            return "the server is draining: it is shutting down and accepts no new requests"
        return None

    def set_ready(self) -> None:
        if self.state == STARTING:
            for callback in self.on_ready:
                callback()
            self.state = READY

    async def drain(self, timeout: float) -> int:
        """Stop admitting requests, wait up to ``timeout`` seconds for those in flight (or until
        :meth:`hurry`), then cancel the rest; returns how many were cancelled."""
        self.state = DRAINING
        started = asyncio.get_running_loop().time()
        logger.info("draining: %d request(s) in flight get up to %.1f s to finish (--shutdown-timeout)",
                    self.in_flight, timeout)
        idle, hurry = asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait({idle, hurry}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            hurry.cancel()
        left = list(self._running)
        if left:
            logger.warning("draining: aborting %d request(s) still running after %.1f s", len(left),
                           asyncio.get_running_loop().time() - started)
            self._aborted.update(left)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
        else:
            logger.info("draining: every request has finished")
        return len(left)

    def hurry(self) -> None:
        """End the drain now (a second SIGTERM or Ctrl-C): what still runs is aborted."""
        self._hurry.set()

    # -- for Admission ----------------------------------------------------------------------------
    def _track(self, task: asyncio.Task, response: _Response) -> None:
        self._running[task] = response
        self._idle.clear()

    def _untrack(self, task: asyncio.Task) -> bool:
        """Forget a finished request; True if the drain cancelled it."""
        self._running.pop(task, None)
        if not self._running:
            self._idle.set()
        aborted = task in self._aborted
        self._aborted.discard(task)
        return aborted


class _Response:
    """What an admitted request has sent so far (to end it properly if the drain aborts it)."""

    def __init__(self, send: Send):
        self.send = send
        self.started = self.complete = False
        self.event_stream = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self.send(message)

    async def end_aborted(self) -> None:
        message = "the server shut down before the request finished"
        if not self.started:
            await send_error(self.send, 503, message, type="service_unavailable")
        elif not self.complete:
            tail = b""
            if self.event_stream:  # as for an engine that died: an error event (errors.error_event)
                tail = error_event(503, message).encode()
            await self.send({"type": "http.response.body", "body": tail, "more_body": False})


class Admission:
    """ASGI middleware: 503 while starting or draining (``OPEN_PATHS`` excepted); admitted requests run
    in a task of their own that the drain can cancel."""

    def __init__(self, app: ASGIApp, readiness: Readiness):
        self.app, self.readiness = app, readiness

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        reason = self.readiness.not_ready_reason()
        if reason is not None:
            # Connection: close, so that a client's next request goes to another replica
            return await send_error(send, 503, reason, type="service_unavailable",
                                    headers=[(b"connection", b"close")])
        response = _Response(send)
        task = asyncio.ensure_future(self.app(scope, receive, response))
        self.readiness._track(task, response)
        try:
            await task
        except asyncio.CancelledError:
            # the drain cancelled the request (not the server this task): answer it and carry on
            if not (task.cancelled() and self.readiness._untrack(task)):
                raise
            await response.end_aborted()
        finally:
            self.readiness._untrack(task)
