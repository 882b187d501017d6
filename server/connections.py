"""Connections that cost the server nothing until they have said who they are.

uvicorn closes a kept-alive connection that stays silent after a response (``--timeout-keep-alive``),
but nothing bounds a connection that never sends a whole request head: 1,100 silent connections held
every descriptor of a server under ``ulimit -n 1024`` (issue 34). :class:`GuardedH11Protocol`
(uvicorn's h11 protocol, subclassed) adds two bounds, kept by one :class:`ConnectionGuard` per server:

- **A head deadline** (``--header-timeout``): a connection gets that long to send a whole request head,
  its first or the next one on a kept-alive connection; then it is closed. A slow-header client
  (Slowloris) is closed as a silent one is.
- **A cap on unauthenticated connections** (``--max-unauthenticated-connections``): connections waiting
  for a request head have not yet shown the API key. Past the cap the oldest of them is closed: an
  attacker's connections are the old ones, while a real client sends its head as soon as it connects.

Once the head is in, the API key is checked before any body is read (``ApiKeyAuth`` sits outside
``BodyLimits``). The rest of a body answered early (a 401, a 413 by its declared length) is read and
dropped, never buffered, for at most ``LINGER_S``, then the connection closes: closing at once, with
the body unread, would make the kernel reset the connection and the client could lose the answer.
``BodyLimits`` bounds the time a body may take (``--body-timeout``).

:class:`AcceptErrorLog` rate-limits asyncio's "socket.accept() out of system resource" report, which
Python 3.11 logs once per queued connection on every retry (~12,000 tracebacks a second under
descriptor exhaustion), to one line a second with a count.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kvforge.server")

#: default of --header-timeout: seconds a connection gets to send a whole request head
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: default of --timeout-keep-alive (uvicorn's and vLLM's): seconds an idle kept-alive connection stays open
DEFAULT_KEEP_ALIVE_S = 5.0
#: seconds the rest of a body answered early (401, 413) is read and dropped before the connection closes
LINGER_S = 5.0
#: the cap's default is this share of the process's descriptor limit, at most ``MAX_DEFAULT_UNAUTHENTICATED``
_UNAUTHENTICATED_SHARE = 4
MAX_DEFAULT_UNAUTHENTICATED = 1024


def default_max_unauthenticated() -> int:
    """A quarter of the descriptor limit (``ulimit -n``), at most 1024: three quarters stay for the
    engines, the authenticated clients and the files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_UNAUTHENTICATED
    return max(8, min(MAX_DEFAULT_UNAUTHENTICATED, soft // _UNAUTHENTICATED_SHARE))


class ConnectionGuard:
    """One server's head deadline and its cap on connections waiting for a request head."""

    def __init__(self, header_timeout_s: float, max_unauthenticated: int):
        if not header_timeout_s > 0:
            raise ValueError(f"--header-timeout must be > 0 seconds, got {header_timeout_s}")
        if max_unauthenticated < 1:
            raise ValueError(f"--max-unauthenticated-connections must be >= 1, got {max_unauthenticated}")
        self.header_timeout_s, self.max_unauthenticated = header_timeout_s, max_unauthenticated
        # connections waiting for a head, oldest first (an ordered set)
        self.waiting: collections.OrderedDict[GuardedH11Protocol, None] = collections.OrderedDict()
        self.closed_silent = 0  # closed by the head deadline
        self.closed_over_cap = 0  # closed as the oldest past the cap

    def wait_for_head(self, conn: GuardedH11Protocol) -> None:
        self.waiting[conn] = None
        self.waiting.move_to_end(conn)
        while len(self.waiting) > self.max_unauthenticated:
            oldest, _ = self.waiting.popitem(last=False)
            self.closed_over_cap += 1
            oldest.close_unheard()

    def head_arrived(self, conn: GuardedH11Protocol) -> None:
        self.waiting.pop(conn, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a :class:`ConnectionGuard` (module docstring). Subclassed per server
    by :func:`guarded_protocol`, which sets ``guard``."""

    guard: ConnectionGuard

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._waiting = False
        self._wait_for_head()

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing():
            return
        # NOTE: armed only on entering the wait, never again while a head trickles in (Slowloris)
        if self.conn.their_state is h11.IDLE and not self._waiting:
            self._wait_for_head()  # kept alive: the next head has the same deadline
        elif self.conn.their_state is not h11.IDLE and self._waiting:
            self._head_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            # answered before its body was read (a 401, a 413): the rest is read and dropped (h11 keeps
            # none of it) so that the client sees the answer, not a reset, but only for LINGER_S
            self._linger_timer = self.loop.call_later(LINGER_S, self._linger_over)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        self._cancel_linger()
        super().connection_lost(exc)

    def _wait_for_head(self) -> None:
        self._cancel_linger()
        self._waiting = True
        self.guard.wait_for_head(self)
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.guard.header_timeout_s, self._head_overdue)

    def _head_done(self) -> None:
        self._waiting = False
        self.guard.head_arrived(self)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE:
            self.guard.closed_silent += 1
            self.close_unheard()

    def _linger_over(self) -> None:
        self._linger_timer = None
        if self.conn.their_state is h11.SEND_BODY:
            self.close_unheard()

    def _cancel_linger(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None

    def close_unheard(self) -> None:
        """Close a connection that has no request running (none sent, or answered already)."""
        self._head_done()
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn builds each connection of one server with (``Config(http=...)``)."""
    return type("KvforgeH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class AcceptErrorLog:
    """An event loop exception handler: "out of system resource" accept errors at most once a second
    (with how many were folded in), everything else to the handler it replaces."""

    PERIOD_S = 1.0

    def __init__(self, previous: Any = None):
        self.previous = previous
        self._last = -float("inf")
        self.folded = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" not in str(context.get("message", "")):
            if self.previous is not None:
                return self.previous(loop, context)
            return loop.default_exception_handler(context)
        now = time.monotonic()
        if now - self._last < self.PERIOD_S:
            self.folded += 1
            return
        self._last, folded, self.folded = now, self.folded, 0
        logger.error("cannot accept connections: %s (%r); %d more such errors in the last %.0f s folded into "
                     "this line; see --max-unauthenticated-connections and ulimit -n", context.get("message"),
                     context.get("exception"), folded, self.PERIOD_S)
