"""``kvforge serve``: build the engines, then serve the OpenAI-compatible API with uvicorn.

Several models: ``kvforge serve A --model B`` (the positional model first), and/or a ``models`` list
in the config file, each entry a table of engine options with a ``model``::

    max_model_len = 4096            # shared: every model's default
    [[models]]
    model = "Qwen/Qwen3-0.6B"
    served_model_name = ["qwen", "qwen3"]
    [[models]]
    model = "dummy:tiny"
    gpu_memory_utilization = 0.2    # its own share

Precedence per model: defaults < the file's top level < CLI flags < its ``models`` entry. A model that
sets no ``gpu_memory_utilization`` of its own gets the shared value divided by the number of models.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from kvforge.log_format import LOG_FORMATS
from kvforge.multimodal.media import MediaLimits

if TYPE_CHECKING:
    from kvforge.config import EngineConfig
    from kvforge.engine.client import EngineClient

logger = logging.getLogger("kvforge.server")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Entry point (group ``kvforge.cli``): adds ``serve`` to the ``kvforge`` command."""
    from kvforge.cli import add_engine_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF directory, .gguf file, hub id or dummy:<preset> (default: SmolLM2-135M-Instruct)")
    add_engine_args(p, model_flag=False)
    p.add_argument("--model", dest="models", action="append", default=[],
                   help="a model to serve (after MODEL); repeat it to serve several, each with its own engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (or set KVFORGE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use in `model` for the first model (default: the model argument)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or the template itself)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template field in requests (refused by default: templates run code)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="largest request body accepted, in bytes (default 16 MiB); larger bodies get 413")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (Ray actors) behind this one server, requests routed by prefix hits and load (1)")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the server's process, not in an engine core process")
    p.add_argument("--lora-modules", nargs="+", default=[], type=_lora_module, metavar="NAME=PATH",
                   help="LoRA adapters served under their own names: name=path, or JSON {\"name\": ..., "
                        "\"path\": ..., \"base_model_name\": ...} (needs --enable-lora; docs/lora.md)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: they are 404)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='answer tool_choice "auto" (the default with tools) by parsing calls out of the output '
                        "with --tool-call-parser (off: such requests are a 400; docs/tools.md)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how tool calls are read out of a model's text: hermes, llama3_json, mistral, pythonic, "
                        "or a plugin's (kvforge plugins)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split reasoning out of the output into reasoning_content: deepseek_r1, qwen3, or a "
                        "plugin's")
    add_operations_args(p)
    add_protection_args(p)
    p.set_defaults(func=cmd_serve)


def add_protection_args(p: argparse.ArgumentParser) -> None:
    """Bounds on what a client can hold without the key, and on a stalled engine (docs/reliability.md)."""
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="close a kept-alive connection idle this long after a response (uvicorn's, 5)")
    p.add_argument("--header-timeout", type=float, default=None, metavar="SECONDS",
                   help="close a connection that has not sent a whole request head this long after it "
                        "connected or its last response (10)")
    p.add_argument("--body-timeout", type=float, default=None, metavar="SECONDS",
                   help="answer 408 and close when a request body has not arrived whole in this time (60)")
    p.add_argument("--max-unauthenticated-connections", type=int, default=None, metavar="N",
                   help="connections that have not yet sent a request head (so not shown the API key) kept "
                        "at once; past it the oldest is closed (a quarter of ulimit -n, at most 1024)")
    p.add_argument("--max-responses-store-bytes", type=int, default=None, metavar="N",
                   help="bytes of stored Responses API responses kept in memory (their JSON, each with its whole "
                        "conversation); the oldest are dropped past it, and a store=true request whose "
                        "conversation alone is larger is a 400 naming input (256 MiB)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="read file:// images of chat requests from under this directory (default: file:// refused)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="fetch http(s):// images only from these hosts (default: any host)")
    p.add_argument("--strict-request-fields", action="store_true",
                   help="a request field outside the API is a 400 naming it (default: accepted, logged as a "
                        "warning and counted in kvforge:ignored_request_fields_total, as vLLM accepts it)")
    p.add_argument("--engine-step-timeout", type=float, default=None, metavar="SECONDS",
                   help="an engine step (or, idle, a heartbeat) that takes longer marks the engine dead: "
                        "streams get an error, /health 503, the server drains and exits 1 (120)")


def add_operations_args(p: argparse.ArgumentParser) -> None:
    """Flags for running the server behind proxies and orchestrators (docs/server.md)."""
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, seconds running requests get to finish (new ones get 503) before the "
                        "rest are aborted and the server exits (30)")
    p.add_argument("--shutdown-grace", dest="shutdown_timeout", type=float, action=_DeprecatedAlias,
                   new_name="--shutdown-timeout", metavar="SECONDS", help="deprecated: use --shutdown-timeout")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="text, or json: one JSON object per line (time, level, logger, message, request_id)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="do not log a line per request (method, path, status, duration, request id)")
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy serves this server under and strips (e.g. /api)")
    p.add_argument("--allowed-origins", type=_string_list, default=None, metavar="JSON",
                   help='answer CORS requests from these origins, a JSON list (["https://a.example"], ["*"]); '
                        "default: no CORS headers at all")
    p.add_argument("--allowed-methods", type=_string_list, default=None, metavar="JSON",
                   help='methods cross-origin requests may use (with --allowed-origins; default ["*"])')
    p.add_argument("--allowed-headers", type=_string_list, default=None, metavar="JSON",
                   help='headers cross-origin requests may send (with --allowed-origins; default ["*"])')
    p.add_argument("--allow-credentials", action="store_true",
                   help="let cross-origin requests send credentials (cookies, Authorization) (with --allowed-origins)")


class _DeprecatedAlias(argparse.Action):
    """A flag kept under an old name: stores into the new flag's ``dest`` and notes it, so that
    ``serve`` warns once logging is set up."""

    def __init__(self, option_strings: list[str], dest: str, new_name: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.new_name = new_name

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        used = getattr(namespace, "deprecated_flags", ())
        namespace.deprecated_flags = (*used, (option_string, self.new_name))


def _string_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form), or for convenience one value or a comma-separated list."""
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise argparse.ArgumentTypeError(f"must be a JSON list of non-empty strings, got {text!r}")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def _cors_options(args: argparse.Namespace) -> Any:
    from kvforge.server.app import CorsOptions

    if args.allowed_origins is None:
        for flag, value in (("--allowed-methods", args.allowed_methods), ("--allowed-headers", args.allowed_headers),
                            ("--allow-credentials", args.allow_credentials or None)):
            if value is not None:
                raise ValueError(f"{flag}: has no effect without --allowed-origins (CORS is off)")
        return None
    return CorsOptions(tuple(args.allowed_origins), tuple(args.allowed_methods or ["*"]),
                       tuple(args.allowed_headers or ["*"]), args.allow_credentials)


def _positive(flag: str, value: float | None, default: float) -> float:
    """``value`` (``default`` when not given); ``ValueError`` naming ``flag`` unless it is > 0."""
    if value is None:
        return default
    if not value > 0:
        raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    return value


def _root_path(path: str) -> str:
    if path and not path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {path!r}")
    return path.rstrip("/")


def _lora_module(text: str):
    from kvforge.server.lora_routes import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/")


def served_model_configs(args: argparse.Namespace) -> list[tuple[EngineConfig, list[str]]]:
    """Each model's engine options and served names (``serve``'s parsed command line), in serving order.

    The models are the command line's (MODEL, then each ``--model``), else the config file's top-level
    ``model``, then the file's ``models`` entries; none at all: the default model.
    ``--served-model-name`` names the first model unless its entry names it.
    """
    from kvforge.cli import engine_kwargs
    from kvforge.config import EngineConfig, load_config_file

    options = engine_kwargs(args)
    config_file = options.pop("config", None)
    models = ([args.model_tag] if args.model_tag else []) + args.models
    served_model_name = args.served_model_name
    shared = _options(load_config_file(config_file) if config_file is not None else {})
    entries = shared.pop("models", None) or []
    if not isinstance(entries, list):
        raise ValueError(f"models: must be a list of tables of engine options, got {entries!r}")
    top_model = shared.pop("model", None)
    shared = _merged(shared, options)
    layers: list[dict[str, Any]] = [{"model": m} for m in models or ([top_model] if top_model else [])]
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"models[{i}]: must be a table of engine options, got {entry!r}")
        if not entry.get("model"):
            raise ValueError(f"models[{i}].model: required (the model this entry serves), got {entry!r}")
        layers.append({**_options(entry), "served_model_name": _served_names(entry.get("served_model_name"), i)})
    layers = layers or [{"model": None}]
    shared_util = EngineConfig.create(None, **shared).gpu_memory_utilization
    out: list[tuple[EngineConfig, list[str]]] = []
    for i, own in enumerate(layers):
        layer = dict(own)
        names = layer.pop("served_model_name", None)
        if len(layers) > 1 and "gpu_memory_utilization" not in layer:
            layer["gpu_memory_utilization"] = shared_util / len(layers)
        try:
            config = EngineConfig.create(None, **_merged(shared, layer))
        except ValueError as exc:
            if len(layers) == 1:
                raise
            raise ValueError(f"model {layer['model'] or default_served_name(None)!r}: {exc}") from None
        if names is None:
            names = served_model_name if i == 0 and served_model_name else [default_served_name(config.model)]
        if len(layers) > 1:
            how = "its own" if "gpu_memory_utilization" in own else f"the shared {shared_util:.3g} / {len(layers)}"
            logger.info("kvforge serve: %s gets gpu_memory_utilization=%.3g (%s)", names[0],
                        config.gpu_memory_utilization, how)
        out.append((config, names))
    seen: dict[str, str | None] = {}
    for config, names in out:
        for name in names:
            if name in seen:
                raise ValueError(f"served_model_name: {name!r} names two models ({seen[name] or 'the default'} "
                                 f"and {config.model or 'the default'}); give each model its own names")
            seen[name] = config.model
    return out


def _options(table: dict[str, Any]) -> dict[str, Any]:
    """A config file's table as ``EngineConfig.create`` keywords (``[speculative]`` is ``speculative_config``)."""
    table = dict(table)
    if "speculative" in table:
        table["speculative_config"] = table.pop("speculative")
    return table


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` wins, except that ``plugins`` tables merge per component, as in ``EngineConfig.create``."""
    for layer in (base, over):
        tables = layer.get("plugins") or {}
        if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
            raise ValueError(f"plugins must map component names to option tables, got {tables!r}")
    plugins = {k: dict(v) for k, v in (base.get("plugins") or {}).items()}
    for key, table in (over.get("plugins") or {}).items():
        plugins[key] = {**plugins.get(key, {}), **table}
    return {**base, **{k: v for k, v in over.items() if v is not None}, "plugins": plugins}


def _served_names(value: Any, index: int) -> list[str] | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"models[{index}].served_model_name: a name or a list of names, got {value!r}")
    return names


def build_engine(config: EngineConfig, data_parallel_size: int, in_process: bool,
                 step_timeout_s: float | None = None) -> EngineClient:
    """The engine ``serve`` runs for one model: data-parallel replicas, in this process, or (the default)
    in an engine core process. ``step_timeout_s``: its step watchdog (``kvforge.engine.watchdog``)."""
    from kvforge.engine.async_engine import AsyncLLMEngine

    if data_parallel_size > 1:
        from kvforge.engine.data_parallel import DataParallelEngine

        return DataParallelEngine(config, data_parallel_size, step_timeout_s=step_timeout_s)
    if in_process:
        return AsyncLLMEngine.from_config(config, step_timeout_s=step_timeout_s)
    from kvforge.engine.process import EngineProcessClient

    return EngineProcessClient(config, step_timeout_s=step_timeout_s)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvforge.log_format import configure_logging
    from kvforge.plugin_manager import get_plugin_manager
    from kvforge.server.app import DEFAULT_MAX_BODY_BYTES
    from kvforge.server.body_limits import DEFAULT_BODY_TIMEOUT_S
    from kvforge.server.http_server import StartingResponder, bind_sockets, urls
    from kvforge.server.request_id import RequestIdFilter, request_logger
    from kvforge.server.response_store import MAX_STORED_BYTES
    from kvforge.server.tools import ToolOptions

    configure_logging(logging.getLogger().level, args.log_format).addFilter(RequestIdFilter())
    if args.disable_log_requests:
        request_logger.setLevel(logging.WARNING)
    for old, new in getattr(args, "deprecated_flags", ()):
        logger.warning("%s is deprecated and will be removed: use %s", old, new)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    cors, root_path = _cors_options(args), _root_path(args.root_path)
    configs = served_model_configs(args)
    if (args.lora_modules or args.allow_runtime_lora_updating) and not any(c.enable_lora for c, _ in configs):
        raise ValueError("--lora-modules / --allow-runtime-lora-updating: no served model runs with --enable-lora")
    api_key = args.api_key or os.environ.get("KVFORGE_API_KEY") or None
    tool_options = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    chat_template = args.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    for config, names in configs:
        logger.info("kvforge serve: effective configuration of %s: %s", ", ".join(names),
                    json.dumps(dataclasses.asdict(config), default=str))
    max_body = args.max_request_body_bytes if args.max_request_body_bytes is not None else DEFAULT_MAX_BODY_BYTES
    if max_body < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {max_body}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    body_timeout = _positive("--body-timeout", args.body_timeout, DEFAULT_BODY_TIMEOUT_S)
    _positive("--timeout-keep-alive", args.timeout_keep_alive, 0.0)
    _positive("--engine-step-timeout", args.engine_step_timeout, 0.0)
    if args.max_responses_store_bytes is not None and args.max_responses_store_bytes < 1:
        raise ValueError(f"--max-responses-store-bytes must be >= 1, got {args.max_responses_store_bytes}")
    # NOTE: bound before any model loads: a busy port fails now, and until the engines are ready every
    # request gets 503 "starting" (StartingResponder) instead of a refused connection
    sockets = bind_sockets(args.host, args.port)
    responder = StartingResponder(sockets)
    responder.start()
    logger.info("kvforge serve: listening on %s; requests get 503 until the engines are ready",
                ", ".join(urls(sockets)))
    app_options = dict(api_key=api_key, chat_template=chat_template, hook=get_plugin_manager().hook,
                       trust_request_chat_template=args.trust_request_chat_template, max_request_body_bytes=max_body,
                       lora_modules=args.lora_modules, allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                       tool_options=tool_options, cors=cors, body_timeout_s=body_timeout,
                       responses_store_bytes=args.max_responses_store_bytes or MAX_STORED_BYTES,
                       strict_request_fields=args.strict_request_fields,
                       media=MediaLimits(allowed_local_media_path=args.allowed_local_media_path,
                                         allowed_media_domains=tuple(args.allowed_media_domains)
                                         if args.allowed_media_domains is not None else None))
    try:
        return _serve(args, configs, app_options, root_path, sockets, responder)
    finally:
        responder.stop()
        for sock in sockets:
            sock.close()


def _serve(args: argparse.Namespace, configs: list, app_options: dict[str, Any], root_path: str,
           sockets: list, responder: Any) -> int:
    """Build the engines (on this thread, while ``responder`` answers "starting" on ``sockets``), then
    serve on the same sockets until a shutdown; the exit status."""
    import uvicorn

    from kvforge.engine.watchdog import DEFAULT_STEP_TIMEOUT_S
    from kvforge.server.app import create_app
    from kvforge.server.connections import (
        DEFAULT_HEADER_TIMEOUT_S,
        ConnectionGuard,
        default_max_unauthenticated,
        guarded_protocol,
    )
    from kvforge.server.http_server import CLOSE_GRACE_S, Server

    guard = ConnectionGuard(_positive("--header-timeout", args.header_timeout, DEFAULT_HEADER_TIMEOUT_S),
                            default_max_unauthenticated() if args.max_unauthenticated_connections is None
                            else args.max_unauthenticated_connections)
    step_timeout = args.engine_step_timeout or DEFAULT_STEP_TIMEOUT_S
    engines: list[tuple[EngineClient, list[str]]] = []
    try:
        for config, names in configs:
            engines.append((build_engine(config, args.data_parallel_size, args.engine_in_process, step_timeout),
                            names))
    except BaseException:  # a later model failed to load: stop the engines already built
        for engine, _ in engines:
            engine.shutdown()
        raise
    served = [name for _, names in engines for name in names]
    server: Any = None

    def stop_serving() -> None:  # an engine died: drain as for SIGTERM (the other models' requests
        if server is not None:  # finish), then stop and exit non-zero
            server.drain_and_exit()

    app = create_app(engines, on_engine_dead=stop_serving, **app_options)
    readiness = app.state.readiness
    readiness.on_ready.append(responder.stop)  # uvicorn takes the sockets over right after
    config = uvicorn.Config(app, log_level="warning", log_config=None, access_log=False, root_path=root_path,
                            timeout_graceful_shutdown=CLOSE_GRACE_S, http=guarded_protocol(guard),
                            timeout_keep_alive=args.timeout_keep_alive)
    server = Server(config, readiness, args.shutdown_timeout, served)
    # Server drains on SIGTERM; a third signal goes to uvicorn, which re-raises it once it has stopped,
    # under the handler that was there before: make that one a no-op, so that even a forced shutdown
    # exits (0) instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=sockets)
    return 0 if all(engine.error is None for engine, _ in engines) else 1


if __name__ == "__main__":
    from kvforge.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
