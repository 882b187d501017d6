"""The FastAPI application: routes, auth, errors and the engine's lifetime."""
from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

import kvforge
from kvforge.async_engine import AsyncLLMEngine, EngineDeadError
from kvforge.server.errors import (APIError, error_response, handle_api_error, handle_validation_error)
from kvforge.server.metrics import ServerMetrics
from kvforge.server.openai_api import OpenAIServing
from kvforge.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest)

logger = logging.getLogger("kvforge.server")


def create_app(engine: AsyncLLMEngine, served_names: list[str], *, api_key: str | None = None,
               chat_template: str | None = None, hook: Any = None) -> FastAPI:
    """Build the app around a started-or-not engine; the app's lifespan starts and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="kvforge", version=kvforge.__version__, lifespan=lifespan)
    metrics = ServerMetrics(engine.get_stats, served_names[0])
    serving = OpenAIServing(engine, served_names, metrics, chat_template)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc), type="service_unavailable")

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            # constant-time comparison, so the key cannot be found byte by byte from timings
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return error_response(401, "Incorrect API key provided.", None, code="invalid_api_key")
        return await call_next(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return await serving.chat(req)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await serving.completions(req)

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
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.model_name(req.model)
        tok = serving.tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            text = serving.render_chat(req.messages, req.add_generation_prompt, None)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.model_name(req.model)
        tok = serving.tokenizer()
        vocab = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    if hook is not None:
        hook.server_app_created(app=app)
    return app
