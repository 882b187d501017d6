"""``flash_attn``: paged attention through FlashAttention, one varlen call per layer for the whole
mixed batch (prefill chunks, cached prefixes and decodes alike).

Three implementations, the first importable one wins (or the ``implementation`` option picks one):

- ``fa4``: ``flash_attn.cute.flash_attn_varlen_func`` (``flash-attn-4``, Hopper/Blackwell) with
  ``page_table`` and ``seqused_k``; block sizes 16, 32, 64, 128; head sizes 64, 128.
- ``fa3``: ``flash_attn_interface.flash_attn_with_kvcache`` (FA3's ``hopper/`` build) with
  ``page_table``, ``cache_seqlens`` and ``cu_seqlens_q``; block sizes 16, 32, 64, 128, 256; head sizes 64, 128, 256.
- ``fa2``: ``flash_attn.flash_attn_varlen_func`` (``flash-attn`` 2.x) with ``block_table`` and
  ``cu_seqlens_k``; block sizes that are multiples of 256; head sizes 64, 128, 256.

FA4's paged path takes any page size (TMA when it equals the kernel's tile, cp.async otherwise); 16
and 128 were verified on the H200 (shared/gpu/README.md), 32 and 64 take the same cp.async path as 16
(tests/gpu/test_gpu_backends.py checks all four). FA2's paged kernels refuse block sizes that
are not a multiple of 256 ("Paged KV cache block size must be divisible by 256", flash_api.cpp). FA4's
SM100 head-256 kernel takes no ``seqused_k``, hence 64 and 128 only.

CUDA graphs (decode and speculative verification, any uniform query length): the call reads only
device tensors (``cu_seqlens_q``, ``seqused_k``/``cache_seqlens``, the page table) besides two host
integers; a captured graph takes ``max_seqlen_q`` = its query length and ``max_seqlen_k`` = the
longest context a replay may see (the block table's width), bounds that hold for every replay. New
K/V are written by kvforge's Triton ``reshape_and_cache``, which skips the padding rows' slot -1.
Verified on FA4 (the H200 has no FA2/FA3 build).

No FP8 KV cache (``kv_cache_dtypes`` is empty, so ``auto`` passes over this backend for
``kv_cache_dtype="fp8"`` and naming it is refused): none of the three reads e4m3 K/V under a bf16/fp16
query. FA4 (flash-attn-4 4.0.0b36, ``flash_attn/cute/interface.py`` ``_flash_attn_fwd``) asserts that
q, k and v share one dtype ("q, k, v, and qv must have the same dtype") and runs FP8 on SM100 only
("FP8 is only supported on SM100 (compute capability 10.x) for FA4 CuTe", so not on the H100/H200);
FA3's ``q_descale/k_descale/v_descale`` come with an FP8 query as well; FA2 has no FP8 path.
Quantizing the query to FP8 to use them is another numerical contract (vLLM's FA3 path does it), not
a read of this cache.

All three align ``causal=True`` bottom-right when a sequence has more keys than queries (FA2 onward:
query ``i`` of ``q_len`` over ``k_len`` keys sees keys ``<= k_len - q_len + i``), which is exactly a
chunk after a cached prefix, and a decode token seeing its whole context.

Per-layer variants (:class:`~kvforge.attention.AttentionLayer`): a sliding window goes in as
``window_size=(window - 1, 0)`` and a soft cap as ``softcap`` (all three: FA2 >= 2.6 takes both in its
varlen call, FA3 in ``flash_attn_with_kvcache``, FA4 in its varlen call; a window skips the key tiles
wholly before it, so the block-table entries given back there are never read). Sinks only with FA4:
``learnable_sink`` ([num_heads] logits in natural-log units, not times ``softmax_scale``: flash-attn-4
4.0.0b36, ``flash_attn/cute/softmax.py`` ``apply_learnable_sink``, folded in once after the key loop);
FA2 and FA3 take none, so ``validate`` refuses a model with sinks unless FA4 is what runs, and
:meth:`FlashAttnBackend.layer` refuses a sinks layer on FA2/FA3. A plain layer's call is unchanged.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np
import torch

from kvforge.attention import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionCapabilities,
    AttentionLayer,
    AttentionMetadata,
    BatchLayout,
    metadata_of,
)
from kvforge.plugins.attention.kv_write import write_kv

#: a FlashAttention generation's paged attention function: the output (FA4: with the log-sum-exp)
AttentionFunction = Callable[..., Union[torch.Tensor, tuple[torch.Tensor, ...]]]

INSTALL_HINT = ("flash_attn is not installed: pip install flash-attn-4 (FlashAttention-4, Hopper/Blackwell) "
                "or pip install flash-attn")


@dataclass(frozen=True)
class Implementation:
    """One FlashAttention generation: where its function lives and what its paged path accepts."""

    module: str
    function: str
    head_sizes: tuple[int, ...]
    min_compute_capability: tuple[int, int]
    block_sizes: tuple[int, ...] | None = None  # None: any multiple of block_size_multiple
    block_size_multiple: int = 1
    sinks: bool = False  # takes attention sinks (learnable_sink)


IMPLEMENTATIONS = {  # preference order for "auto"
    "fa4": Implementation("flash_attn.cute", "flash_attn_varlen_func", (64, 128), (9, 0),
                          block_sizes=(16, 32, 64, 128), sinks=True),
    "fa3": Implementation("flash_attn_interface", "flash_attn_with_kvcache", (64, 128, 256), (9, 0),
                          block_sizes=(16, 32, 64, 128, 256)),
    "fa2": Implementation("flash_attn", "flash_attn_varlen_func", (64, 128, 256), (8, 0), block_size_multiple=256),
}


def load_function(impl: str) -> AttentionFunction | None:
    """The implementation's attention function, or None if it does not import."""
    spec = IMPLEMENTATIONS[impl]
    try:
        return getattr(importlib.import_module(spec.module), spec.function)
    except (ImportError, AttributeError):  # AttributeError: flash_attn present only as FA4's namespace
        return None


def implementation_reasons(impl: str, *, device: torch.device, head_size: int, block_size: int,
                           features: frozenset[str] | tuple[str, ...] = ()) -> list[str]:
    """Why implementation ``impl`` refuses this setup (not installed, block size, head size, compute
    capability, a per-layer variant it lacks); empty if it accepts."""
    spec = IMPLEMENTATIONS[impl]
    if load_function(impl) is None:
        return [f"flash_attn {impl} is not installed ({spec.module}.{spec.function})"]
    reasons = []
    if "attention_sinks" in features and not spec.sinks:
        reasons.append(f"flash_attn {impl} takes no attention sinks (FA4's learnable_sink only)")
    if spec.block_sizes is not None and block_size not in spec.block_sizes:
        reasons.append(f"block size {block_size} not supported by flash_attn {impl}: not in {spec.block_sizes}")
    if block_size % spec.block_size_multiple:
        reasons.append(f"block size {block_size} not supported by flash_attn {impl}: not a multiple of "
                       f"{spec.block_size_multiple}")
    if head_size not in spec.head_sizes:
        reasons.append(f"head size {head_size} not supported by flash_attn {impl} {spec.head_sizes}")
    # NOTE: no CUDA call unless CUDA is there: validate runs on CPU-only machines too
    if device.type == "cuda" and torch.cuda.is_available():
        cc = torch.cuda.get_device_capability(device)
        if cc < spec.min_compute_capability:
            reasons.append(f"compute capability {cc} below {spec.min_compute_capability} for flash_attn {impl}")
    return reasons


def choose_implementation(implementation: str, *, device: torch.device | str, head_size: int,
                          block_size: int, features: frozenset[str] | tuple[str, ...] = ()
                          ) -> tuple[str | None, list[str]]:
    """``(name, [])`` for the implementation to use (``auto``: the first installed one that accepts),
    or ``(None, reasons)`` when none does. ``features``: the per-layer variants the model needs."""
    names = [n for n in IMPLEMENTATIONS if load_function(n) is not None] if implementation == "auto" \
        else [implementation]
    reasons: list[str] = []
    for name in names:
        refused = implementation_reasons(name, device=torch.device(device), head_size=head_size,
                                         block_size=block_size, features=features)
        if not refused:
            return name, []
        reasons += refused
    return None, reasons or [INSTALL_HINT]


def cu_seqlens(lens: np.ndarray) -> np.ndarray:
    """[n + 1] int32 cumulative lengths, from 0."""
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    return cu


@dataclass
class FlashAttnMetadata(AttentionMetadata):
    cu_seqlens_k: torch.Tensor | None = None  # [num_seqs + 1] int32: FA2's paged varlen reads key lengths here


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    # what every implementation shares; block and head sizes depend on the one installed (validate)
    capabilities = AttentionCapabilities(
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        supports_cuda_graphs=True,
        min_compute_capability=(8, 0),
        sliding_window=True,
        logits_soft_cap=True,
        # FA4 only: validate and layer() refuse sinks where FA2/FA3 would run
        attention_sinks=True,
        auto_priority=20,
    )

    @dataclass
    class Options:
        """``[plugins.flash_attn]`` options."""

        implementation: str = "auto"  # auto (fa4 > fa3 > fa2, the first installed), fa4, fa3 or fa2

        def __post_init__(self) -> None:
            if self.implementation not in ("auto", *IMPLEMENTATIONS):
                raise ValueError(f"implementation must be one of auto, {', '.join(IMPLEMENTATIONS)}; "
                                 f"got {self.implementation!r}")

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        return [] if any(load_function(n) is not None for n in IMPLEMENTATIONS) else [INSTALL_HINT]

    @classmethod
    def validate(cls, *, device, dtype, head_size, block_size, kv_cache_dtype=None, features=()) -> list[str]:
        """The base checks, then: some installed implementation accepts the block and head size (and
        the sinks, if the model has them)."""
        reasons = super().validate(device=device, dtype=dtype, head_size=head_size, block_size=block_size,
                                   kv_cache_dtype=kv_cache_dtype, features=features)
        reasons = [r + " (FlashAttention reads FP8 K/V only with an FP8 query: FA3, or FA4 on SM100)"
                   if r.startswith("kv_cache_dtype") else r for r in reasons]
        if INSTALL_HINT in reasons:
            return reasons
        return reasons + choose_implementation("auto", device=device, head_size=head_size,
                                               block_size=block_size, features=features)[1]

    def __init__(self, *, implementation: str = "auto", **kwargs):
        impl, reasons = choose_implementation(implementation, device=kwargs["device"],
                                              head_size=kwargs["head_size"], block_size=kwargs["block_size"])
        fn = load_function(impl) if impl is not None else None  # choose_implementation checked that it imports
        if impl is None or fn is None:
            raise ValueError(f"attention backend 'flash_attn' cannot run this model: "
                             f"{'; '.join(reasons or [INSTALL_HINT])}")
        super().__init__(**kwargs)
        self.implementation = impl
        self._fn = fn

    def layer(self, index: int, *, sliding_window: int | None = None, logits_soft_cap: float | None = None,
              sinks: torch.Tensor | None = None) -> AttentionLayer:
        """As :meth:`AttentionBackend.layer`; a layer with sinks needs FA4."""
        if sinks is not None and not IMPLEMENTATIONS[self.implementation].sinks:
            raise ValueError(f"attention backend 'flash_attn' cannot run layer {index}: no attention sinks "
                             f"support in flash_attn {self.implementation} (FA4's learnable_sink only)")
        return super().layer(index, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)

    def build_metadata(self, layout: BatchLayout) -> FlashAttnMetadata:
        meta = FlashAttnMetadata(**self.layout_fields(layout))
        if self.implementation == "fa2":  # FA2's paged varlen reads key lengths from cu_seqlens_k
            t = torch.from_numpy(cu_seqlens(layout.seq_lens))
            cuda = self.device.type == "cuda"
            meta.cu_seqlens_k = (t.pin_memory() if cuda else t).to(self.device, non_blocking=cuda)
        return meta

    def build_graph_metadata(self, layout: BatchLayout) -> FlashAttnMetadata:
        """Host bounds that hold for every replay: the longest context is the block table's width."""
        meta = self.build_metadata(layout)
        meta.max_seq_len = layout.block_tables.shape[1] * self.block_size
        return meta

    def update_graph_metadata(self, meta: AttentionMetadata, layout: BatchLayout) -> None:
        super().update_graph_metadata(meta, layout)
        cu = metadata_of(meta, FlashAttnMetadata).cu_seqlens_k  # FA2's only
        if cu is not None:
            cu.copy_(torch.from_numpy(cu_seqlens(layout.seq_lens)), non_blocking=True)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayer = PLAIN_LAYER):
        # q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
        meta = metadata_of(meta, FlashAttnMetadata)
        n = meta.num_tokens
        q = q[:n]
        # NOTE: every new K/V of the step is written before the kernel reads the cache; slot -1 (graph
        # padding) writes nothing
        write_kv(k[:n], v[:n], kv_cache, meta.slot_mapping[:n])
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_size]
        variant = self._variant_kwargs(layer)
        if self.implementation == "fa4":
            out = self._fn(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens,
                           page_table=meta.block_tables, max_seqlen_q=meta.max_query_len,
                           max_seqlen_k=meta.max_seq_len, softmax_scale=self.scale, causal=True, **variant)
        elif self.implementation == "fa3":
            out = self._fn(q, k_cache, v_cache, cache_seqlens=meta.seq_lens, page_table=meta.block_tables,
                           cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
                           softmax_scale=self.scale, causal=True, **variant)
        else:
            out = self._fn(q, k_cache, v_cache, meta.query_start_loc, meta.cu_seqlens_k,
                           meta.max_query_len, meta.max_seq_len, softmax_scale=self.scale, causal=True,
                           block_table=meta.block_tables, **variant)
        return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse)

    @staticmethod
    def _variant_kwargs(layer: AttentionLayer) -> dict[str, object]:
        """The layer's window, soft cap and sinks as FlashAttention's keyword arguments (none for a
        plain layer). window_size is (left, right) keys around the query, both inclusive."""
        kw: dict[str, object] = {}
        if layer.sliding_window is not None:
            kw["window_size"] = (layer.sliding_window - 1, 0)
        if layer.logits_soft_cap is not None:
            kw["softcap"] = layer.logits_soft_cap
        if layer.sinks is not None:  # FA4 only (layer() refuses sinks elsewhere)
            kw["learnable_sink"] = layer.sinks
        return kw
