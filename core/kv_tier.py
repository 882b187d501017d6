"""The engine's index of a host-memory tier for prefix-cached KV blocks (docs/kv_cache.md, "Tiers beyond
the GPU").

When the paged manager reuses a free block that still holds a cached prefix, the block's keys and values
would be lost; with a tier they are copied to a host slot first (a *save*), keyed by the block's chained
prefix hash. A later request whose prefix misses the GPU cache continues its lookup here and gets each held
block copied into a fresh device block (a *load*) instead of computing it. This index decides; the ranks
copy (``kvforge.rank.swap.transfer``, at the start of the step, every source read before any block is
written, so a slot or a block that is both read and written in one step is right).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class TierIndex:
    """Which block hashes ``num_slots`` host slots hold, least recently used first, and the copies the
    next step runs. One per engine (every rank holds the same slots of its own heads)."""

    def __init__(self, num_slots: int, medium: str = "CPU"):
        self.num_slots = num_slots
        self.medium = medium  # where the blocks live ("CPU", "DISK"), as KV events name it
        self.held: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens)
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end
        self.saves: list[tuple[int, int]] = []  # (device block, slot) of the next step
        self.loads: list[tuple[int, int]] = []  # (slot, device block) of the next step
        self.stored = self.loaded = self.dropped = 0  # blocks, since start
        self.pinned: set[int] = set()  # hashes about to be loaded: never dropped meanwhile

    def contains(self, block_hash: int, tokens: Sequence[int]) -> bool:
        """Whether a slot holds this prefix block (its tokens too: the hash collision guard)."""
        entry = self.held.get(block_hash)
        return entry is not None and entry[1] == tuple(tokens)

    def save(self, block_hash: int, tokens: Sequence[int], device_block: int) -> None:
        """A device block holding this prefix is about to be reused: keep a copy (unless one is held),
        dropping the least recently used slot's block when the tier is full."""
        if block_hash in self.held:
            self.held.move_to_end(block_hash)
            return
        if not self.num_slots:
            return
        if not self.free:
            victim = next((h for h in self.held if h not in self.pinned), None)
            if victim is None:
                return  # every slot is about to be loaded: this block is not kept
            slot, _ = self.held.pop(victim)
            self.free.append(slot)
            self.dropped += 1
        slot = self.free.pop()
        self.held[block_hash] = (slot, tuple(tokens))
        self.saves.append((device_block, slot))
        self.stored += 1

    def load(self, block_hash: int, device_block: int) -> None:
        """Copy the held block into ``device_block`` in the next step."""
        slot, _ = self.held[block_hash]
        self.held.move_to_end(block_hash)
        self.loads.append((slot, device_block))
        self.loaded += 1

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The next step's (saves, loads), handed over once."""
        saves, loads, self.saves, self.loads = self.saves, self.loads, [], []
        return saves, loads

    def clear(self) -> None:
        """Forget every held block (``reset_prefix_cache``)."""
        self.free.extend(slot for slot, _ in self.held.values())
        self.held.clear()
