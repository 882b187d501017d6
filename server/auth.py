"""``ApiKeyAuth``: the API key check of ``kvforge serve --api-key``."""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvforge.server.asgi import header, route_path
from kvforge.server.errors import error_response

#: paths that cost compute, and so need the API key when one is set (/health, /version, /metrics stay open)
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/kv_events")  # (KV events carry prompts' token ids)


class ApiKeyAuth:
    """ASGI middleware: requests to ``PROTECTED_PREFIXES`` (under ``--root-path`` too) need
    ``Authorization: Bearer <api_key>`` (OpenAI's clients) or ``x-api-key: <api_key>`` (Anthropic's), on
    every route (401 otherwise). Plain ASGI, not ``@app.middleware``: Starlette's
    ``BaseHTTPMiddleware`` pipes every streamed chunk through an extra memory stream and task, a large
    part of a token's serving cost."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith(PROTECTED_PREFIXES):
            value = header(scope, b"authorization") or b""
            bearer = value[7:] if value[:7].lower() == b"bearer " else b""
            api_key = header(scope, b"x-api-key") or b""
            # constant-time comparisons, both made (`|`, not `or`), so the key cannot be found byte by byte
            # from timings
            if not (hmac.compare_digest(bearer, self.key) | hmac.compare_digest(api_key, self.key)):
                # NOTE: checked before the body is read (this runs outside BodyLimits): what the client
                # still sends is dropped unread, for a bounded time (server/connections.py)
                response = error_response(401, "Incorrect API key provided.", None, code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
