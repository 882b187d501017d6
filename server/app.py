"""The FastAPI application: routes, auth, errors and the engines' lifetime.

One engine per served model; a request's ``model`` picks it through the app's ``ServedModels``
(``server/models.py``). If an engine dies (or stalls: its front end's step watchdog declares it dead),
every in-flight request on it has already got its error; ``/health`` answers 503 for ``DEAD_LINGER_S``
(so probes see it), then ``on_engine_dead`` is called: ``kvforge serve`` drains as on SIGTERM, so the
requests of the other models finish normally, then exits non-zero so that an orchestrator restarts it.

``/health`` is liveness (200 while the engines run, draining included); ``/ready`` is readiness (200
once the lifespan has started every engine, until the drain: ``server/readiness.py``). The middleware,
outermost first: request ids and the request line (around Starlette's error middleware too), CORS
(only with ``cors``), admission (503 while starting or draining), the API key (before any body is
read: a client without it costs a request head), body limits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import asynccontextmanager
from typing import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pluggy import HookRelay
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

import kvforge
from kvforge.engine.client import EngineClient
from kvforge.errors import EngineDeadError, RequestFailedError
from kvforge.multimodal.media import MediaLimits
from kvforge.server.anthropic_api import add_anthropic_routes
from kvforge.server.auth import ApiKeyAuth
from kvforge.server.body_limits import DEFAULT_BODY_TIMEOUT_S, BodyLimits
from kvforge.server.disconnect import until_disconnect
from kvforge.server.errors import (
    APIError,
    error_response,
    failure_response,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from kvforge.server.kv_events_route import add_kv_event_routes
from kvforge.server.lora_routes import LoRAAdapters, LoRAModule, add_lora_routes
from kvforge.server.metrics import ServerMetrics
from kvforge.server.models import ServedModel, ServedModels
from kvforge.server.openai_api import OpenAIServing
from kvforge.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvforge.server.readiness import Admission, Readiness
from kvforge.server.request_fields import FieldPolicy
from kvforge.server.request_id import REQUEST_ID_HEADER, RequestContext
from kvforge.server.response_store import MAX_STORED_BYTES, ResponseStore
from kvforge.server.responses_api import add_responses_routes
from kvforge.server.tools import ToolOptions

logger = logging.getLogger("kvforge.server")

#: seconds /health answers 503 after the engine died, before the server stops
DEAD_LINGER_S = 1.0
#: default of --max-request-body-bytes
DEFAULT_MAX_BODY_BYTES = 16 << 20


#: an engine and the names it is served under (the first is its ``model_name`` in the metrics)
EngineNames = tuple[EngineClient, list[str]]


@dataclasses.dataclass(frozen=True)
class CorsOptions:
    """Cross-origin requests from browsers (Starlette's ``CORSMiddleware``); ``"*"`` allows any."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class _App(FastAPI):
    """FastAPI with :class:`RequestContext` around the whole stack, Starlette's error middleware (which
    answers 500s) included: every answer carries the request id, every request is logged."""

    def build_middleware_stack(self) -> ASGIApp:
        return RequestContext(super().build_middleware_stack())


def create_app(engines: EngineClient | list[EngineNames] | tuple[EngineNames, ...],
               served_names: list[str] | None = None, *,
               api_key: str | None = None, chat_template: str | None = None, hook: HookRelay | None = None,
               trust_request_chat_template: bool = False, max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               on_engine_dead: Callable[[], None] | None = None, lora_modules: Sequence[LoRAModule] = (),
               allow_runtime_lora_updating: bool = False, tool_options: ToolOptions | None = None,
               cors: CorsOptions | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               responses_store_bytes: int = MAX_STORED_BYTES, strict_request_fields: bool = False,
               media: MediaLimits | None = None) -> FastAPI:
    """Build the app around started-or-not engines; the app's lifespan starts and stops them.

    One model: ``create_app(engine, ["name", "alias"])``. Several: ``create_app([(engine_a, ["a"]),
    (engine_b, ["b", "b2"])])``; a request's ``model`` picks the engine, and a request without one goes to
    the first name. ``chat_template`` applies to every engine. A name given twice is a ``ValueError``.
    ``lora_modules``: LoRA adapters registered and served once the engines start (docs/lora.md);
    ``allow_runtime_lora_updating``: answer ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
    ``tool_options``: the tool-call and reasoning parsers (docs/tools.md), for every engine.
    ``cors``: answer browsers' cross-origin requests (None: no CORS headers at all).
    ``body_timeout_s``: how long a request body may take to arrive whole (408 after it).
    ``responses_store_bytes``: the byte bound of the stored Responses API responses.
    ``media``: where chat requests' images may come from, and how large (``kvforge.multimodal.media``).
    ``strict_request_fields``: a field outside the API is a 400 naming it, not a warning and a count
    (``server/request_fields.py``).
    The app's ``state.readiness`` is the :class:`Readiness` that ``/ready`` reports and a drain uses.
    """
    pairs: list[EngineNames]
    if isinstance(engines, (list, tuple)):
        if served_names is not None:
            raise TypeError("create_app(engine, served_names) or create_app([(engine, served_names), ...])")
        pairs = list(engines)
    elif served_names is not None:
        pairs = [(engines, served_names)]
    else:
        raise TypeError("create_app(engine, served_names) or create_app([(engine, served_names), ...])")
    fields = FieldPolicy(strict_request_fields)
    metrics = ServerMetrics(ignored_fields=fields.ignored)
    models = ServedModels()
    first_name: dict[int, str] = {}  # id(engine) -> its first served name, for logs and /health
    for engine, names in pairs:
        if not names:
            raise ValueError(f"served_model_name: the engine of {engine.model_source.name!r} has no served name")
        for name in names:
            models.check_new(name)  # before the metrics take names[0] as a label
        serving = OpenAIServing(engine, metrics.add_model(engine.get_stats, names[0]), chat_template,
                                trust_request_chat_template, tool_options or ToolOptions(), media)
        src = engine.model_source
        for name in names:
            models.add(ServedModel(name, serving, src.path or src.name))
        first_name[id(engine)] = names[0]
    all_engines = models.engines

    async def watch_engines() -> None:
        while not any(engine.dead.is_set() for engine in all_engines):
            await asyncio.sleep(0.1)
        for engine in all_engines:
            if engine.dead.is_set():
                logger.error("the engine of %s died (%r): /health answers 503; the server stops in %.0f s",
                             first_name[id(engine)], engine.error, DEAD_LINGER_S)
        await asyncio.sleep(DEAD_LINGER_S)
        if on_engine_dead is not None:
            on_engine_dead()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        started = []
        try:
            for engine in all_engines:
                engine.start()
                started.append(engine)
            watcher = asyncio.create_task(watch_engines())
            for m in lora_modules:  # refused adapters stop the start-up, naming the flag
                try:
                    await adapters.load(m.name, m.path, m.base_model_name)
                except APIError as exc:
                    raise ValueError(f"--lora-modules {m.name}={m.path}: {exc.message}") from None
            readiness.set_ready()
            yield
            watcher.cancel()
        finally:  # NOTE: also when a later engine fails to start: no engine is left running
            for engine in started:
                engine.shutdown()

    app = _App(title="kvforge", version=kvforge.__version__, lifespan=lifespan)
    app.state.models, app.state.metrics = models, metrics
    readiness = app.state.readiness = Readiness()
    adapters = app.state.lora_adapters = LoRAAdapters(models)
    add_lora_routes(app, adapters, allow_runtime_lora_updating, fields)
    add_responses_routes(app, models, ResponseStore(max_bytes=responses_store_bytes), fields)
    add_anthropic_routes(app, models, fields)
    add_kv_event_routes(app, models)
    # the decorator form: Starlette types add_exception_handler's handler for any Exception
    app.exception_handler(APIError)(handle_api_error)
    app.exception_handler(RequestValidationError)(handle_validation_error)
    app.exception_handler(HTTPException)(handle_http_error)

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
        fields.screen(req)
        served = models.resolve(req.model)
        return await until_disconnect(request, served.serving.chat(req, served))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        fields.screen(req)
        served = models.resolve(req.model)
        return await until_disconnect(request, served.serving.completions(req, served))

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [m.card() for m in models.list()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        return models.resolve(model_id).card()  # an unknown id: resolve's 404 model_not_found

    @app.get("/health")
    async def health():
        down = [f"{first_name[id(e)]}: {e.error!r}" for e in all_engines if not e.is_running]
        if down:
            return error_response(503, f"engine is not running: {'; '.join(down)}", type="service_unavailable")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        reason = readiness.not_ready_reason()
        down = [f"{first_name[id(e)]}: {e.error!r}" for e in all_engines if not e.is_running]
        if reason is None and down:
            reason = f"engine is not running: {'; '.join(down)}"
        if reason is not None:
            return error_response(503, reason, type="service_unavailable")
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
        fields.screen(req)
        serving = models.resolve(req.model).serving
        if req.messages is not None and req.prompt is None:
            text = await serving.render_chat(req.messages, req.add_generation_prompt, None)
            ids = await serving.encode(text, False, "messages")
        elif req.prompt is not None and req.messages is None:
            ids = await serving.encode(req.prompt, req.add_special_tokens, "prompt")
        else:
            raise APIError(400, "prompt: give exactly one of prompt and messages", "prompt")
        return {"count": len(ids), "max_model_len": serving.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        fields.screen(req)
        tok = models.resolve(req.model).serving.tokenizer()
        vocab = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}

    if hook is not None:
        hook.server_app_created(app=app)
    # a body is vetted before routing and validation spend anything on it ...
    app.add_middleware(BodyLimits, max_body_bytes=max_request_body_bytes, body_timeout_s=body_timeout_s)
    if api_key:  # ... and only once the key is checked: a client without it gets no body read (vLLM's order)
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(Admission, readiness=readiness)  # 503 while starting or draining, before the body is read
    if cors is not None:  # outside admission and auth: preflights carry no key, and 503s need CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials, expose_headers=[REQUEST_ID_HEADER.decode()])
    return app
