"""The responses kvforge keeps for ``GET /v1/responses/{id}`` and ``previous_response_id``.

In memory and bounded twice: at most ``capacity`` responses (``MAX_STORED_RESPONSES``) and at most
``max_bytes`` (``MAX_STORED_BYTES``) of them, measured as JSON; the oldest are dropped when a new one comes
(a restart forgets them all). A response created with ``store: false`` is never kept. Everything runs on
the server's event loop, so no lock is needed.

A response's size is the JSON size of its body plus that of the whole conversation it ends, earlier turns
included. Turns of one chain share their earlier items, so a chain is counted more than once: the count
can overstate the memory held, never understate it (a stored response keeps its earlier turns alive
after their own responses were dropped).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

from pydantic import BaseModel

#: responses kept (the most recently created); an older id is a 404, as an unknown one
MAX_STORED_RESPONSES = 1000
#: bytes of responses kept (JSON size). 256 MiB holds the 1,000 most recent responses of conversations
#: averaging 256 KiB (tens of thousands of tokens each), while a client filling the store with what is
#: stored but not rendered (``reasoning`` items) holds 256 MiB, not the ~16 GiB that 1,000 bodies of
#: 16 MiB would (the issue 34 finding)
MAX_STORED_BYTES = 256 * 2**20


def json_bytes(value: Any) -> int:
    """The size of ``value`` as compact UTF-8 JSON: a deterministic estimate of what keeping it costs."""
    if isinstance(value, BaseModel):
        return len(value.__pydantic_serializer__.to_json(value))
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


@dataclass(frozen=True)
class StoredResponse:
    """body: the Response object as it was returned (final status, output, usage).
    items: the whole conversation it ends, as input items: the earlier turns (through
        ``previous_response_id``), its own input, then its output. A continuation renders these first.
    items_bytes: the JSON size of ``items``.
    size: what it counts against the store's ``max_bytes``: ``items_bytes`` plus the body's JSON size.
    input_count: how many of ``items`` came before its output (``GET .../input_items`` lists them).
    """

    body: dict[str, Any]
    items: list[Any]
    items_bytes: int
    size: int
    input_count: int


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.total_bytes = 0  # sum of the kept responses' sizes
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    @staticmethod
    def measure(items: Iterable[Any], previous: StoredResponse | None = None) -> int:
        """The JSON size of a conversation; one that continues ``previous`` starts with its items, whose
        size is taken from its record instead of being measured again."""
        items = list(items)
        done = 0 if previous is None else len(previous.items)
        return (0 if previous is None else previous.items_bytes) + sum(json_bytes(i) for i in items[done:])

    def put(self, body: dict[str, Any], items: list[Any], items_bytes: int | None = None,
            input_count: int | None = None) -> bool:
        """Keep a finished response under ``body["id"]``, then drop the oldest while more than ``capacity``
        responses or ``max_bytes`` are kept. ``items_bytes``: ``measure(items)`` when the caller has it;
        ``input_count``: the items before its output (all of them by default).
        False (nothing kept) when the response alone is larger than ``max_bytes``."""
        items_bytes = self.measure(items) if items_bytes is None else items_bytes
        size = items_bytes + json_bytes(body)
        if size > self.max_bytes:
            return False
        self._drop(body["id"])
        self._by_id[body["id"]] = StoredResponse(body, items, items_bytes, size,
                                                 len(items) if input_count is None else input_count)
        self.total_bytes += size
        while len(self._by_id) > self.capacity or self.total_bytes > self.max_bytes:
            self._drop(next(iter(self._by_id)))
        return True

    def _drop(self, response_id: str) -> None:
        gone = self._by_id.pop(response_id, None)
        if gone is not None:
            self.total_bytes -= gone.size

    def delete(self, response_id: str) -> bool:
        """Forget a response (a continuation that already started keeps its own copy); False if unknown."""
        if response_id not in self._by_id:
            return False
        self._drop(response_id)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._by_id.get(response_id)

    def __len__(self) -> int:
        return len(self._by_id)
