"""Which items' embeddings each rank's encoder cache holds, decided by the engine (docs/multimodal.md).

The ranks keep each encoded item's embedding rows under its content hash; :class:`EncoderCachePlan`, on
the engine's side, mirrors what they hold and, for every step, says which items they must encode first
(new to the cache), which entries they drop (least recently used, past the capacity), and where each
embedding's rows go among the step's tokens. An item is encoded whole in the step whose prompt chunk
first reaches its placeholders, and later chunks (chunked prefill), recomputation after a preemption and
other requests with the same image take it from the cache while it is kept: the placeholder positions
are prompt tokens, so the step's token budget bounds the encoder work too.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

#: embedding rows the ranks' caches hold by default (each row: hidden_size values of the model dtype)
DEFAULT_CAPACITY_ROWS = 16384


@dataclass
class EncoderWork:
    """One step's encoder work: ``encode`` (features, new to the cache), ``free`` (content hashes the
    ranks drop first) and ``places`` ([k, 4] int64: step row, content hash, first row of the item's
    embedding, rows)."""

    encode: list = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    places: np.ndarray | None = None


def reaches_placeholders(reqs: Sequence, num_new: Mapping[str, int]) -> bool:
    """Whether a step whose request r computes ``num_new[r.request_id]`` tokens from its
    ``num_computed_tokens`` reaches any image placeholder (such a step merges embeddings, so it never
    replays a CUDA graph: a graph embeds its input ids itself)."""
    for r in reqs:
        if r.mm_features:
            start = r.num_computed_tokens
            end = start + num_new[r.request_id]
            if any(f.offset < end and f.end > start for f in r.mm_features):
                return True
    return False


class EncoderCachePlan:
    def __init__(self, capacity_rows: int = DEFAULT_CAPACITY_ROWS):
        self.capacity_rows = capacity_rows
        self.held: OrderedDict[int, int] = OrderedDict()  # content hash -> rows, least recently used first
        self.rows = 0

    def step(self, reqs: Sequence, starts: Sequence[int] | np.ndarray, q_lens: Sequence[int] | np.ndarray
             ) -> EncoderWork | None:
        """The encoder work of a step whose request i computes ``q_lens[i]`` tokens from ``starts[i]``;
        None when no scheduled token is a placeholder."""
        work = EncoderWork()
        places: list[tuple[int, int, int, int]] = []
        used: set[int] = set()
        row = 0
        for req, s, q in zip(reqs, starts, q_lens):
            s, q = int(s), int(q)
            for f in req.mm_features:
                a, b = max(s, f.offset), min(s + q, f.end)
                if a >= b:
                    continue
                h = f.content_hash
                if h not in self.held and h not in used:
                    work.encode.append(f)
                    self.rows += f.length
                self.held[h] = f.length
                self.held.move_to_end(h)
                used.add(h)
                places.append((row + a - s, h, a - f.offset, b - a))
            row += q
        if not places:
            return None
        for h in list(self.held):  # least recently used first; never what this step reads
            if self.rows <= self.capacity_rows:
                break
            if h not in used:
                self.rows -= self.held.pop(h)
                work.free.append(h)
        work.places = np.array(places, dtype=np.int64)
        return work
