"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code


def error_response(status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": type, "param": param, "code": code}})


def bad_request_from_value_error(exc: ValueError) -> APIError:
    """Engine ``ValueError``s start with (or name) the field: use it as ``param``."""
    msg = str(exc)
    m = re.match(r"^(\w+)[:\s]", msg)
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
    if param:
        msg = f"{param}: {msg}"
    if first.get("type") == "missing":
        msg = f"{param}: field required" if param else "the request body is missing"
    return error_response(400, msg, param)
