"""``ApiKeyAuth``: the API key check of ``kvforge serve --api-key``."""
from __future__ import annotations

import hmac
from typing import Any

from kvforge.server.errors import error_response

#: paths that cost compute, and so need the API key when one is set (/health, /version, /metrics stay open)
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class ApiKeyAuth:
    """ASGI middleware: requests to ``PROTECTED_PREFIXES`` need ``Authorization: Bearer <api_key>``
    (401 otherwise). Plain ASGI, not ``@app.middleware``: Starlette's ``BaseHTTPMiddleware`` pipes every
    streamed chunk through an extra memory stream and task, a large part of a token's serving cost."""

    def __init__(self, app: Any, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            # constant-time comparison, so the key cannot be found byte by byte from timings
            if not hmac.compare_digest(given, self.key):
                response = error_response(401, "Incorrect API key provided.", None, code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
