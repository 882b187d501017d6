"""The engine's index of the tiers beyond the GPU for prefix-cached KV blocks (docs/kv_cache.md, "Tiers beyond
the GPU").

When the paged manager reuses a free block that still holds a cached prefix, the block's keys and values
would be lost; with a tier they are copied there first (a *save*), keyed by the block's chained prefix hash.
A later request whose prefix misses the GPU cache continues its lookup in the tiers and gets each held block
copied into a fresh device block (a *load*) instead of computing it. Tiers form a chain, fastest first
(``cpu``, then ``disk``): a block the first drops to make room goes to the next (a *move*), and a tier whose
blocks outlive the engine (files) hears of each block it forgets (a *drop*: the ranks delete it).

One :class:`TierIndex` per tier keeps its LRU of held blocks; the :class:`TierChain` over them is what the
manager talks to, and it records the step's copies (:class:`TierTransfers`). This index decides; the ranks
copy (``kvforge.rank.swap.transfer``, at the start of the step, every source read before any block is
written, so a slot or a device block that is both read and written in one step is right).

NOTE: a block put into a tier in this step is neither loaded nor dropped again before the step is taken
(:meth:`TierChain.take_transfers`): its copy is only made at the start of the step, after every read, so a
load of it would read the slot's old contents, and dropping it would lose the copy on its way down.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, ClassVar, Container, Sequence

if TYPE_CHECKING:
    from kvforge.kv_events import KVEventRecorder

Tokens = tuple[int, ...]


@dataclass
class TierTransfers:
    """One step's copies between the device and the tiers (``level``: a tier's place in the chain; ``key``:
    its slot, or for a tier that names its blocks, their hash)."""

    saves: list[tuple[int, int, int]] = field(default_factory=list)  # (level, device block, key)
    loads: list[tuple[int, int, int]] = field(default_factory=list)  # (level, key, device block)
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (level, key, key at level + 1)
    drops: list[tuple[int, int]] = field(default_factory=list)  # (level, key): a persistent tier forgot it
    #: (level, key, tokens) of each block a persistent tier gets this step (kept with it, for a restart)
    tokens: list[tuple[int, int, Tokens]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.moves or self.drops)


@dataclass
class TierCounts:
    """The chain's figures for ``KVCacheStats``: blocks saved since start, slots, blocks held now, and by
    tier (its medium in lower case: ``cpu``, ``disk``) the blocks loaded since start and those held now."""

    stored: int = 0
    slots: int = 0
    held: int = 0
    loaded_by_tier: dict[str, int] = field(default_factory=dict)
    held_by_tier: dict[str, int] = field(default_factory=dict)


class TierIndex:
    """Which block hashes one tier's ``num_slots`` slots hold, least recently used first. One per engine and
    tier (every rank holds the same blocks of its own heads); keys are slots ``0 .. num_slots - 1``."""

    #: a tier whose blocks outlive the engine (files): the ranks hear of each block it forgets (to delete
    #: it) and get each block's tokens with it (so that a restarted engine checks its hits)
    persistent: ClassVar[bool] = False

    def __init__(self, num_slots: int, medium: str = "CPU"):
        self.num_slots = num_slots
        self.medium = medium  # where the blocks live ("CPU", "DISK"), as KV events name it
        self.held: OrderedDict[int, tuple[int, Tokens]] = OrderedDict()  # hash -> (key, tokens)
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end
        self.stored = self.loaded = self.dropped = 0  # blocks, since start
        self.forgotten: list[tuple[int, int]] = []  # (hash, key) it dropped by itself (a bad file)

    def contains(self, block_hash: int, tokens: Sequence[int]) -> bool:
        """Whether a slot holds this prefix block (its tokens too: the hash collision guard)."""
        entry = self.held.get(block_hash)
        return entry is not None and entry[1] == tuple(tokens)

    def ready(self, block_hash: int) -> bool:
        """Whether a load of this held block can run in the next step. Host memory: always; a tier that
        reads ahead answers False until its read is done (the caller asks again in a later step)."""
        return True

    def put(self, block_hash: int, tokens: Sequence[int],
            keep: Container[int]) -> tuple[int, tuple[int, int, Tokens] | None] | None:
        """A slot for a new block: its key, and the ``(hash, key, tokens)`` dropped to make room (the least
        recently used block not in ``keep``) or None; None when full of blocks in ``keep``."""
        victim = None
        key = self._claim(block_hash)
        if key is None:
            old = next((h for h in self.held if h not in keep), None)
            if old is None:
                return None
            old_key, old_tokens = self.held.pop(old)
            self._release(old, old_key)
            self.dropped += 1
            victim = (old, old_key, old_tokens)
            key = self._claim(block_hash)
            assert key is not None
        self.held[block_hash] = (key, tuple(tokens))
        self.stored += 1
        return key, victim

    def touch(self, block_hash: int) -> None:
        """The block was asked for again: the last to drop."""
        self.held.move_to_end(block_hash)

    def take(self, block_hash: int) -> int:
        """The key of a held block loaded in the next step (the last to drop)."""
        key, _ = self.held[block_hash]
        self.held.move_to_end(block_hash)
        self.loaded += 1
        return key

    def clear(self) -> list[int]:
        """Forget every held block (``reset_prefix_cache``); their keys."""
        keys = [key for key, _ in self.held.values()]
        for block_hash, (key, _) in list(self.held.items()):
            self._release(block_hash, key)
        self.held.clear()
        return keys

    def close(self) -> None:
        """The engine stops (a tier with a thread or a lock lets go of it)."""

    def _claim(self, block_hash: int) -> int | None:
        """A free key for a new block, or None when the tier is full."""
        return self.free.pop() if self.free else None

    def _release(self, block_hash: int, key: int) -> None:
        self.free.append(key)


class _Either:
    """Membership in either of two sets, without building their union."""

    def __init__(self, a: AbstractSet[int], b: AbstractSet[int]):
        self.a, self.b = a, b

    def __contains__(self, x: object) -> bool:
        return x in self.a or x in self.b


class TierChain:
    """The tiers in order, fastest first, as one index for the paged manager (``KVCacheManager.attach_tier``),
    and the copies the next step runs."""

    def __init__(self, levels: Sequence[TierIndex]):
        self.levels = list(levels)
        self.pinned: set[int] = set()  # hashes about to be loaded: never dropped meanwhile (the manager sets it)
        self.written: list[set[int]] = [set() for _ in self.levels]  # per tier, hashes put this step (the NOTE)
        self.loading: set[int] = set()  # hashes loaded into a device block this step (filled at its start)
        self.ops = TierTransfers()
        self.events: KVEventRecorder | None = None  # the manager's (its enable_kv_events); None: not recording

    def contains(self, block_hash: int, tokens: Sequence[int]) -> bool:
        """Whether a tier holds this prefix block and it can be loaded."""
        return (not any(block_hash in w for w in self.written)
                and any(t.contains(block_hash, tokens) for t in self.levels))

    def save(self, block_hash: int, tokens: Sequence[int], device_block: int) -> None:
        """A device block holding this prefix is about to be reused: keep a copy in the fastest tier that
        keeps it (one holding it already refreshes it, and it is not copied again)."""
        for level in range(len(self.levels)):
            if self._keep(level, block_hash, tokens, device_block):
                return

    def persist(self, block_hash: int, tokens: Sequence[int], device_block: int) -> None:
        """The prefix cache hit this device block: the first persistent tier (a disk's) keeps a copy too, once,
        so that a block the device never evicts (a shared system prompt) outlives the engine."""
        level = next((i for i, t in enumerate(self.levels) if t.persistent), None)
        if level is None or block_hash in self.loading:  # (a block loaded in this step is not filled yet)
            return
        self._keep(level, block_hash, tokens, device_block)

    def _keep(self, level: int, block_hash: int, tokens: Sequence[int], device_block: int) -> bool:
        """Whether tier ``level`` holds the block now: it held it already (refreshed), or it took a copy (a
        save of ``device_block`` in this step's copies)."""
        tier = self.levels[level]
        if block_hash in tier.held:
            tier.touch(block_hash)
            return True
        key = self._put(level, block_hash, tokens)
        if key is None:
            return False
        self.ops.saves.append((level, device_block, key))
        return True

    def ready(self, hashes: Sequence[int]) -> bool:
        """Whether every block ``hashes`` names can be loaded in the next step; the reads of all that cannot
        start now (False: ask again in a later step; a block no tier holds any more is never ready)."""
        self._collect_forgotten()
        ok = True
        for block_hash in hashes:
            tier = next((t for t in self.levels if block_hash in t.held), None)
            ok = tier is not None and tier.ready(block_hash) and ok
        self._collect_forgotten()
        return ok

    def load(self, block_hash: int, device_block: int) -> None:
        """Copy the held block (from the fastest tier holding it) into ``device_block`` in the next step."""
        for level, tier in enumerate(self.levels):
            if block_hash in tier.held:
                self.ops.loads.append((level, tier.take(block_hash), device_block))
                self.loading.add(block_hash)
                return
        raise KeyError(f"kv tier: no tier holds block {block_hash} (load without contains)")

    def take_transfers(self) -> TierTransfers:
        """The next step's copies, handed over once."""
        self._collect_forgotten()
        ops, self.ops = self.ops, TierTransfers()
        self.written, self.loading = [set() for _ in self.levels], set()
        return ops

    def clear(self) -> None:
        """Forget every held block in every tier (``reset_prefix_cache``); a persistent tier's blocks are
        dropped on the ranks, and none of the step's copies into it is made any more."""
        for level, tier in enumerate(self.levels):
            keys = tier.clear()
            if tier.persistent:
                self.ops.saves = [s for s in self.ops.saves if s[0] != level]
                self.ops.moves = [m for m in self.ops.moves if m[0] + 1 != level]
                self.ops.tokens = [t for t in self.ops.tokens if t[0] != level]
                self.ops.drops += [(level, key) for key in keys]
        self.written = [set() for _ in self.levels]

    def counts(self) -> TierCounts:
        counts = TierCounts(stored=sum(t.stored for t in self.levels), slots=sum(t.num_slots for t in self.levels),
                            held=sum(len(t.held) for t in self.levels))
        for tier in self.levels:
            name = tier.medium.lower()
            counts.loaded_by_tier[name] = counts.loaded_by_tier.get(name, 0) + tier.loaded
            counts.held_by_tier[name] = counts.held_by_tier.get(name, 0) + len(tier.held)
        return counts

    def close(self) -> None:
        for tier in self.levels:
            tier.close()

    def _put(self, level: int, block_hash: int, tokens: Sequence[int]) -> int | None:
        """Put the block into tier ``level`` (the step's copy is the caller's to record); its key, or None
        when the tier keeps it nowhere. The block it drops to make room goes down the chain."""
        tier = self.levels[level]
        got = tier.put(block_hash, tokens, _Either(self.pinned, self.written[level]))
        if got is None:
            return None
        key, victim = got
        self.written[level].add(block_hash)
        if self.events is not None:  # the block it made room with leaves first (the parent's hash: not kept)
            if victim is not None:
                self.events.removed(victim[0], tier.medium)
            self.events.stored(block_hash, None, tokens, None, tier.medium)
        if tier.persistent:
            self.ops.tokens.append((level, key, tuple(tokens)))
        if victim is not None:
            self._demote(level, *victim)
        return key

    def _demote(self, level: int, block_hash: int, key: int, tokens: Tokens) -> None:
        """Tier ``level`` dropped the block at ``key``: the next tier keeps it if it can (a move, read before
        the slot takes its new block), and a persistent tier's ranks forget it (after that read)."""
        below = level + 1
        if below < len(self.levels):
            lower = self.levels[below]
            if block_hash in lower.held:
                lower.touch(block_hash)
            else:
                new_key = self._put(below, block_hash, tokens)
                if new_key is not None:
                    self.ops.moves.append((level, key, new_key))
        if self.levels[level].persistent:
            self.ops.drops.append((level, key))

    def _collect_forgotten(self) -> None:
        for level, tier in enumerate(self.levels):
            for block_hash, key in tier.forgotten:
                self.ops.drops.append((level, key))
                if self.events is not None:
                    self.events.removed(block_hash, tier.medium)
            tier.forgotten = []
