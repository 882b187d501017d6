"""Prefix-aware routing: a prompt goes to the replica that holds most of its prefix, unless that one is busier.

Shared by the data-parallel front end (``kvforge.engine.data_parallel``: replicas as Ray actors) and
``kvforge router`` (``kvforge.router``: separate ``kvforge serve`` processes). Each keeps a
:class:`PrefixIndex` per replica, fed by the replica's KV events (``kvforge.kv_events``: the blocks it
stored and removed, per tier) and by the prompts routed to it (*replayed*: it will hold their blocks once it
has run them, before any event says so). A prompt is hashed in blocks the way the paged manager hashes it
(:func:`prompt_block_hashes`, the engine's own ``hash_block``), and each healthy replica scores

    matched_blocks - load_weight * load

where ``matched_blocks`` is how many of the prompt's leading blocks it holds (in any tier) and ``load`` its
requests in flight (:func:`best`). So requests sharing a prefix stick to its holder until the holder has
``matched_blocks / load_weight`` more requests than another replica; then a hot prefix spills over.
docs/distributed.md, "A prefix-aware router".
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvforge.kv_cache import hash_block
from kvforge.kv_events import GPU, BlockRemoved, BlockStored, EventBatch

#: replayed block hashes kept per replica (the oldest go first): the blocks of its ~500 last long prompts
REPLAYED_MAX = 1 << 16
#: ``load_weight``'s default: a request in flight weighs as much as one matched block
DEFAULT_LOAD_WEIGHT = 1.0


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the paged manager computes them for a request
    without an adapter, a cache salt or images (``hash_block`` with no extra key).

    NOTE: such hashes are the same in every process (Python hashes ints and tuples of ints without a
    seed); a request with a LoRA adapter, a cache salt or images has an extra key per process, which a
    router cannot recompute: those are routed by load alone."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """The prefix blocks one replica holds: per medium from its KV events, and those of the prompts routed
    to it (at most :data:`REPLAYED_MAX`, until an event says it stored them)."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}  # medium -> block hashes
        self.replayed: OrderedDict[int, None] = OrderedDict()

    def apply(self, batch: EventBatch) -> None:
        """A batch of the replica's KV events."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.held.setdefault(event.medium or GPU, set()).update(event.block_hashes)
                for h in event.block_hashes:
                    self.replayed.pop(h, None)
            elif isinstance(event, BlockRemoved):
                self.held.get(event.medium or GPU, set()).difference_update(event.block_hashes)
            else:  # AllBlocksCleared
                self.clear()

    def replay(self, hashes: Sequence[int]) -> None:
        """The replica was sent a prompt of these blocks."""
        for h in hashes:
            self.replayed[h] = None
            self.replayed.move_to_end(h)
        while len(self.replayed) > REPLAYED_MAX:
            self.replayed.popitem(last=False)

    def matched(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``' leading blocks the replica holds, in any tier."""
        held = list(self.held.values())
        n = 0
        for h in hashes:
            if h not in self.replayed and not any(h in s for s in held):
                break
            n += 1
        return n

    def clear(self) -> None:
        """Forget everything (the replica restarted or was lost, or cleared its cache)."""
        self.held, self.replayed = {}, OrderedDict()

    def __len__(self) -> int:
        """Distinct blocks it is believed to hold."""
        return len(set().union(*self.held.values(), self.replayed))


@dataclass(frozen=True)
class Candidate:
    """A healthy replica as :func:`best` weighs it."""

    index: int
    matched: int  # the prompt's leading blocks it holds
    load: float  # its requests in flight
    routed: int = 0  # requests sent to it so far (the last tie-break)


def check_load_weight(value: float, name: str = "load_weight") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def score(c: Candidate, load_weight: float) -> float:
    return c.matched - load_weight * c.load


def best(candidates: Iterable[Candidate], load_weight: float = DEFAULT_LOAD_WEIGHT) -> Candidate | None:
    """The candidate with the highest :func:`score`; ties go to the least loaded, then the least routed,
    then the first. None when there is none."""
    return min(candidates, key=lambda c: (-score(c, load_weight), c.load, c.routed, c.index), default=None)
