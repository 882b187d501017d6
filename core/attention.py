"""The attention-backend contract: paged KV cache layout, per-step metadata and the forward pass.

One backend object serves every layer of a model. Per step the runner calls
:meth:`AttentionBackend.build_metadata` once with a :class:`BatchLayout` (host-side arrays describing
the flattened batch) and passes the result to every layer's :meth:`AttentionBackend.forward`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend supports, as data, so that ``auto`` selection can explain refusals."""

    devices: tuple[str, ...]  # e.g. ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...]
    head_sizes: tuple[int, ...] | None = None  # None: any head size
    block_sizes: tuple[int, ...] | None = None  # None: any block size
    supports_cuda_graphs: bool = False
    # the uniform query lengths its graphs can replay: None, any (decode and speculative verification
    # of k drafts, q = 1 + k); (1,), decode only (verification steps then run eagerly)
    cuda_graph_query_lens: tuple[int, ...] | None = None
    # build_metadata may run while the GPU still runs the previous step (async scheduling): it keeps
    # no host buffer that a queued copy of the previous step could still be reading
    supports_async_scheduling: bool = True
    min_compute_capability: tuple[int, int] | None = None


@dataclass
class BatchLayout:
    """The flattened (varlen) batch of one step, built on the host by the model runner.

    Sequences are ordered as scheduled; sequence ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch.
    """

    query_start_loc: np.ndarray  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: np.ndarray  # [num_seqs] int32, context length after this step (cached + new tokens)
    block_tables: np.ndarray  # [num_seqs, max_blocks_per_seq] int32, physical block ids (padded with 0)
    slot_mapping: np.ndarray  # [num_tokens] int64, flat cache slot (block * block_size + offset) per token

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


@dataclass
class AttentionMetadata:
    """Device-side metadata every backend needs; backends subclass it to add their own fields."""

    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    extra: dict[str, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """A paged attention implementation, chosen by name (``attention_backend`` option)."""

    #: registry name, set by the class
    name: ClassVar[str] = ""
    capabilities: ClassVar[AttentionCapabilities]

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device, **options: Any):
        reasons = self.validate(device=device, dtype=dtype, head_size=head_size, block_size=block_size)
        if reasons:
            raise ValueError(f"attention backend {self.name!r} cannot run this model: {'; '.join(reasons)}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Reasons this backend cannot be used in this process (missing library...); empty if usable."""
        return []

    @classmethod
    def validate(cls, *, device: torch.device | str, dtype: torch.dtype, head_size: int,
                 block_size: int) -> list[str]:
        """Every reason this backend refuses the given setup; an empty list means it accepts."""
        caps = cls.capabilities
        device = torch.device(device)
        reasons = list(cls.unavailable_reasons())
        if device.type not in caps.devices:
            reasons.append(f"device {device.type} not in {caps.devices}")
        if dtype not in caps.dtypes:
            reasons.append(f"dtype {dtype} not in {[str(d) for d in caps.dtypes]}")
        if caps.head_sizes is not None and head_size not in caps.head_sizes:
            reasons.append(f"head size {head_size} not in {caps.head_sizes}")
        if caps.block_sizes is not None and block_size not in caps.block_sizes:
            reasons.append(f"block size {block_size} not in {caps.block_sizes}")
        if caps.min_compute_capability is not None and device.type == "cuda" and torch.cuda.is_available():
            cc = torch.cuda.get_device_capability(device)
            if cc < caps.min_compute_capability:
                reasons.append(f"compute capability {cc} below {caps.min_compute_capability}")
        return reasons

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor. Default: ``[2, num_blocks, block_size, kv_heads, head_size]``
        (K then V, NHD within a block)."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def allocate_kv_cache(self, num_blocks: int, num_layers: int) -> list[torch.Tensor]:
        """One cache tensor per layer, zero-filled, on the backend's device and dtype."""
        return [torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.dtype, device=self.device)
                for _ in range(num_layers)]

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """Copy the step's layout to the device once; subclasses add their own planning."""
        dev = self.device
        non_blocking = dev.type == "cuda"

        def to_dev(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            if non_blocking:
                t = t.pin_memory()
            return t.to(dev, non_blocking=non_blocking)

        query_lens = layout.query_lens
        return AttentionMetadata(
            num_tokens=layout.num_tokens,
            num_seqs=layout.num_seqs,
            max_query_len=int(query_lens.max()) if len(query_lens) else 0,
            max_seq_len=int(layout.seq_lens.max()) if len(layout.seq_lens) else 0,
            query_start_loc=to_dev(layout.query_start_loc),
            seq_lens=to_dev(layout.seq_lens),
            block_tables=to_dev(layout.block_tables),
            slot_mapping=to_dev(layout.slot_mapping),
        )

    def build_graph_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """Metadata for capturing a decode-only CUDA graph of ``layout.num_seqs`` rows (backends with
        ``supports_cuda_graphs``): its tensors are the graph's static inputs, refreshed in place by
        :meth:`update_graph_metadata` before each replay. Padding rows have slot -1 (write nothing)."""
        return self.build_metadata(layout)

    def update_graph_metadata(self, meta: AttentionMetadata, layout: BatchLayout) -> None:
        """Copy a same-shaped decode layout into ``meta``'s tensors in place (no new allocations)."""
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            getattr(meta, name).copy_(torch.from_numpy(getattr(layout, name)), non_blocking=True)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Write the new K/V into ``kv_cache`` at ``meta.slot_mapping`` and return attention output.

        q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size].
        Each query token attends causally to its sequence's cached prefix and the new tokens before it.
        Returns [num_tokens, num_heads, head_size] in q's dtype.

        NOTE: all of the step's new K/V must be in the cache before any token reads it: a sequence
        admitted in the same step may reuse (through the prefix cache) a block another sequence of
        the batch is filling in this very step.
        """

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]
