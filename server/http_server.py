"""The HTTP side of ``kvforge serve``'s lifetime: bind first, answer "starting" while the engines load,
serve, and drain on SIGTERM.

1. :func:`bind_sockets` binds the port before any model loads, so a busy port fails at once and
   clients and probes get answers, not refused connections.
2. :class:`StartingResponder` answers every request on those sockets with 503 ``service_unavailable``
   ("the server is starting") while the engines load (a thread per socket; the engines are built on
   the main thread, as before).
3. :class:`Server` (uvicorn's) takes the same sockets over once the app's lifespan has started the
   engines: nothing is refused in between, a connection waits in the listen backlog at most.
4. On SIGTERM (or Ctrl-C) :class:`Server` drains (``Readiness.drain``: new requests get 503, those in
   flight get ``--shutdown-timeout`` seconds), then lets uvicorn close the connections and the lifespan
   stop the engines. A second signal ends the drain at once; a third is uvicorn's (a forced exit).
   An engine that dies starts the same drain (:meth:`Server.drain_and_exit`).
5. Connections are uvicorn's h11 protocol under a ``ConnectionGuard`` (``server/connections.py``): a
   deadline for each request head and a cap on connections that have sent none.
"""
from __future__ import annotations

import asyncio
import http.server
import json
import logging
import socket
import socketserver
import threading
import uuid
from typing import Any

import uvicorn

from kvforge.server.connections import AcceptErrorLog
from kvforge.server.errors import error_body
from kvforge.server.readiness import Readiness
from kvforge.server.request_id import REQUEST_ID_HEADER, valid_request_id

logger = logging.getLogger("kvforge.server")

#: listen backlog of the sockets (uvicorn's default)
BACKLOG = 2048
#: seconds uvicorn waits for connections to close once the drain is over (or after an engine died)
CLOSE_GRACE_S = 5
STARTING_MESSAGE = "the server is starting: the engines are loading (GET /ready answers 200 once it can serve)"
#: request bodies read (and dropped) before a "starting" answer; closing on unread data would reset it
_DISCARD_MAX = 1 << 20


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host:port``, one per address it resolves to (as asyncio's
    ``create_server`` would bind them). ``ValueError`` naming the flags when the address is unusable."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r}: cannot resolve it ({exc})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: an IPv6 socket does not take the IPv4 addresses
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    return sockets


def urls(sockets: list[socket.socket]) -> list[str]:
    out = []
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        out.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return out


class _StartingHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 5.0  # seconds a client gets to send its request

    def _starting(self) -> None:
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) <= _DISCARD_MAX:
            self.rfile.read(int(length))
        given = (self.headers.get(REQUEST_ID_HEADER.decode()) or "").encode("latin-1", "replace")
        body = json.dumps(error_body(503, STARTING_MESSAGE, type="service_unavailable")).encode()
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("connection", "close")
        self.send_header(REQUEST_ID_HEADER.decode(), given.decode() if valid_request_id(given) else uuid.uuid4().hex)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _starting

    def log_message(self, format: str, *args: Any) -> None:  # the requests of a starting server: not logged
        pass


class StartingResponder:
    """503 "starting" on the listening sockets, from threads, until :meth:`stop` (idempotent)."""

    def __init__(self, sockets: list[socket.socket]):
        self._servers = []
        for sock in sockets:
            server = socketserver.ThreadingTCPServer(sock.getsockname(), _StartingHandler, bind_and_activate=False)
            server.socket.close()  # NOTE: serve on ours, which stays open (and bound) for uvicorn
            server.socket, server.daemon_threads, server.block_on_close = sock, True, False
            self._servers.append(server)
        self._threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                          name="kvforge-starting") for s in self._servers]
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        for server, thread in zip(self._servers, self._threads):
            if thread.is_alive():
                server.shutdown()  # stops accepting; the socket itself stays open


class Server(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM / Ctrl-C (module docstring) and logging where it serves."""

    def __init__(self, config: uvicorn.Config, readiness: Readiness, shutdown_timeout: float, served: list[str]):
        super().__init__(config)
        self.readiness, self.shutdown_timeout, self.served = readiness, shutdown_timeout, served
        self._signalled = 0  # SIGTERM / SIGINT received
        self._drain_asked = False  # an engine died: drain as for SIGTERM
        self._drain: Any = None

    def drain_and_exit(self) -> None:
        """Drain (new requests 503, those in flight get ``--shutdown-timeout``), then stop; for an engine
        that died, so that the other models' requests finish instead of being cut by the close grace.
        Thread-safe: it only sets a flag that :meth:`on_tick` acts on."""
        self._drain_asked = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        # NOTE: a signal handler: it only counts; on_tick (on the event loop, every 0.1 s) acts on it
        self._signalled += 1
        if self._signalled > 2:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if (self._signalled or self._drain_asked) and self._drain is None:
            self._drain = asyncio.ensure_future(self.readiness.drain(self.shutdown_timeout))
        if self._signalled > 1:
            self.readiness.hurry()
        if self._drain is not None and self._drain.done():
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrorLog(loop.get_exception_handler()))
        await super().startup(sockets)
        if self.started:
            for url in urls([s for server in self.servers for s in server.sockets]):
                logger.info("kvforge ready: serving %s on %s", ", ".join(self.served), url)
