"""Error bodies: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, and Anthropic's
``{"type": "error", "error": {"type", "message"}}`` for a request to the Messages API's routes
(``ANTHROPIC_PREFIX``, ``server/anthropic_api.py``).

The shape follows the path of the request being handled (``RequestContext``'s, ``server/request_id.py``),
so that every error of those routes is Anthropic's whoever answers it: a handler, the API key check, the
body limits, admission.
"""
from __future__ import annotations

import json
import re
from typing import Mapping

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvforge.errors import RequestFailure


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code


#: the routes whose errors take Anthropic's shape: /v1/messages and what is under it
ANTHROPIC_PREFIX = "/v1/messages"
#: Anthropic's error type by status; any other is an invalid_request_error below 500, else an api_error
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error object, its type following the status."""
    kind = ANTHROPIC_ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _anthropic_request() -> bool:
    from kvforge.server.request_id import current_request  # NOTE: here: request_id imports this module (asgi's)

    info = current_request()
    return info is not None and anthropic_route(info.path)


def error_body(status: int, message: str, param: str | None = None, type: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object, ``type`` following the status when not given; Anthropic's
    (:func:`anthropic_error_body`) while a request to the Messages API's routes is handled."""
    if _anthropic_request():
        return anthropic_error_body(status, message)
    if type is None:
        type = "invalid_request_error" if status < 500 else (
            "service_unavailable" if status == 503 else "internal_server_error")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_event(status: int, message: str, type: str | None = None) -> str:
    """The server-sent event that ends a started stream with an error: OpenAI's ``data:`` event and
    ``[DONE]``, or, on the Messages API's routes, Anthropic's ``event: error``."""
    body = json.dumps(error_body(status, message, type=type))
    return f"event: error\ndata: {body}\n\n" if _anthropic_request() else f"data: {body}\n\ndata: [DONE]\n\n"


def error_response(status: int, message: str, param: str | None = None, type: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param, type, code), headers=headers)


def failure_response(failure: RequestFailure) -> JSONResponse:
    """A request that failed in the engine (see ``kvforge.errors``): 400 if it was its fault, else 500."""
    return error_response(failure.status, failure.message, failure.param)


def bad_request_from_value_error(exc: ValueError) -> APIError:
    """Engine ``ValueError``s start with (or name) the field: use it as ``param``."""
    msg = str(exc)
    m = re.match(r"^(\w+(?:\.\w+)*)[:\s]", msg)
    return APIError(400, msg, m.group(1) if m else None)


async def handle_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.type, exc.code)


async def handle_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # drop pydantic's union-branch labels (e.g. "str", "list[int]") from the location
    param = ".".join(p for p in loc if not re.fullmatch(r"(str|int|float|bool|list\[.*\]|function-.*)", p)) or None
    msg = first.get("msg", "invalid request")
    kind = first.get("type")
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    if param:
        msg = f"{param}: {msg}"
    if kind == "missing":
        msg = f"{param}: field required" if param else "the request body is missing"
    return error_response(400, msg, param)


async def handle_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method...) in OpenAI's shape, not ``{"detail": ...}``;
    an unknown route's names it."""
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":
        message = f"{request.method} {request.url.path}: no such route (docs/server.md lists the endpoints)"
    elif exc.status_code == 405:
        message = f"{request.method} {request.url.path}: method not allowed"
    return error_response(exc.status_code, message, None,
                          code="not_found" if exc.status_code == 404 else None, headers=exc.headers)
