"""Request ids and the request log line: ``RequestContext`` is the server's outermost middleware.

Every HTTP request gets an id: the client's ``X-Request-Id`` when it is valid (1 to
``MAX_REQUEST_ID_LEN`` visible ASCII characters, ``!`` to ``~``), else a new ``uuid4().hex``. It is
echoed in the response's ``X-Request-Id`` (errors and streams too), is the ``request_id`` of every log
line written while the request is handled (a contextvar that :class:`RequestIdFilter` copies onto the
records), and starts the ids of the engine requests it queues (``<request id>:chatcmpl-<hex>``), so
that the engine core process's lines can be matched to it.

When the request ends, one line goes to the ``kvforge.server.requests`` logger: method, path, status,
duration and the response's id (``chatcmpl-...``), at INFO, or at DEBUG for the probe and scrape paths
(``QUIET_PATHS``). ``--disable-log-requests`` raises that logger to WARNING.
"""
from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
import uuid
from typing import TypeGuard

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvforge.server.asgi import header, route_path

#: the logger of per-request lines (``--disable-log-requests`` silences it)
request_logger = logging.getLogger("kvforge.server.requests")

REQUEST_ID_HEADER = b"x-request-id"
#: the longest client-given id kept (a longer one is replaced, as vLLM and proxies do)
MAX_REQUEST_ID_LEN = 128
#: paths whose request lines are DEBUG: probes, scrapers and routers call them every few seconds
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics", "/kv_events"})


@dataclasses.dataclass
class RequestInfo:
    """What the request line says about a request; handlers fill ``response_id`` and ``user``."""

    request_id: str
    path: str = ""  # the route path (``asgi.route_path``): errors.py picks the error shape by it
    response_id: str | None = None  # the id of the answer (chatcmpl-..., cmpl-..., resp_...)
    user: str | None = None  # OpenAI's end-user field


_current: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("kvforge_request", default=None)


def current_request() -> RequestInfo | None:
    """The HTTP request being handled (None outside one, e.g. in a bare ``OpenAIServing`` call)."""
    return _current.get()


def current_request_id() -> str | None:
    info = _current.get()
    return info.request_id if info is not None else None


def valid_request_id(value: bytes | None) -> TypeGuard[bytes]:
    """1 to ``MAX_REQUEST_ID_LEN`` bytes, each visible ASCII (no space, no control character)."""
    return value is not None and 0 < len(value) <= MAX_REQUEST_ID_LEN and all(0x21 <= b <= 0x7E for b in value)


def request_id_of(scope: Scope) -> str:
    """The client's ``X-Request-Id`` when valid, else a new one."""
    given = header(scope, REQUEST_ID_HEADER)
    return given.decode("ascii") if valid_request_id(given) else uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on every record as ``request_id`` (None outside a request).
    Install it on handlers (a logger's filters skip records propagated from child loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id()
        return True


class RequestContext:
    """ASGI middleware: the request id (see the module docstring), its response header, the request line."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        info = RequestInfo(request_id_of(scope), route_path(scope))
        token = _current.set(info)
        status = 0
        echoed = (REQUEST_ID_HEADER, info.request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers") or () if h[0].lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, echoed]}
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = info.path
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            if request_logger.isEnabledFor(level):
                _log_request(level, scope["method"], path, status, time.perf_counter() - start, info)
            _current.reset(token)


def _log_request(level: int, method: str, path: str, status: int, seconds: float, info: RequestInfo) -> None:
    # status 0: the client left (or the server stopped) before an answer started
    text = f"{method} {path} {status or '-'} {seconds:.3f} s"
    fields: dict[str, str | int | float | None] = {"method": method, "path": path, "status": status or None,
                              "duration_s": round(seconds, 6)}
    if info.response_id:
        text += f" {info.response_id}"
        fields["response_id"] = info.response_id
    if info.user is not None:
        text += f" user={info.user!r}"
        fields["user"] = info.user
    request_logger.log(level, text, extra={"fields": fields})
