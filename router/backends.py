"""The router's view of its backends (``kvforge serve`` replicas), kept fresh by polling each of them.

- ``GET /health`` every ``health_interval`` seconds: 200 puts a backend in, anything else (or no answer
  within :data:`HEALTH_TIMEOUT_S`) takes it out until it answers 200 again. A backend taken out forgets what
  it was believed to hold (a replica that comes back may be a new process with an empty cache).
- ``GET /metrics`` with each health check: its running plus waiting requests (``kvforge:num_requests_running``
  and ``kvforge:num_requests_waiting``); those beyond the requests this router had open on it then are
  other clients' (``Backend.others``), which count as load until the next check.
- ``GET /kv_events?since=N`` every ``events_interval`` seconds: the batches of blocks it stored and removed,
  into its :class:`~kvforge.engine.prefix_router.PrefixIndex`, and its block size. A backend without events
  (no ``--enable-kv-events``) is known by the prompts routed to it alone.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvforge.engine.prefix_router import PrefixIndex
from kvforge.kv_events import EventBatch, event_from_json

logger = logging.getLogger("kvforge.router")

#: seconds a backend has to answer a health check
HEALTH_TIMEOUT_S = 2.0
#: the block size assumed for a backend that has not said its own (kvforge's default)
DEFAULT_BLOCK_SIZE = 16
#: KV event batches read per poll
EVENTS_PER_POLL = 1000
_LOAD_SERIES = ("kvforge:num_requests_running{", "kvforge:num_requests_waiting{")


@dataclass
class Backend:
    url: str
    healthy: bool = False
    in_flight: int = 0  # requests this router has open on it
    routed: int = 0  # requests this router sent it since start
    engine_load: float = 0.0  # its running + waiting requests, from its last /metrics
    others: float = 0.0  # of those, the ones beyond this router's in flight then: other clients' requests
    block_size: int = DEFAULT_BLOCK_SIZE
    events_enabled: bool = False  # its /kv_events says it records them
    since: int = 0  # the next KV event batch to read
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def load(self) -> float:
        """Requests in flight: this router's own count (exact, at once) plus other clients' (as of the last
        /metrics: the engine's own count of this router's requests would lag a health check behind)."""
        return self.in_flight + self.others

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "routed": self.routed,
                "engine_load": self.engine_load, "others": self.others, "block_size": self.block_size,
                "events_enabled": self.events_enabled, "held_blocks": len(self.prefixes)}


def engine_load(metrics_text: str) -> float:
    """Running plus waiting requests in a ``/metrics`` exposition (every model's series)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith(_LOAD_SERIES))


class BackendPool:
    """The backends and the tasks that poll them (:meth:`start` in the app's lifespan, :meth:`stop` after)."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient, *, health_interval: float,
                 events_interval: float, api_key: str | None = None):
        self.backends = [Backend(url.rstrip("/")) for url in urls]
        self.client = client
        self.health_interval, self.events_interval = health_interval, events_interval
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._tasks: list[asyncio.Task] = []

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    async def start(self) -> None:
        """Check every backend once (so the first requests find the healthy ones), then keep polling."""
        await asyncio.gather(*(self._check(b) for b in self.backends))
        await asyncio.gather(*(self._read_events(b) for b in self.backends if b.healthy))
        for b in self.backends:
            self._tasks += [asyncio.create_task(self._watch(b)), asyncio.create_task(self._follow(b))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def mark_dead(self, b: Backend, why: object) -> None:
        if b.healthy:
            logger.warning("backend %s is out: %s", b.url, why)
        b.healthy = False
        b.prefixes.clear()
        b.since = 0  # (its event log, read again from its start when it is back)

    # -- polling ----------------------------------------------------------------------------------
    async def _watch(self, b: Backend) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self._check(b)

    async def _follow(self, b: Backend) -> None:
        while True:
            await asyncio.sleep(self.events_interval)
            if b.healthy:
                await self._read_events(b)

    async def _check(self, b: Backend) -> None:
        try:
            r = await self.client.get(f"{b.url}/health", timeout=HEALTH_TIMEOUT_S)
            ok = r.status_code == 200
            why: object = f"/health answered {r.status_code}"
            if ok:
                m = await self.client.get(f"{b.url}/metrics", timeout=HEALTH_TIMEOUT_S)
                if m.status_code == 200:
                    b.engine_load = engine_load(m.text)
                    b.others = max(0.0, b.engine_load - b.in_flight)
        except httpx.HTTPError as exc:
            ok, why = False, repr(exc)
        if not ok:
            self.mark_dead(b, why)
        elif not b.healthy:
            logger.info("backend %s is in", b.url)
            b.healthy = True

    async def _read_events(self, b: Backend) -> None:
        try:
            r = await self.client.get(f"{b.url}/kv_events", params={"since": b.since, "limit": EVENTS_PER_POLL},
                                      headers=self._auth, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return  # the health check decides whether it is gone
        if r.status_code != 200:  # not a kvforge server (or a wrong --api-key): its routed prompts only
            b.events_enabled = False
            return
        page = r.json()
        b.block_size, b.events_enabled = int(page["block_size"]), bool(page["enabled"])
        if page["next"] < b.since:  # it started again: its log counts from 0
            b.prefixes.clear()
            b.since = 0
            return
        if page["first"] > b.since:  # batches dropped before they were read: what is known is stale
            b.prefixes.clear()
        for item in page["batches"]:
            b.prefixes.apply(EventBatch(item["ts"], [event_from_json(e) for e in item["events"]]))
        b.since = page["next"]
