"""The attention-backend contract: paged KV cache layout, per-step metadata and the forward pass.

One backend object serves every layer of a model. Per step the runner calls
:meth:`AttentionBackend.build_metadata` once with a :class:`BatchLayout` (host-side arrays describing
the flattened batch) and passes the result to every layer's :meth:`AttentionBackend.forward`. A backend
that plans more per step returns a dataclass subclass of :class:`AttentionMetadata` with typed fields of
its own, built from :meth:`AttentionBackend.layout_fields`, and its ``forward`` narrows ``meta`` back to
it with :func:`metadata_of`.

The cache holds the model dtype, or FP8 e4m3 (``kv_cache_dtype``): then every layer has a K and a V
scale (:class:`KVScales`), a stored value ``x8`` standing for ``x8 * scale`` (docs/quantization.md).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, TypedDict, TypeVar

import numpy as np
import torch

#: KV-cache element types stored quantized, with per-layer scales
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
#: the largest finite float8_e4m3fn: K/V beyond +-448 x scale are stored as +-448 x scale (saturated)
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend supports, as data, so that ``auto`` selection can explain refusals."""

    devices: tuple[str, ...]  # e.g. ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...]
    # cache element types it writes and reads besides the model dtype (FP8, with per-layer scales);
    # empty: the cache holds the model dtype only
    kv_cache_dtypes: tuple[torch.dtype, ...] = ()
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
    # per-layer attention variants it implements (:class:`AttentionLayer`); a model whose layers need
    # one the backend lacks is refused by ``validate(features=...)`` and skipped by ``auto``
    sliding_window: bool = False
    logits_soft_cap: bool = False
    attention_sinks: bool = False
    # a step's spans of tokens that see each other both ways (``BatchLayout.lookahead``: Gemma 3's images)
    bidirectional_spans: bool = False
    # where ``auto`` tries it, highest first (ties by name): the built-ins use 10 (torch) to 40 (triton);
    # a third-party backend that sets more is tried before them, one that keeps 0 after them
    auto_priority: int = 0


#: the per-layer variants a model can need (:class:`AttentionLayer`), by the capability field that grants each
LAYER_FEATURES = ("sliding_window", "logits_soft_cap", "attention_sinks")
#: every attention feature a model can need: the per-layer variants, and a step's two-way spans
#: (``BatchLayout.lookahead``)
ATTENTION_FEATURES = (*LAYER_FEATURES, "bidirectional_spans")


@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """What one layer's attention needs beyond the backend-wide shape, fixed when the model is built
    (:meth:`AttentionBackend.layer`) and passed to every :meth:`AttentionBackend.forward` of that layer.

    - ``sliding_window``: a query at position ``p`` sees keys ``p - window + 1 .. p`` (the last
      ``window`` positions, itself included: Hugging Face's and FlashAttention's ``(window - 1, 0)``);
      None: every earlier key.
    - ``logits_soft_cap``: scores become ``cap * tanh(score / cap)`` before the softmax (Gemma 2).
    - ``sinks``: [num_heads of this rank] float32 logits, one per query head, that join each softmax's
      denominator and add nothing to the output (gpt-oss): ``p_j = exp(s_j) / (exp(sink) + sum exp(s))``.
    """

    index: int  # the model's layer index
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def features(self) -> frozenset[str]:
        """The capability fields this layer needs."""
        return frozenset(f for f, on in (("sliding_window", self.sliding_window is not None),
                                         ("logits_soft_cap", self.logits_soft_cap is not None),
                                         ("attention_sinks", self.sinks is not None)) if on)

    @property
    def plan_key(self) -> tuple[int | None, float | None]:
        """Layers with the same key share a backend's per-step plan (FlashInfer plans per window and cap)."""
        return self.sliding_window, self.logits_soft_cap


#: a layer with plain global attention (the default of :meth:`AttentionBackend.forward`)
PLAIN_LAYER = AttentionLayer(-1)


@dataclass
class KVScales:
    """One layer's FP8 KV-cache scales: a key ``x`` is stored as ``x8 = e4m3(clamp(x / k, -448, 448))``
    and read back as ``x8 * k``; values with ``v``. Fixed once the cache is allocated (kernels and
    captured CUDA graphs read ``tensor``; FlashInfer takes the floats)."""

    k: float
    v: float
    tensor: torch.Tensor  # [2] float32 (k, v) on the backend's device


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
    #: [num_tokens] int64: how many positions past its own each token also sees (a span that attends both
    #: ways, Gemma 3's image rows: the span's last position minus its own); None: every token is causal.
    #: Only a backend with ``capabilities.bidirectional_spans`` gets a step that has one.
    lookahead: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


class LayoutFields(TypedDict):
    """:class:`AttentionMetadata`'s own fields (all but ``extra``), as :meth:`AttentionBackend.layout_fields`
    gives them: a backend's subclass is ``MyMetadata(**self.layout_fields(layout), my_field=...)``."""

    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class AttentionMetadata:
    """Device-side metadata every backend needs; a backend that plans more per step subclasses it (a
    dataclass with typed fields, ``kw_only=True`` for fields without a default)."""

    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    #: a backend's own per-step values by name, for backends written before subclasses were the way
    #: (the built-ins subclass; a reader narrows each value it takes out)
    extra: dict[str, object] = field(default_factory=dict)


MetadataT = TypeVar("MetadataT", bound=AttentionMetadata)


def metadata_of(meta: AttentionMetadata, kind: type[MetadataT]) -> MetadataT:
    """``meta`` as the backend's own metadata class ``kind`` (in its ``forward``); ``TypeError`` for
    metadata that another backend's ``build_metadata`` made."""
    if not isinstance(meta, kind):
        raise TypeError(f"attention metadata of type {type(meta).__name__}, not {kind.__name__}: pass what this "
                        "backend's build_metadata returned")
    return meta


class AttentionBackend(ABC):
    """A paged attention implementation, chosen by name (``attention_backend`` option)."""

    #: registry name, set by the class
    name: ClassVar[str] = ""
    capabilities: ClassVar[AttentionCapabilities]

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: torch.dtype | None = None, **options: object):
        kv_cache_dtype = kv_cache_dtype or dtype
        reasons = self.validate(device=device, dtype=dtype, head_size=head_size, block_size=block_size,
                                kv_cache_dtype=kv_cache_dtype)
        if reasons:
            raise ValueError(f"attention backend {self.name!r} cannot run this model: {'; '.join(reasons)}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_cache_dtype = kv_cache_dtype  # the cache's element type (the model dtype unless FP8)
        #: K/V are stored in FP8 and divided by their layer's scale on the way in (:class:`KVScales`)
        self.fp8_kv = kv_cache_dtype in FP8_KV_DTYPES
        self._layer_scales: dict[int, KVScales] = {}  # model layer index -> its scales (once set or allocated)
        # NOTE: forward gets a layer's cache, not its index (one backend serves every layer), so an FP8
        # cache finds its layer's scales by its data pointer, recorded by allocate_kv_cache
        self._cache_scales: dict[int, KVScales] = {}  # data_ptr of each allocated layer cache -> its layer's
        #: every layer built over this backend (:meth:`layer`), by model layer index
        self.layers: dict[int, AttentionLayer] = {}

    def layer(self, index: int, *, sliding_window: int | None = None, logits_soft_cap: float | None = None,
              sinks: torch.Tensor | None = None) -> AttentionLayer:
        """Declare model layer ``index``'s attention (called by the model while it is built); the
        returned spec goes to each of that layer's ``forward`` calls. ``ValueError`` when this
        backend lacks a variant the layer needs."""
        spec = AttentionLayer(index, sliding_window, logits_soft_cap, sinks)
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"layer {index}: sliding_window must be a positive integer, got {sliding_window!r}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"layer {index}: logits_soft_cap must be > 0, got {logits_soft_cap!r}")
        if sinks is not None and tuple(sinks.shape) != (self.num_heads,):
            raise ValueError(f"layer {index}: sinks must have shape [{self.num_heads}], got {tuple(sinks.shape)}")
        missing = [f for f in sorted(spec.features) if not getattr(self.capabilities, f)]
        if missing:
            raise ValueError(f"attention backend {self.name!r} cannot run layer {index}: no "
                             f"{', '.join(m.replace('_', ' ') for m in missing)} support")
        self.layers[index] = spec
        return spec

    @property
    def plan_keys(self) -> list[tuple[int | None, float | None]]:
        """The distinct :attr:`AttentionLayer.plan_key` of the layers built (one plain key if none)."""
        return list(dict.fromkeys(s.plan_key for s in self.layers.values())) or [(None, None)]

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        """Reasons this backend cannot be used in this process (missing library...); empty if usable."""
        return []

    @classmethod
    def validate(cls, *, device: torch.device | str, dtype: torch.dtype, head_size: int,
                 block_size: int, kv_cache_dtype: torch.dtype | None = None,
                 features: frozenset[str] | tuple[str, ...] = ()) -> list[str]:
        """Every reason this backend refuses the given setup; an empty list means it accepts.
        ``kv_cache_dtype``: the cache's element type, None for the model dtype; ``features``: the
        per-layer variants the model needs (:data:`ATTENTION_FEATURES`)."""
        caps = cls.capabilities
        device = torch.device(device)
        reasons = list(cls.unavailable_reasons())
        if device.type not in caps.devices:
            reasons.append(f"device {device.type} not in {caps.devices}")
        if dtype not in caps.dtypes:
            reasons.append(f"dtype {dtype} not in {[str(d) for d in caps.dtypes]}")
        if kv_cache_dtype not in (None, dtype) and kv_cache_dtype not in caps.kv_cache_dtypes:
            reasons.append(f"kv_cache_dtype {kv_cache_dtype} not supported: its cache holds "
                           + (f"the model dtype or {[str(d) for d in caps.kv_cache_dtypes]}"
                              if caps.kv_cache_dtypes else "the model dtype only"))
        if caps.head_sizes is not None and head_size not in caps.head_sizes:
            reasons.append(f"head size {head_size} not in {caps.head_sizes}")
        if caps.block_sizes is not None and block_size not in caps.block_sizes:
            reasons.append(f"block size {block_size} not in {caps.block_sizes}")
        if caps.min_compute_capability is not None and device.type == "cuda" and torch.cuda.is_available():
            cc = torch.cuda.get_device_capability(device)
            if cc < caps.min_compute_capability:
                reasons.append(f"compute capability {cc} below {caps.min_compute_capability}")
        for feature in sorted(features):
            if feature not in ATTENTION_FEATURES:
                raise ValueError(f"unknown attention feature {feature!r}; known: {', '.join(ATTENTION_FEATURES)}")
            if not getattr(caps, feature):
                reasons.append(f"no {feature.replace('_', ' ')} support (the model's layers need it)")
        return reasons

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor. Default: ``[2, num_blocks, block_size, kv_heads, head_size]``
        (K then V, NHD within a block)."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def allocate_kv_cache(self, num_blocks: int, num_layers: int, first_layer: int = 0) -> list[torch.Tensor]:
        """One cache tensor per layer (model layers ``first_layer ..``), zero-filled, on the backend's
        device, in ``kv_cache_dtype``. An FP8 cache is tied to its layer's :class:`KVScales` (the
        latest allocation's tensors are the ones :meth:`layer_kv_scales` knows)."""
        shape = self.kv_cache_shape(num_blocks)
        # NOTE: FP8 caches are zeroed as bytes (0x00 is +0.0), which every device supports
        caches = [torch.zeros(shape, dtype=torch.uint8, device=self.device).view(self.kv_cache_dtype)
                  if self.fp8_kv else torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                  for _ in range(num_layers)]
        if self.fp8_kv:
            self._cache_scales = {c.data_ptr(): self._scales_of_layer(first_layer + i) for i, c in enumerate(caches)}
        return caches

    # -- FP8 KV-cache scales ----------------------------------------------------------------------
    def _scales_of_layer(self, layer: int) -> KVScales:
        scales = self._layer_scales.get(layer)
        if scales is None:
            scales = self._layer_scales[layer] = KVScales(
                1.0, 1.0, torch.ones(2, dtype=torch.float32, device=self.device))
        return scales

    def set_kv_scales(self, layer: int, *, k_scale: float | torch.Tensor | None = None,
                      v_scale: float | torch.Tensor | None = None) -> None:
        """Set model layer ``layer``'s FP8 K and/or V scale (default 1.0), e.g. from a checkpoint's
        ``model.layers.N.self_attn.k_scale`` / ``v_scale`` in the model's ``load_weights``. Only
        before the cache is allocated: kernels and captured graphs hold the values from then on."""
        if self._cache_scales:
            raise RuntimeError("set_kv_scales: the KV cache is already allocated; scales are set while "
                               "the weights load")
        scales = self._scales_of_layer(layer)
        for i, (name, value) in enumerate((("k_scale", k_scale), ("v_scale", v_scale))):
            if value is None:
                continue
            value = float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"layer {layer} {name} must be a finite number > 0, got {value}")
            setattr(scales, name[0], value)
            scales.tensor[i] = value

    def kv_scales(self, kv_cache: torch.Tensor) -> KVScales | None:
        """:meth:`layer_kv_scales` of an FP8 cache; None for a cache in the model dtype."""
        return self.layer_kv_scales(kv_cache) if self.fp8_kv else None

    def layer_kv_scales(self, kv_cache: torch.Tensor) -> KVScales:
        """The scales of the layer whose FP8 cache (from :meth:`allocate_kv_cache`) is ``kv_cache``."""
        scales = self._cache_scales.get(kv_cache.data_ptr())
        if scales is None:
            raise RuntimeError(f"attention backend {self.name!r}: an FP8 KV cache that allocate_kv_cache "
                               "did not make (its layer's scales are unknown)")
        return scales

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """The step's metadata. Default: :meth:`layout_fields`; a backend that plans more returns its
        :class:`AttentionMetadata` subclass, built from them."""
        return AttentionMetadata(**self.layout_fields(layout))

    def layout_fields(self, layout: BatchLayout) -> LayoutFields:
        """Copy the step's layout to the device once: the fields every backend's metadata has."""
        dev = self.device
        non_blocking = dev.type == "cuda"

        def to_dev(a: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(a)
            if non_blocking:
                t = t.pin_memory()
            return t.to(dev, non_blocking=non_blocking)

        query_lens = layout.query_lens
        return LayoutFields(
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
                meta: AttentionMetadata, layer: AttentionLayer = PLAIN_LAYER) -> torch.Tensor:
        """Write the new K/V into ``kv_cache`` at ``meta.slot_mapping`` and return attention output.
        An FP8 cache (``fp8_kv``) stores and reads them with ``layer_kv_scales(kv_cache)``.

        q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size].
        Each query token attends causally to its sequence's cached prefix and the new tokens before it,
        as ``layer`` (from :meth:`layer`; default plain global attention) says: within its sliding window, soft-capped, with sinks.
        Keys outside a sliding window may sit in blocks the KV manager gave back: their block-table
        entries are 0 and must not change the output (skip them or mask them).
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
            cache = as_bytes(cache)
            cache[:, dst] = cache[:, src]


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as uint8 (same bytes): PyTorch lacks some kernels for float8 (CPU ``index_copy_``,
    ``equal``), and a block copy is a byte copy anyway. Other caches as they are."""
    return cache.view(torch.uint8) if cache.dtype in FP8_KV_DTYPES else cache
