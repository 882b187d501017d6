"""The KV connector contract: a tier beyond the GPU for prefix-cached KV blocks (plugin kind
``kv_connector``, ``register_kv_connectors``; docs/kv_cache.md, "Tiers beyond the GPU").

A connector has two halves, because the engine decides and the ranks copy:

- the **index** (:meth:`KVConnector.index`, in the engine, on its scheduler thread; no I/O on that thread):
  which prefix-block hashes the tier holds and under which key (``kvforge.kv_tier.TierIndex``). The engine
  chains the tiers' indexes, fastest first, into a ``kvforge.kv_tier.TierChain`` that the paged manager
  calls (``KVCacheManager.attach_tier``): it saves a cached block it reuses, continues its prefix lookups
  there and loads the hits into fresh device blocks.
- the **store** (:meth:`KVConnector.store`, on every rank, its own heads' share): a :class:`TierStore`,
  which each step's copies read blocks from and write blocks to, layer by layer, with the swap pool's
  copies in one ``kvforge.rank.swap.transfer`` at the start of the step (every source read before any
  block is written; no host sync: copies ordered on the stream).

The engine builds the connector in its own process (for the index) and on every rank (for the store), with
the same arguments: the ``EngineConfig`` (each connector reads its own options there: ``cpu`` its
``kv_offload_cpu_gib``, ``disk`` its ``kv_offload_dir`` and ``kv_offload_disk_gib``) and its
``[plugins.<name>]`` options.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from kvforge.kv_tier import TierIndex

if TYPE_CHECKING:
    import torch

    from kvforge.attention import AttentionBackend
    from kvforge.config import EngineConfig


class TierStore(ABC):
    """A rank's blocks of one tier, every layer, by key (the index's: a slot, or a block's hash). In a step
    ``transfer`` calls :meth:`begin`, then for each layer the reads of every store before any write, then
    :meth:`end`; every call runs on the rank's step thread, the copies issued on the current stream."""

    def begin(self, reads: Sequence[int], tokens: Mapping[int, Sequence[int]]) -> None:
        """Before the step's copies: the keys it will read, and the tokens of the blocks it will write
        (given to a persistent tier's store only: ``TierIndex.persistent``)."""
        return None

    @abstractmethod
    def read(self, layer: int, keys: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """Blocks ``keys`` of ``layer`` staged on the device: a tensor of ``like``'s dtype and device,
        ``[like.shape[0], len(keys), *like.shape[2:]]`` (``like``: the layer's cache, FP8 as bytes)."""

    @abstractmethod
    def write(self, layer: int, keys: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        """Keep ``src[:, src_ids[i]]`` (on the device, the layer cache's layout) as block ``keys[i]`` of
        ``layer``; ``src`` may be overwritten once the copies are issued on the stream."""

    def end(self, drops: Sequence[int]) -> None:
        """After the step's copies: forget the blocks ``drops`` (a persistent tier's: its files go)."""
        return None

    def close(self) -> None:
        """The rank stops: finish what is under way (a disk tier's writes)."""
        return None


class KVConnector(ABC):
    """A tier for prefix-cached KV blocks, keyed by the paged manager's chained block hash."""

    name: ClassVar[str] = ""
    #: where the blocks live, as KV events name it ("CPU", "DISK")
    medium: ClassVar[str] = "CPU"

    def __init__(self, *, config: EngineConfig, **options: Any):
        self.config = config

    @abstractmethod
    def slots(self, bytes_per_block: int) -> int:
        """How many blocks a rank holding ``bytes_per_block`` per block (every layer) keeps (0: none)."""

    @abstractmethod
    def store(self, attn: AttentionBackend, num_layers: int, slots: int, rank: int) -> TierStore:
        """Rank ``rank``'s storage of ``slots`` blocks of ``num_layers`` layers (``attn``: its cache's
        layout and device)."""

    def index(self, slots: int) -> TierIndex:
        """The engine's index over ``slots`` blocks (the smallest rank's)."""
        return TierIndex(slots, medium=self.medium)
