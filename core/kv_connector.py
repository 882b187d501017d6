"""The KV connector contract: a tier beyond the GPU for prefix-cached KV blocks (plugin kind
``kv_connector``, ``register_kv_connectors``; docs/kv_cache.md, "Tiers beyond the GPU").

A connector has two halves, because the engine decides and the ranks copy:

- the **index** (:meth:`KVConnector.index`, in the engine, on its scheduler thread; never I/O): which
  prefix-block hashes the tier holds and in which slot, and the step's copies
  (``kvforge.kv_tier.TierIndex``: its ``contains``, ``save``, ``load``, ``take_transfers``). The paged
  manager calls it (``KVCacheManager.attach_tier``): it saves a cached block it reuses, continues its
  prefix lookups there and loads the hits into fresh device blocks.
- the **store** (:meth:`KVConnector.store`, on every rank, its own heads' share): per-layer host tensors in
  the layer cache's layout that each step's ``(device block, slot)`` saves and ``(slot, device block)``
  loads copy into and out of, with the swap pool's copies in one ``kvforge.rank.swap.transfer`` at the
  start of the step (every source read before any block is written; no host sync: pinned memory and
  copies ordered on the stream). A store is anything with ``ready() -> list[Tensor]`` (allocated on first
  use), as ``kvforge.rank.swap.CPUSwapSpace``.

The engine builds the connector in its own process (for the index) and on every rank (for the store),
with the same arguments: ``gib`` (``EngineConfig.kv_offload_cpu_gib``) and its ``[plugins.<name>]`` options.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from kvforge.kv_tier import TierIndex

if TYPE_CHECKING:
    from kvforge.attention import AttentionBackend


class KVConnector(ABC):
    """A tier for prefix-cached KV blocks, keyed by the paged manager's chained block hash."""

    name: ClassVar[str] = ""
    #: where the blocks live, as KV events name it ("CPU", "DISK")
    medium: ClassVar[str] = "CPU"

    def __init__(self, *, gib: float = 0.0, **options: Any):
        if gib < 0:
            raise ValueError(f"kv connector {self.name!r}: gib must be >= 0, got {gib}")
        self.gib = gib

    @abstractmethod
    def slots(self, bytes_per_block: int) -> int:
        """How many blocks a rank holding ``bytes_per_block`` per block (every layer) keeps (0: none)."""

    @abstractmethod
    def store(self, attn: AttentionBackend, num_layers: int, slots: int) -> Any:
        """The rank's storage of ``slots`` blocks (``ready() -> list[Tensor]``, one per layer)."""

    def index(self, slots: int) -> TierIndex:
        """The engine's index over ``slots`` slots (the smallest rank's)."""
        return TierIndex(slots, medium=self.medium)
