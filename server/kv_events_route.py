"""``GET /kv_events?since=SEQ&limit=N&model=NAME``: an engine's KV event batches as JSON, for routers that do
not speak ZMQ (``kvforge.kv_events``; docs/server.md, "Endpoints").

The answer: ``{"enabled", "block_size", "first", "next", "batches": [{"seq", "ts", "data_parallel_rank",
"events": [{"type": "BlockStored", ...}, ...]}, ...]}``. Ask again with ``since=next`` to go on; ``first`` above
the ``since`` asked for means older batches were dropped, ``next`` below it that the server started again.
With events off (no ``--enable-kv-events``) it still answers, ``enabled`` false and no batches, so that a router
learns the block size. It carries prompts' token ids: under ``--api-key`` it needs the key (``server/auth.py``).
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from kvforge.kv_events import event_to_json
from kvforge.server.errors import APIError
from kvforge.server.models import ServedModels

#: the most batches one answer holds
MAX_LIMIT = 10_000


def _count(name: str, text: str, low: int, high: int | None = None) -> int:
    """A query parameter that must be an integer in ``[low, high]``; a 400 naming it otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise APIError(400, f"{name}: must be an integer, got {text!r}", name) from None
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise APIError(400, f"{name}: must be {limit}, got {value}", name)
    return value


def add_kv_event_routes(app: FastAPI, models: ServedModels) -> None:
    @app.get("/kv_events")
    async def kv_events(since: str = "0", limit: str = "1000", model: str | None = None) -> dict[str, Any]:
        first_seq, count = _count("since", since, 0), _count("limit", limit, 1, MAX_LIMIT)
        engine = models.resolve(model).serving.engine
        page = await asyncio.to_thread(engine.kv_events_since, first_seq, count)  # (a lock, held briefly)
        answer: dict[str, Any] = {"enabled": page is not None, "block_size": engine.config.block_size,
                                  "first": 0, "next": 0, "batches": []}
        if page is not None:
            answer.update(first=page.first, next=page.next, batches=[
                {"seq": seq, "ts": b.ts, "data_parallel_rank": b.data_parallel_rank,
                 "events": [event_to_json(e) for e in b.events]} for seq, b in page.batches])
        return answer
