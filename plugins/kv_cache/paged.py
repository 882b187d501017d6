"""``paged``: block pool with on-demand allocation, prefix caching, reference counts and copy-on-write.

Free blocks wait in one LRU queue (an ordered dict): blocks that hold no cached prefix sit at the
front and are reused first; blocks with a prefix hash join the back when their last owner lets go,
so the least recently used cached block is evicted first. Taking a cached block out of the queue
(a prefix hit) makes it live again.

Swapping keeps a second, plain free list of CPU-pool block ids. ``swap_out`` gives each of the
request's blocks a CPU block and then lets go of the device blocks exactly as ``free`` does, so a
block shared with another owner (ref_count > 1, a fork or a prefix hit) is copied like any other
and stays on the device for the others; cached blocks keep their hashes until evicted. ``swap_in``
takes fresh device blocks, unshared and unhashed; the request's next ``allocate_slots`` hashes its
full blocks again, so they rejoin the prefix cache where no other block holds the same prefix.

With ``sliding_window`` (every layer windowed), ``allocate_slots`` first gives back the request's
blocks wholly behind the window of its next token, as ``free`` would (a cached one keeps its hash
and stays reusable until evicted); the table keeps ``NULL_BLOCK`` in their place. Only blocks
already hashed (or any, without prefix caching) are given back, so the hash chain is never cut.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from kvforge.kv_cache import NULL_BLOCK, TIER_BLOCK, KVCacheManager, KVCacheStats, hash_block
from kvforge.kv_events import GPU, KVEventRecorder
from kvforge.kv_tier import TierChain, TierCounts, TierTransfers
from kvforge.request import Request


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    # NOTE: the collision guard: a hit must match the block's own tokens and its parent block id.
    tokens: tuple[int, ...] | None = None
    parent: int | None = None


class PagedKVCacheManager(KVCacheManager):
    name = "paged"

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, sliding_window: int | None = None):
        super().__init__(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                         num_cpu_blocks=num_cpu_blocks, sliding_window=sliding_window)
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.tables: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}  # request -> how many of its leading blocks are hashed
        self.hashes: dict[str, list[int]] = {}  # request -> chained hashes of its full blocks
        self.copies: list[tuple[int, int]] = []
        self.queries = self.hits = self.cow_copies = 0
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))  # popped from the end
        self.cpu_tables: dict[str, list[int]] = {}  # swapped-out request -> CPU blocks, logical order
        self.swapped_out = self.swapped_in = 0
        self.num_dropped: dict[str, int] = {}  # request -> its leading blocks given back (behind the window)
        self.tier_pending: dict[str, list[tuple[int, tuple[int, ...]]]] = {}  # request -> tier hits to load
        self.tier_hits = 0
        self.hashed_now: set[int] = set()  # blocks hashed since the last step was taken: that step computes them

    def attach_tier(self, tier: TierChain) -> None:
        self.tier = tier
        tier.events = self.events

    def enable_kv_events(self) -> bool:
        self.events = KVEventRecorder(self.block_size)
        if self.tier is not None:
            self.tier.events = self.events
        return True

    # -- prefix cache ----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs  # leave at least one token to compute
        found: list[int] = []
        parent_hash, parent_id = None, None
        extra, images = request.cache_key, bool(request.mm_features)  # (a text request's key is one per request)
        tier, pending = self.tier, []
        for i in range(max_blocks):
            tokens = tuple(request.tokens(i * bs, (i + 1) * bs))
            h = hash_block(parent_hash, tokens, request.block_key(i * bs, (i + 1) * bs) if images else extra)
            block_id = self.cached.get(h) if not pending else None
            if block_id is None:  # past the device's hits, the host tier's (loaded by allocate_slots)
                if tier is None or not tier.contains(h, tokens):
                    break
                pending.append((h, tokens))
                parent_hash = h
                continue
            block = self.blocks[block_id]
            if block.tokens != tokens or block.parent != parent_id:
                break  # hash collision: not the same prefix
            found.append(block_id)
            parent_hash, parent_id = h, block_id
        if tier is not None:
            self.tier_pending[request.request_id] = pending
        return found + [TIER_BLOCK] * len(pending), (len(found) + len(pending)) * bs

    def _cache_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        """Give every newly full block of the request its chained hash."""
        bs = self.block_size
        rid = request.request_id
        hashes = self.hashes.setdefault(rid, [])
        start = self.num_hashed.get(rid, 0)
        extra, images = request.cache_key, bool(request.mm_features)
        for i in range(start, num_tokens // bs):
            tokens = tuple(request.tokens(i * bs, (i + 1) * bs))
            parent_hash = hashes[i - 1] if i else None
            h = hash_block(parent_hash, tokens, request.block_key(i * bs, (i + 1) * bs) if images else extra)
            hashes.append(h)
            if table[i] == NULL_BLOCK:  # given back behind the window (swapped in again): chain only
                continue
            block = self.blocks[table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.tokens = h, tokens
                # a parent given back behind the window: the block its hash still names, if cached
                block.parent = (None if not i else table[i - 1] if table[i - 1] != NULL_BLOCK
                                else self.cached.get(hashes[i - 1]))
                self.cached[h] = block.block_id
                if self.tier is not None:
                    self.hashed_now.add(block.block_id)
                if self.events is not None:
                    self.events.stored(h, parent_hash, tokens, request.lora_int_id or None, GPU)
        self.num_hashed[rid] = max(start, num_tokens // bs)

    def _load_from_tier(self, table: list[int], loads: list[tuple[int, tuple[int, ...]]], lora_id: int) -> None:
        """Append a fresh device block for each ``(hash, tokens)`` the tier holds, cached again under its
        hash and loaded from the tier in the next step."""
        tier = self.tier
        assert tier is not None
        tier.pinned = {h for h, _ in loads}  # the blocks popped here may save others: never pushing these out
        for h, tokens in loads:
            block = self.blocks[self._pop_free()]
            if h not in self.cached:
                block.hash, block.tokens = h, tokens
                block.parent = table[-1] if table else None
                self.cached[h] = block.block_id
                if self.events is not None:
                    parent_hash = self.blocks[block.parent].hash if block.parent is not None else None
                    self.events.stored(h, parent_hash, tokens, lora_id or None, GPU)
            table.append(block.block_id)
            tier.load(h, block.block_id)
        tier.pinned = set()
        self.tier_hits += len(loads) * self.block_size

    def _evict(self, block: _Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.removed(block.hash, GPU)
            block.hash = block.tokens = block.parent = None

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        rid = request.request_id
        bs = self.block_size
        table = self.tables.get(rid)
        first = table is None
        table = [] if first else table
        num_computed = len(computed_blocks) * bs if computed_blocks else request.num_computed_tokens
        total = num_computed + num_new_tokens
        if self.sliding_window is not None and not first:
            self._drop_behind_window(rid, table, num_computed, self.sliding_window)
        loads = self.tier_pending.pop(rid, []) if TIER_BLOCK in computed_blocks else []
        if loads and self.tier is not None and not self.tier.ready([h for h, _ in loads]):
            return False  # a tier still reads them ahead (a disk): the request waits a step
        reviving = sum(1 for b in computed_blocks if b != TIER_BLOCK and self.blocks[b].ref_count == 0)
        need = -(-total // bs) - len(table) - len(computed_blocks)
        cow = self._needs_cow(table, num_computed) and num_new_tokens > 0
        if need + cow + reviving + len(loads) > len(self.free_queue):
            if loads:
                self.tier_pending[rid] = loads  # (the next try finds them again anyway)
            return False
        for b in computed_blocks:
            if b == TIER_BLOCK:
                continue
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free_queue[b]
            block.ref_count += 1
            table.append(b)
            if self.tier is not None and block.hash is not None and block.tokens is not None:
                if b not in self.hashed_now:  # a hit: a disk tier keeps it too (once computed: an earlier step)
                    self.tier.persist(block.hash, block.tokens, b)
        if loads:
            self._load_from_tier(table, loads, request.lora_int_id)
        if cow:
            self._copy_on_write(table, num_computed)
        for _ in range(max(need, 0)):
            table.append(self._pop_free())
        self.tables[rid] = table
        if first and self.enable_prefix_caching:
            self.queries += request.num_tokens
            self.hits += len(computed_blocks) * bs
            if computed_blocks:
                self.num_hashed[rid] = 0
        if self.enable_prefix_caching:
            # only blocks of known tokens: an in-flight step's placeholder (async scheduling) is not one
            known = request.num_tokens - request.num_placeholders
            self._cache_full_blocks(request, table, min(total, known))
        return True

    def _drop_behind_window(self, rid: str, table: list[int], num_computed: int, window: int) -> None:
        """Give back the blocks no token from ``num_computed`` on can see: the next token, at position
        ``num_computed``, sees positions ``num_computed - window + 1`` and later."""
        first_visible = max(0, num_computed - window + 1)
        end = first_visible // self.block_size  # blocks 0 .. end-1 hold only invisible positions
        if self.enable_prefix_caching:
            end = min(end, self.num_hashed.get(rid, 0))  # never cut the chain of hashes still to make
        start = self.num_dropped.get(rid, 0)
        if end <= start:
            return
        self._release([b for b in table[start:end] if b != NULL_BLOCK])
        table[start:end] = [NULL_BLOCK] * (end - start)
        self.num_dropped[rid] = end

    def _needs_cow(self, table: list[int], num_computed: int) -> bool:
        idx = num_computed // self.block_size
        return num_computed % self.block_size != 0 and idx < len(table) and self.blocks[table[idx]].ref_count > 1

    def _copy_on_write(self, table: list[int], num_computed: int) -> None:
        idx = num_computed // self.block_size
        src = table[idx]
        dst = self._pop_free()
        self.blocks[src].ref_count -= 1
        table[idx] = dst
        self.copies.append((src, dst))
        self.cow_copies += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if self.tier is not None and block.hash is not None and block.tokens is not None:
            self.tier.save(block.hash, block.tokens, block_id)  # copied out before the step writes it
        self._evict(block)
        block.ref_count = 1
        return block_id

    def free(self, request_id: str) -> None:
        self.cpu_free.extend(c for c in self.cpu_tables.pop(request_id, ()) if c != NULL_BLOCK)
        table = self.tables.pop(request_id, None)
        self.tier_pending.pop(request_id, None)
        self.num_hashed.pop(request_id, None)
        self.hashes.pop(request_id, None)
        self.num_dropped.pop(request_id, None)
        if table is not None:
            self._release([b for b in table if b != NULL_BLOCK])

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        table = self.tables.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return
        self._release(table[keep:])  # never hashed: only unknown (draft) positions were in them
        del table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds joins the free queue, at its
        eviction end unless it is cached (hashed)."""
        # NOTE: tail blocks first, so a prefix's head outlives its tail in the LRU.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:
                    self.free_queue.move_to_end(block_id, last=False)

    def fork(self, parent_id: str, child_id: str) -> None:
        if parent_id not in self.tables:
            raise ValueError(f"cannot fork unknown request {parent_id!r}")
        if child_id in self.tables:
            raise ValueError(f"request {child_id!r} already holds blocks")
        table = list(self.tables[parent_id])
        for b in table:
            if b != NULL_BLOCK:
                self.blocks[b].ref_count += 1
        self.tables[child_id] = table
        if parent_id in self.num_dropped:
            self.num_dropped[child_id] = self.num_dropped[parent_id]
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))
        self.num_hashed[child_id] = self.num_hashed.get(parent_id, 0)

    # -- swapping to the CPU pool ----------------------------------------------------------------
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        table = self.tables.get(request_id)
        if table is None or request_id in self.cpu_tables:
            raise ValueError(f"cannot swap out request {request_id!r}: it holds no device blocks")
        live = [b for b in table if b != NULL_BLOCK]
        if len(live) > len(self.cpu_free):
            return None
        dropped = self.num_dropped.get(request_id, 0)
        cpu = [NULL_BLOCK if b == NULL_BLOCK else self.cpu_free.pop() for b in table]
        self.free(request_id)
        self.cpu_tables[request_id] = cpu
        if dropped:
            self.num_dropped[request_id] = dropped
        self.swapped_out += len(live)
        return [(d, c) for d, c in zip(table, cpu) if d != NULL_BLOCK]

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        cpu = self.cpu_tables.get(request_id)
        if cpu is None:
            raise ValueError(f"cannot swap in request {request_id!r}: it is not swapped out")
        live = [c for c in cpu if c != NULL_BLOCK]
        if len(live) > len(self.free_queue):
            return None
        table = [NULL_BLOCK if c == NULL_BLOCK else self._pop_free() for c in cpu]
        del self.cpu_tables[request_id]
        self.cpu_free.extend(reversed(live))
        self.tables[request_id] = table
        self.swapped_in += len(live)
        return [(c, d) for c, d in zip(cpu, table) if c != NULL_BLOCK]

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def take_tier_transfers(self) -> TierTransfers | None:
        self.hashed_now.clear()  # (their step is taken: a later step's copies read them computed)
        return super().take_tier_transfers()

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def stats(self) -> KVCacheStats:
        free = len(self.free_queue)
        tier = self.tier.counts() if self.tier is not None else TierCounts()
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=free, num_used_blocks=self.num_blocks - free,
            num_cached_blocks=len(self.cached), prefix_cache_queries=self.queries,
            prefix_cache_hits=self.hits, num_cow_copies=self.cow_copies, num_cpu_blocks=self.num_cpu_blocks,
            num_free_cpu_blocks=len(self.cpu_free), num_swapped_out_blocks=self.swapped_out,
            num_swapped_in_blocks=self.swapped_in, tier_hits=self.tier_hits, tier_stored_blocks=tier.stored,
            tier_slots=tier.slots, tier_held_blocks=tier.held, tier_held_by_tier=tier.held_by_tier,
            tier_hits_by_tier={name: n * self.block_size for name, n in tier.loaded_by_tier.items()})

    def reset_prefix_cache(self) -> bool:
        if any(self.tables.values()):
            return False
        events, self.events = self.events, None  # one AllBlocksCleared, not a BlockRemoved per block
        for block in self.blocks:
            self._evict(block)
        if self.tier is not None:
            self.tier.clear()
        self.events = events
        if events is not None:
            events.cleared()
        return True
