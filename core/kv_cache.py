"""The KV-cache manager contract: which physical blocks hold each request's keys and values.

The manager is bookkeeping only; the cache tensors belong to the model runner. A block holds
``block_size`` consecutive tokens of one sequence; a request's block table maps its logical block
``i`` (tokens ``i*block_size .. (i+1)*block_size-1``) to a physical block id.

Sliding windows: when every layer of the model attends only to its last ``sliding_window`` positions,
a block wholly behind the window of the next token to compute is never read again. A manager given
``sliding_window`` may give such blocks back while the request runs; their table entries become
:data:`NULL_BLOCK` (the workers read them as block 0, and attention skips or masks keys outside a
window), so a long sequence holds about ``sliding_window / block_size + 1`` blocks (docs/kv_cache.md).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

from kvforge.request import Request

if TYPE_CHECKING:
    from kvforge.kv_events import Event, KVEventRecorder
    from kvforge.kv_tier import TierChain, TierTransfers


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int  # allocatable now (never used, or cached with no owner)
    num_used_blocks: int  # held by at least one request
    num_cached_blocks: int  # blocks with a prefix-cache hash (owned or not)
    prefix_cache_queries: int  # tokens looked up in the prefix cache (each admission, re-admissions too)
    prefix_cache_hits: int  # of those, tokens found cached
    num_cow_copies: int = 0
    num_cpu_blocks: int = 0  # CPU swap pool size (0: no swapping, preemption recomputes)
    num_free_cpu_blocks: int = 0
    num_swapped_out_blocks: int = 0  # blocks copied device -> CPU pool, total since start
    num_swapped_in_blocks: int = 0  # blocks copied CPU pool -> device, total since start
    # the tiers beyond the GPU (kvforge.kv_tier): prefix-cache hits they gave (tokens, counted in
    # prefix_cache_hits too), blocks saved to them, their slots and those holding a block; by tier (``cpu``,
    # ``disk``) the hits (tokens) and the blocks held
    tier_hits: int = 0
    tier_stored_blocks: int = 0
    tier_slots: int = 0
    tier_held_blocks: int = 0
    tier_hits_by_tier: dict[str, int] = field(default_factory=dict)
    tier_held_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 .. 1.0)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def hash_block(parent: Hashable | None, tokens: Sequence[int], extra: Hashable | None = None) -> int:
    """Chained block hash: depends on every token before the block through ``parent``.

    NOTE: Python's ``hash`` of ints and int tuples is the same in every process (None is mapped to
    ints for that); a string ``extra`` is salted per process, fine while one process owns the cache.
    """
    return hash((-1 if parent is None else parent, tuple(tokens), 0 if extra is None else extra))


#: a block-table entry given back because it left the sliding window (never read again)
NULL_BLOCK = -1
#: stands, in ``get_computed_blocks``' list, for a prefix block the host tier holds (``attach_tier``):
#: ``allocate_slots`` gives it a device block and loads it there
TIER_BLOCK = -2


class KVCacheManager(ABC):
    """Allocates blocks on demand and frees them at once; shares them by prefix hash and by fork.

    Call order for one request: ``get_computed_blocks`` (first schedule only) ->
    ``allocate_slots`` each step it runs (with drafts, slots for them too: lookahead) -> ``free_tail``
    after a step that rejected drafts -> ``free`` when it finishes, is aborted or preempted.
    A scheduler that preempts by swapping calls ``swap_out`` instead of ``free`` and ``swap_in``
    before the request's next ``allocate_slots``; a manager without a CPU pool (``num_cpu_blocks``
    0, or one that does not implement swapping) answers None and the scheduler recomputes instead.
    """

    name: str = ""
    #: the tiers beyond the GPU for prefix-cached blocks, as one chain (:meth:`attach_tier`); None: none
    tier: TierChain | None = None
    #: the KV events since the last :meth:`take_kv_events` (:meth:`enable_kv_events`); None: not recording
    events: KVEventRecorder | None = None

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, sliding_window: int | None = None, **options: object):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cpu_blocks = num_cpu_blocks
        #: every layer attends to at most this many last positions (None: some layer sees everything);
        #: a manager may free blocks behind it (:data:`NULL_BLOCK`), or keep them, which is correct too
        self.sliding_window = sliding_window

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of ``request``'s tokens, and how many tokens they cover.

        Takes nothing: the blocks are claimed by the next ``allocate_slots`` call. At least one
        token is always left to compute, so the step still produces logits.
        """

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``computed_blocks`` (from ``get_computed_blocks``) are claimed first and count as computed.
        Returns False, changing nothing, when there are not enough free blocks.
        """

    def free_tail(self, request_id: str, num_tokens: int) -> None:  # noqa: B027 - optional
        """Speculative decoding: give back the request's blocks past those that hold its first
        ``num_tokens`` tokens (they held only rejected drafts; nothing there is hashed). Default: keep
        them, which is correct but holds them until the request's next steps fill them."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release every block of the request, on the device and in the CPU pool; cached blocks stay
        reusable until evicted."""

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks by reference; a later write copies (copy-on-write)."""

    @abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """Physical block ids of the request, in logical order (:data:`NULL_BLOCK` for blocks given
        back behind the sliding window)."""

    @abstractmethod
    def take_copies(self) -> list[tuple[int, int]]:
        """Pending (src, dst) block copies from copy-on-write, to run before the next forward."""

    @abstractmethod
    def stats(self) -> KVCacheStats:
        """Current usage and prefix-cache counters."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; only possible (True) while no request holds blocks."""
        return False

    def attach_tier(self, tier: TierChain) -> None:
        """Keep prefix-cached blocks beyond the device in ``tier`` (``kvforge.kv_tier``: the tiers, fastest
        first): a manager that can saves each cached block it reuses there and continues prefix lookups in
        it (its ``get_computed_blocks`` then lists :data:`TIER_BLOCK` for each such block, and its
        ``allocate_slots`` fails, the request waiting, until ``tier.ready`` says they can be loaded).
        Default: not kept."""
        return None

    def enable_kv_events(self) -> bool:
        """Record KV events from now on (``kvforge.kv_events``): a ``BlockStored`` when a block gets a prefix
        hash in a tier, a ``BlockRemoved`` when it loses it, ``AllBlocksCleared`` on ``reset_prefix_cache``,
        the hashes being the manager's own. Returns whether this manager can; default: it cannot (False)."""
        return False

    def take_kv_events(self) -> list[Event]:
        """The events recorded since the last call (the engine loop takes them once a step)."""
        return self.events.take() if self.events is not None else []

    def take_tier_transfers(self) -> TierTransfers | None:
        """The next step's tier copies (``kvforge.kv_tier.TierTransfers``); None without tiers."""
        return self.tier.take_transfers() if self.tier is not None else None

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the CPU pool: give up its device blocks, take CPU blocks.

        Returns the ``(device block, CPU block)`` copies the runner must make, in the request's
        logical block order, or None, changing nothing, when the CPU pool lacks room (or the
        manager cannot swap): then the caller preempts by recompute. The device blocks are free
        for reuse at once; the runner copies them out before any other cache write of the step.
        Default: None.
        """
        return None

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back: new device blocks, in the same logical order.

        Returns the ``(CPU block, device block)`` copies, or None, changing nothing, when there are
        not enough free device blocks. The CPU blocks are released. Default: None.
        """
        return None

    @property
    def num_free_blocks(self) -> int:
        return self.stats().num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.stats().num_free_cpu_blocks
