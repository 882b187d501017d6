"""The responses kvforge keeps for ``GET /v1/responses/{id}`` and ``previous_response_id``.

In memory and bounded: the ``MAX_STORED_RESPONSES`` most recently created responses stay; the oldest
is dropped when a new one comes (a restart forgets them all). A response created with ``store: false``
is never kept. Everything runs on the server's event loop, so no lock is needed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: responses kept (the most recently created); an older id is a 404, as an unknown one
MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    """body: the Response object as it was returned (final status, output, usage).
    items: the whole conversation it ends, as input items: the earlier turns (through
        ``previous_response_id``), its own input, then its output. A continuation renders these first.
    """

    body: dict[str, Any]
    items: list[Any]


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, body: dict[str, Any], items: list[Any]) -> None:
        """Keep a finished response under ``body["id"]``, dropping the oldest beyond ``capacity``."""
        self._by_id[body["id"]] = StoredResponse(body, items)
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._by_id.get(response_id)

    def __len__(self) -> int:
        return len(self._by_id)
