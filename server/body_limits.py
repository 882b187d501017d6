"""``BodyLimits``: ASGI middleware that bounds and vets request bodies before any route sees them.

A body is refused (OpenAI-shaped error, nothing else spent on it) when it is larger than
``--max-request-body-bytes`` (413), not UTF-8, not JSON, nested deeper than ``MAX_JSON_DEPTH``, or
holds ``NaN`` / ``Infinity`` or a lone UTF-16 surrogate (400). Those would otherwise surface as a
``{"detail": ...}`` error, a 500 from the tokenizer, or a recursion error deep in validation.
A large body is parsed in a worker thread, so it never stalls the event loop. A body that takes longer
than ``--body-timeout`` to arrive whole is a 408 and ends the connection (a slow-body client would
otherwise hold its buffer and connection for as long as it likes). The rest of a body refused before it
was read whole is dropped unread (``server/connections.py``). The API key is checked before this runs.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import NoReturn

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvforge.server.asgi import send_error

#: deepest JSON nesting accepted (a chat request is ~5 deep; a JSON schema rarely 20)
MAX_JSON_DEPTH = 64
#: bodies larger than this are parsed off the event loop
_THREAD_PARSE_BYTES = 256 << 10
#: integer literals longer than this are refused (no field takes more than an int64's 19 digits)
MAX_INT_DIGITS = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(ValueError):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def _reject_constant(name: str) -> NoReturn:
    raise BodyError(400, f"the body holds {name}, which is not valid JSON (numbers must be finite)")


_LONG_DIGITS = re.compile(r"\d{%d}" % (MAX_INT_DIGITS + 1))


def _parse_int(digits: str) -> int:
    # Python refuses int() of more than 4300 digits with a bare ValueError; refuse far earlier, by name.
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyError(400, f"the body holds an integer of {len(digits.lstrip('-'))} digits; "
                             f"at most {MAX_INT_DIGITS} are accepted")
    return int(digits)


def vet_json(body: bytes) -> None:
    """Raise :class:`BodyError` unless ``body`` is UTF-8 JSON within the depth limit, with no NaN or
    Infinity and no lone surrogate in any string."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        # a Python call per integer is slow on long token lists: only a body with an over-long digit
        # run (possibly inside a string: harmless) is parsed with the checking hook
        long_int = _LONG_DIGITS.search(text) is not None
        data = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int if long_int else None)
    except RecursionError:
        raise BodyError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise BodyError(400, f"malformed JSON body: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    stack: list[tuple[object, int, str]] = [(data, 1, "")]
    while stack:  # iterative: no recursion on hostile input
        node, depth, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise BodyError(400, f"{path or 'body'}: the string holds a lone UTF-16 surrogate, which is "
                                     "not valid Unicode", path or None)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise BodyError(400, f"the body is nested deeper than {MAX_JSON_DEPTH} levels")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                raise BodyError(400, f"{path or 'body'}: a key holds a lone UTF-16 surrogate")
            stack.append((value, depth + 1, f"{path}.{key}" if path else str(key)))


#: default of --body-timeout: seconds a request body may take to arrive whole
DEFAULT_BODY_TIMEOUT_S = 60.0


class BodyLimits:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _reply(send, 413, f"the request body is {int(length)} bytes; the limit is {limit} "
                                           "(--max-request-body-bytes)")
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.body_timeout_s):
                if not await _read_body(receive, chunks, limit):
                    return  # the client went away
        except TimeoutError:
            return await _reply(send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                                           "(--body-timeout)", close=True)
        except _TooLarge:
            return await _reply(send, 413, f"the request body is over {limit} bytes (--max-request-body-bytes)")
        body = b"".join(chunks)
        if body:
            try:
                if len(body) > _THREAD_PARSE_BYTES:
                    await asyncio.to_thread(vet_json, body)
                else:
                    vet_json(body)
            except BodyError as exc:
                return await _reply(send, exc.status, str(exc), exc.param)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


class _TooLarge(Exception):
    pass


async def _read_body(receive: Receive, chunks: list[bytes], limit: int) -> bool:
    """Append the body's chunks to ``chunks``; False if the client disconnected, ``_TooLarge`` past ``limit``."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return True


_CODES = {413: "request_too_large", 408: "request_timeout"}


async def _reply(send: Send, status: int, message: str, param: str | None = None, close: bool = False) -> None:
    """The error; ``close``: end the connection with it (a body too slow to wait for)."""
    await send_error(send, status, message, param=param, code=_CODES.get(status),
                     headers=[(b"connection", b"close")] if close else [])
