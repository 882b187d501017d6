"""Multimodal RoPE positions (Qwen2-VL's M-RoPE) without a position table per request.

A model with M-RoPE rotates each token by three positions (temporal, height, width), each on its own
section of the rotary dimensions. A text token's three are equal, so it rotates as ordinary RoPE at that
position. An image of a merged ``h' x w'`` grid at 1-D offset ``o`` gives its k-th row
``(b, b + k // w', b + k % w')`` (the item's ``rope_positions`` plus a base ``b``), and the text after it
continues from ``b + max(h', w')`` (its ``rope_extent``), not from ``o + h'w'``: every item shifts what
follows it by ``rope_extent - length``. So with the items' shifts summed up to a position:

- a text token at 1-D position ``p`` rotates at ``p + shift(p)``, an offset the host adds to the positions
  it already computes (the KV slots keep the 1-D positions). Decode steps, CUDA graphs included, stay 1-D;
- only a step that reaches image rows needs ``[3, T]`` positions; such steps never replay graphs (their
  inputs are embeddings).

transformers computes the same positions with ``get_rope_index`` over the whole prompt.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvforge.multimodal.inputs import MultiModalFeature


def uses_rope_positions(features: Sequence[MultiModalFeature]) -> bool:
    """Whether a request's items carry M-RoPE positions."""
    return any(f.rope_positions is not None for f in features)


def _shifts(features: Sequence[MultiModalFeature]) -> tuple[np.ndarray, np.ndarray]:
    """Each item's end, and the cumulative shift after 0, 1, ... items ([k + 1], starting at 0)."""
    ends = np.fromiter((f.end for f in features), dtype=np.int64, count=len(features))
    shifts = np.fromiter(((f.rope_extent - f.length) if f.rope_positions is not None else 0 for f in features),
                         dtype=np.int64, count=len(features))
    return ends, np.concatenate([[0], np.cumsum(shifts)])


def rope_offsets(features: Sequence[MultiModalFeature], start: int, count: int) -> np.ndarray:
    """What the text tokens at 1-D positions ``start .. start + count - 1`` add to their positions: the
    shifts of the items that end at or before each ([count] int64; rows inside an item are not text and
    get their item's shift so far, which only :func:`rope_positions` makes right)."""
    ends, cum = _shifts(features)
    p = np.arange(start, start + count, dtype=np.int64)
    return cum[np.searchsorted(ends, p, side="right")]


def rope_positions(features: Sequence[MultiModalFeature], start: int, count: int) -> np.ndarray:
    """The ``[3, count]`` M-RoPE positions of 1-D positions ``start .. start + count - 1`` of a prompt
    with these items (by offset)."""
    p = np.arange(start, start + count, dtype=np.int64)
    ends, cum = _shifts(features)
    out = np.repeat((p + cum[np.searchsorted(ends, p, side="right")])[None], 3, axis=0)
    for j, f in enumerate(features):
        if f.rope_positions is None or f.end <= start or f.offset >= start + count:
            continue
        lo, hi = max(start, f.offset), min(start + count, f.end)
        base = f.offset + cum[j]
        out[:, lo - start:hi - start] = base + np.asarray(f.rope_positions)[:, lo - f.offset:hi - f.offset]
    return out
