"""The router's FastAPI app: each completion goes to the healthy backend with the best prefix score.

For ``POST /v1/completions`` and ``/v1/chat/completions`` the router gets the prompt's token ids from a
backend's ``POST /tokenize`` (a completion's ``prompt``, or a chat's ``messages`` through the model's chat
template: the ids the engine will see, as long as no ``tools`` or ``chat_template`` change the rendering),
hashes them in blocks as the engines do (``kvforge.engine.prefix_router.prompt_block_hashes``) and sends the
request, byte for byte, to :func:`~kvforge.engine.prefix_router.best`'s backend; the answer (a stream too)
comes back as it is made. A backend that cannot be reached before it answered is taken out and the request
tries the next one. A client that hangs up closes the backend's connection, which aborts the request there.
``GET /v1/models`` is the least loaded backend's; ``GET /health`` is 200 while any backend is in;
``GET /backends`` says what the router knows of each.
"""
from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvforge.engine.prefix_router import Candidate, best, prompt_block_hashes
from kvforge.router.backends import Backend, BackendPool

logger = logging.getLogger("kvforge.router")

#: request headers not forwarded (hop by hop, or set again by the client library)
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
        "proxy-authorization", "proxy-connection"}
_AUTH = ("authorization", "x-api-key")
#: seconds a backend has to answer the router's own calls (/tokenize, /v1/models)
CALL_TIMEOUT_S = 10.0


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "service_unavailable", "param": None,
                                   "code": None}}, status_code=status)


class Router:
    """Picks a backend for a prompt and relays the request to it."""

    def __init__(self, pool: BackendPool, load_weight: float):
        self.pool, self.load_weight = pool, load_weight

    def choose(self, ids: list[int] | None, exclude: set[str]) -> tuple[Backend, list[int]] | None:
        """The best healthy backend not in ``exclude`` and the prompt's block hashes in its block size."""
        backends = [b for b in self.pool.healthy() if b.url not in exclude]
        hashes_by_size: dict[int, list[int]] = {}
        candidates = []
        for i, b in enumerate(backends):
            hashes = hashes_by_size.get(b.block_size)
            if hashes is None:
                hashes = hashes_by_size[b.block_size] = prompt_block_hashes(ids, b.block_size) if ids else []
            candidates.append(Candidate(i, b.prefixes.matched(hashes), b.load, b.routed))
        choice = best(candidates, self.load_weight)
        if choice is None:
            return None
        b = backends[choice.index]
        return b, hashes_by_size[b.block_size]

    async def prompt_ids(self, body: Any, chat: bool, headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids, from the least loaded backend's ``/tokenize``; None when unknown (a
        body the backend will refuse, several prompts of which none is first-class, no backend)."""
        if not isinstance(body, dict):
            return None
        query: dict[str, Any] = {"model": body.get("model")}
        if chat:
            query.update(messages=body.get("messages"), add_generation_prompt=body.get("add_generation_prompt", True))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
                prompt = prompt[0]  # a batch: the first prompt decides
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None
            query["prompt"] = prompt
        healthy = sorted(self.pool.healthy(), key=lambda b: b.load)
        if not healthy:
            return None
        try:
            r = await self.pool.client.post(f"{healthy[0].url}/tokenize", json=query, headers=headers,
                                            timeout=CALL_TIMEOUT_S)
            tokens = r.json().get("tokens") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return tokens if isinstance(tokens, list) else None

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the backend answers the 400
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        ids = await self.prompt_ids(body, chat, {k: v for k, v in headers.items() if k.lower() in _AUTH})
        tried: set[str] = set()
        while True:
            picked = self.choose(ids, tried)
            if picked is None:
                return _error(503, "no backend is healthy" if not tried else
                              f"no backend could take the request (tried {', '.join(sorted(tried))})")
            b, hashes = picked
            b.in_flight += 1
            b.routed += 1
            b.prefixes.replay(hashes)
            upstream_request = self.pool.client.build_request("POST", f"{b.url}{path}", content=raw, headers=headers)
            try:
                upstream = await self.pool.client.send(upstream_request, stream=True)
            except httpx.TransportError as exc:  # it never answered: another one may
                b.in_flight -= 1
                b.routed -= 1
                self.pool.mark_dead(b, repr(exc))
                tried.add(b.url)
                continue
            except BaseException:
                b.in_flight -= 1
                raise
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
            return StreamingResponse(self._relay(b, upstream), status_code=upstream.status_code, headers=out_headers)

    async def _relay(self, b: Backend, upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:  # finished, failed, or the client hung up (closing the backend's connection aborts it there)
            b.in_flight -= 1
            with anyio.CancelScope(shield=True):  # (a hang-up cancels the stream: the close must still run)
                await upstream.aclose()


def create_router_app(pool: BackendPool, load_weight: float) -> FastAPI:
    router = Router(pool, load_weight)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        try:
            yield
        finally:
            await pool.stop()
            await pool.client.aclose()

    app = FastAPI(title="kvforge router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _AUTH}
        for b in sorted(pool.healthy(), key=lambda b: b.load):
            try:
                r = await pool.client.get(f"{b.url}/v1/models", headers=headers, timeout=CALL_TIMEOUT_S)
            except httpx.TransportError as exc:
                pool.mark_dead(b, repr(exc))
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return _error(503, "no backend is healthy")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200) if pool.healthy() else _error(503, "no backend is healthy")

    @app.get("/backends")
    async def backends() -> dict[str, Any]:
        return {"load_weight": load_weight, "backends": [b.status() for b in pool.backends]}

    return app
