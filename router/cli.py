"""``kvforge router --backend URL [--backend URL ...]``: the prefix-aware router in front of ``kvforge serve``
replicas (``kvforge.router.app``; docs/distributed.md, "A prefix-aware router")."""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from kvforge.engine.prefix_router import DEFAULT_LOAD_WEIGHT, check_load_weight

logger = logging.getLogger("kvforge.router")

#: seconds the router gives a backend to accept a connection (a request's answer may take as long as it takes)
CONNECT_TIMEOUT_S = 5.0


def add_router_parser(subparsers: argparse._SubParsersAction) -> None:
    """Entry point (group ``kvforge.cli``): adds ``router`` to the ``kvforge`` command."""
    p = subparsers.add_parser("router", help="route requests to kvforge serve replicas by prefix-cache hits and load")
    p.add_argument("--backend", dest="backends", action="append", default=[], metavar="URL",
                   help="a kvforge serve replica, http://host:port (repeat it for each)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--load-weight", type=float, default=DEFAULT_LOAD_WEIGHT,
                   help="what a request in flight costs a backend's score, in matched prefix blocks (1.0)")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between two health checks (and /metrics reads) of each backend (1.0)")
    p.add_argument("--events-interval", type=float, default=0.2,
                   help="seconds between two reads of each backend's GET /kv_events (0.2)")
    p.add_argument("--api-key", default=None,
                   help="the backends' key, for the router's own GET /kv_events (or set KVFORGE_API_KEY); "
                        "clients' requests carry their own")
    p.set_defaults(func=cmd_router)


def _interval(flag: str, value: float) -> float:
    if not 0 < value < math.inf:
        raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    return value


def cmd_router(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn

    from kvforge.log_format import configure_logging
    from kvforge.router.app import create_router_app
    from kvforge.router.backends import BackendPool

    if not args.backends:
        raise ValueError("--backend: give at least one kvforge serve URL (http://host:port)")
    for url in args.backends:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--backend: must be an http:// or https:// URL, got {url!r}")
    if len(set(args.backends)) != len(args.backends):
        raise ValueError(f"--backend: a URL is given twice: {args.backends}")
    load_weight = check_load_weight(args.load_weight, "--load-weight")
    health, events = _interval("--health-interval", args.health_interval), _interval("--events-interval",
                                                                                     args.events_interval)
    configure_logging(logging.getLogger().level, "text")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per poll otherwise)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    pool = BackendPool(args.backends, client, health_interval=health, events_interval=events,
                       api_key=args.api_key or os.environ.get("KVFORGE_API_KEY") or None)
    app = create_router_app(pool, load_weight)
    logger.info("kvforge router: %d backend(s), load_weight=%g, on http://%s:%d", len(pool.backends), load_weight,
                args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", log_config=None, access_log=False)
    return 0


if __name__ == "__main__":
    from kvforge.cli import main
    sys.exit(main(["router", *sys.argv[1:]]))
