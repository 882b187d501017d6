"""``kvforge serve``: build the engine, then serve the OpenAI-compatible API with uvicorn."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys

logger = logging.getLogger("kvforge.server")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Entry point (group ``kvforge.cli``): adds ``serve`` to the ``kvforge`` command."""
    from kvforge.cli import add_engine_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF directory, .gguf file, hub id or dummy:<preset> (default: SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (or set KVFORGE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use in `model` (default: the model argument)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or the template itself)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template field in requests (refused by default: templates run code)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="largest request body accepted, in bytes (default 16 MiB); larger bodies get 413")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (Ray actors) behind this one server, requests to the least busy (1)")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the server's process, not in an engine core process")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.set_defaults(func=cmd_serve)


def default_served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return model.rstrip("/")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvforge.async_engine import AsyncLLMEngine
    from kvforge.cli import engine_kwargs
    from kvforge.config import EngineConfig
    from kvforge.plugin_manager import get_plugin_manager
    from kvforge.server.app import DEFAULT_MAX_BODY_BYTES, create_app

    kwargs = engine_kwargs(args)
    model = args.model_tag or kwargs.pop("model", None)
    kwargs.pop("model", None)
    config = EngineConfig.create(kwargs.pop("config", None), model=model, **kwargs)
    api_key = args.api_key or os.environ.get("KVFORGE_API_KEY") or None
    chat_template = args.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    served = args.served_model_name or [default_served_name(config.model)]
    effective = {k: v for k, v in dataclasses.asdict(config).items()}
    logger.info("kvforge serve: effective configuration: %s", json.dumps(effective, default=str))
    max_body = args.max_request_body_bytes if args.max_request_body_bytes is not None else DEFAULT_MAX_BODY_BYTES
    if max_body < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {max_body}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1:
        from kvforge.data_parallel import DataParallelEngine

        engine = DataParallelEngine(config, args.data_parallel_size)
    elif args.engine_in_process:
        engine = AsyncLLMEngine.from_config(config)
    else:
        from kvforge.engine_process import EngineProcessClient

        engine = EngineProcessClient(config)
    server: uvicorn.Server | None = None

    def stop_serving() -> None:  # the engine died: drain and exit non-zero
        if server is not None:
            server.should_exit = True

    app = create_app(engine, served, api_key=api_key, chat_template=chat_template,
                     hook=get_plugin_manager().hook, trust_request_chat_template=args.trust_request_chat_template,
                     max_request_body_bytes=max_body, on_engine_dead=stop_serving)
    host, port = args.host, args.port

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                for s in self.servers:
                    for sock in s.sockets:
                        h, p = sock.getsockname()[:2]
                        h = f"[{h}]" if ":" in h else h
                        logger.info("kvforge ready: serving %s on http://%s:%d", ", ".join(served), h, p)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   timeout_graceful_shutdown=args.shutdown_grace))
    # uvicorn handles SIGTERM while serving (stop accepting, let running requests finish within the
    # grace period) and then re-raises it under the handler that was there before: make that one a
    # no-op, so a graceful shutdown exits 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 0 if engine.error is None else 1


if __name__ == "__main__":
    from kvforge.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
