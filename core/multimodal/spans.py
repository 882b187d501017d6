"""Items whose rows attend to each other both ways (``MultiModalFeature.bidirectional``: Gemma 3's images).

A row of such an item sees every row of its item, the later ones too, besides everything before it. Its
later rows must then be computed in the same step as it or earlier: **a prompt chunk never ends inside
such an item** (:func:`chunk_limit`, which every scheduling policy applies through
``Scheduler.fit_chunk``; the step builder checks it). A chunk may start inside one (a prefix-cache hit
that ends there: the cached rows were computed with the same image, so they are right). The attention
backend gets each token's lookahead (``BatchLayout.lookahead``): its item's last position minus its own.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvforge.multimodal.inputs import MultiModalFeature


def has_bidirectional(features: Sequence[MultiModalFeature]) -> bool:
    return any(f.bidirectional for f in features)


def chunk_limit(features: Sequence[MultiModalFeature], start: int, n: int) -> int:
    """The most of the ``n`` tokens from position ``start`` a chunk may take without ending inside a
    bidirectional item: ``n``, or up to the item's start, or 0 when the chunk starts in (or at) an item it
    cannot finish (it waits for a step with budget for the whole item)."""
    end = start + n
    for f in features:
        if f.bidirectional and f.offset < end < f.end:
            return max(0, f.offset - start) if f.offset > start else 0
    return n


def lookahead(features: Sequence[MultiModalFeature], start: int, count: int) -> np.ndarray:
    """Each of the tokens at ``start .. start + count - 1``: how many positions past its own it sees
    ([count] int64; 0 outside bidirectional items)."""
    out = np.zeros(count, dtype=np.int64)
    for f in features:
        if not f.bidirectional or f.end <= start or f.offset >= start + count:
            continue
        lo, hi = max(start, f.offset), min(start + count, f.end)
        out[lo - start:hi - start] = f.end - 1 - np.arange(lo, hi)
    return out
