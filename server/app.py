"""The FastAPI application: routes, auth, errors and the engine's lifetime.

If the engine dies, every in-flight request has already got its error; ``/health`` answers 503 for
``DEAD_LINGER_S`` (so probes see it), then ``on_engine_dead`` is called (``kvforge serve`` stops
uvicorn, which drains and exits non-zero so that an orchestrator restarts it).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

import kvforge
from kvforge.async_engine import AsyncLLMEngine, EngineDeadError
from kvforge.errors import RequestFailedError
from kvforge.server.auth import ApiKeyAuth
from kvforge.server.body_limits import BodyLimits
from kvforge.server.disconnect import until_disconnect
from kvforge.server.errors import (
    APIError,
    error_response,
    failure_response,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from kvforge.server.metrics import ServerMetrics
from kvforge.server.openai_api import OpenAIServing
from kvforge.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

logger = logging.getLogger("kvforge.server")

#: seconds /health answers 503 after the engine died, before the server stops
DEAD_LINGER_S = 1.0
#: default of --max-request-body-bytes
DEFAULT_MAX_BODY_BYTES = 16 << 20


def create_app(engine: AsyncLLMEngine, served_names: list[str], *, api_key: str | None = None,
               chat_template: str | None = None, hook: Any = None, trust_request_chat_template: bool = False,
               max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               on_engine_dead: Callable[[], None] | None = None) -> FastAPI:
    """Build the app around a started-or-not engine; the app's lifespan starts and stops it."""

    async def watch_engine() -> None:
        while not engine.dead.is_set():
            await asyncio.sleep(0.1)
        logger.error("the engine died (%r): /health answers 503; the server stops in %.0f s",
                     engine.error, DEAD_LINGER_S)
        await asyncio.sleep(DEAD_LINGER_S)
        if on_engine_dead is not None:
            on_engine_dead()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher = asyncio.create_task(watch_engine())
        yield
        watcher.cancel()
        engine.shutdown()

    app = FastAPI(title="kvforge", version=kvforge.__version__, lifespan=lifespan)
    metrics = ServerMetrics(engine.get_stats, served_names[0])
    serving = OpenAIServing(engine, served_names, metrics, chat_template, trust_request_chat_template)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(HTTPException, handle_http_error)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), type="service_unavailable")

    @app.exception_handler(RequestFailedError)
    async def _request_failed(request: Request, exc: RequestFailedError):
        return failure_response(exc.failure)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await until_disconnect(request, serving.chat(req))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await until_disconnect(request, serving.completions(req))

    @app.get("/v1/models")
    async def models():
        src = engine.model_source
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvforge", "root": src.path or src.name,
             "max_model_len": engine.max_model_len} for name in served_names]}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return error_response(503, f"engine is not running: {engine.error!r}", type="service_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": kvforge.__version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        # off the event loop: a data-parallel engine asks its replicas (a round trip) for the counters
        text = await asyncio.to_thread(metrics.render)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            text = await serving.render_chat(req.messages, req.add_generation_prompt, None)
            ids = await serving.encode(text, False, "messages")
        else:
            ids = await serving.encode(req.prompt, req.add_special_tokens, "prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.model_name(req.model)
        tok = serving.tokenizer()
        vocab = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}

    if hook is not None:
        hook.server_app_created(app=app)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    # outermost: a body is vetted before auth, routing and validation spend anything on it
    app.add_middleware(BodyLimits, max_body_bytes=max_request_body_bytes)
    return app
