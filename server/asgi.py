"""Helpers shared by the server's plain-ASGI middleware (auth, body limits, admission, request ids).

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which pipes every streamed chunk through an
extra memory stream and task.
"""
from __future__ import annotations

import json
from typing import Sequence

from starlette.types import Scope, Send

from kvforge.server.errors import error_body


def route_path(scope: Scope) -> str:
    """The path the routes see: with ``--root-path /api`` uvicorn puts ``/api`` in front of the path a
    proxy forwarded (``/api/v1/models``) and the routes match what follows it (``/v1/models``).

    NOTE: middleware that decides by path (the API key check) must use this, not ``scope["path"]``,
    or a root path would let ``/v1/*`` through unchecked. Starlette's own rule (``get_route_path``).
    """
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header (``name`` in lower case), or None."""
    return next((v for k, v in scope.get("headers") or () if k == name), None)


async def send_error(send: Send, status: int, message: str, *, param: str | None = None, type: str | None = None,
                     code: str | None = None, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Answer with OpenAI's error object, from middleware (before any route runs)."""
    payload = json.dumps(error_body(status, message, param, type, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})
