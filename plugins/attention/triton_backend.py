"""``triton``: kvforge's own paged attention in Triton (CUDA): a varlen prefill kernel and split-K decode.

Per step, ``build_metadata`` splits the batch into decode sequences (one query token; flash-decoding
with ``num_splits`` KV partitions per sequence and KV head, then a reduce) and prefill chunks (query
tiles of ``block_q`` tokens x the query heads of one KV head), all with vectorised numpy and one
host-to-device copy. ``forward`` launches at most four kernels and never loops over sequences.
An FP8 cache (``kv_cache_dtype``) is read by the same kernels (``kvforge.kernels.attention`` says how the
scales apply).
Per-layer sliding windows, soft caps and sinks are constexpr variants of the same kernels; a window
layer's decode splits cover its window only, so it gets a split count of its own (``window_splits``).
Design notes: docs/attention_triton.md; kernels: ``kvforge.kernels.attention``.

CPU testing: the capabilities list only ``cuda``, but while ``TRITON_INTERPRET=1`` is set (before
triton is first imported) ``validate`` also accepts ``cpu`` (class attribute
``_allow_cpu_for_interpreter``), so tests can build the backend on the CPU and run the kernels in
Triton's interpreter. ``auto`` never picks this backend on the CPU.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

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


@dataclass
class TritonOptions:
    """``[plugins.triton]`` options."""

    #: decode KV partitions per (sequence, KV head); None picks from batch size, KV heads and context
    decode_num_splits: int | None = None

    def __post_init__(self):
        if self.decode_num_splits is not None and not 1 <= self.decode_num_splits <= 64:
            raise ValueError(f"decode_num_splits must be in [1, 64] or None, got {self.decode_num_splits}")


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything else
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(kw_only=True)
class TritonMetadata(AttentionMetadata):
    """The step's decode sequences and prefill query tiles, and the decodes' split counts."""

    decode_seqs: torch.Tensor  # [num_decodes] int32, sequence index of each decode
    prefill_tile_seq: torch.Tensor  # [num_q_tiles] int32: tile j covers tokens tile_q0[j] .. + block_q
    prefill_tile_q0: torch.Tensor  # [num_q_tiles] int32  of sequence tile_seq[j]
    num_splits: int = 1  # decode KV partitions of global layers
    window_splits: dict[int, int] = field(default_factory=dict)  # sliding window -> its layers' partitions


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    capabilities = AttentionCapabilities(
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        kv_cache_dtypes=(torch.float8_e4m3fn,),  # e4m3 tiles widened in registers, scales folded in
        head_sizes=(32, 64, 128, 256),
        block_sizes=(16, 32, 64, 128),
        # decode launches read only device tensors; their grids depend on the batch size and
        # num_splits alone (the partitions are computed from seq_lens on the device)
        supports_cuda_graphs=True,
        sliding_window=True,
        logits_soft_cap=True,
        attention_sinks=True,
        auto_priority=40,
    )
    Options = TritonOptions
    #: accept device cpu while TRITON_INTERPRET=1 (tests run the kernels in the interpreter)
    _allow_cpu_for_interpreter: ClassVar[bool] = True

    def __init__(self, *, decode_num_splits: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        from kvforge.kernels import attention  # imports triton: only once the backend is built

        self._kernels = attention
        self.decode_num_splits = TritonOptions(decode_num_splits).decode_num_splits
        self.tiles = attention.tile_sizes(self.head_size, self.num_heads // self.num_kv_heads, self.dtype)
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 132  # interpreter: pretend to be an H100 so the heuristic behaves as on one

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        err = _triton_import_error()
        return [] if err is None else [f"triton is not installed: pip install triton ({err})"]

    @classmethod
    def validate(cls, *, device, dtype, head_size, block_size, kv_cache_dtype=None, features=()) -> list[str]:
        reasons = super().validate(device=device, dtype=dtype, head_size=head_size, block_size=block_size,
                                   kv_cache_dtype=kv_cache_dtype, features=features)
        if (cls._allow_cpu_for_interpreter and torch.device(device).type == "cpu"
                and os.environ.get("TRITON_INTERPRET") == "1"):
            reasons = [r for r in reasons if not r.startswith("device cpu")]
        return reasons

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        fields = self.layout_fields(layout)
        query_lens = layout.query_lens
        decode = np.flatnonzero(query_lens == 1)
        prefill = np.flatnonzero(query_lens > 1)
        # prefill query tiles: tile j covers tokens tile_q0[j] .. + block_q of sequence tile_seq[j]
        block_q = self.tiles["block_q"]
        tiles_per_seq = -(-query_lens[prefill] // block_q)
        tile_seq = np.repeat(prefill, tiles_per_seq)
        first_tile = np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
        tile_q0 = (np.arange(len(tile_seq)) - first_tile) * block_q
        # one host-to-device copy for the three index arrays
        packed = np.concatenate([decode, tile_seq, tile_q0]).astype(np.int32)
        t = torch.from_numpy(packed)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        n_dec, n_tiles = len(decode), len(tile_seq)
        max_dec_len = int(layout.seq_lens[decode].max()) if n_dec else 0
        meta = TritonMetadata(**fields, decode_seqs=t[:n_dec], prefill_tile_seq=t[n_dec:n_dec + n_tiles],
                              prefill_tile_q0=t[n_dec + n_tiles:])
        self._choose_splits(meta, n_dec, max_dec_len)
        return meta

    def build_graph_metadata(self, layout: BatchLayout) -> TritonMetadata:
        """A captured decode graph keeps its grid: pick the split count for the longest context it may see."""
        meta = self.build_metadata(layout)
        self._choose_splits(meta, layout.num_seqs, layout.block_tables.shape[1] * self.block_size)
        return meta

    def _choose_splits(self, meta: TritonMetadata, num_decodes: int, max_len: int) -> None:
        """``num_splits`` for the decodes of global layers and ``window_splits`` {window: splits} for
        those of each sliding window among the layers built (their splits share the window's keys only).
        Host values fixed per step, so a captured graph's grids stay valid for every replay."""
        if self.decode_num_splits is not None:
            meta.num_splits, meta.window_splits = self.decode_num_splits, {}
            return
        choose = functools.partial(self._kernels.choose_num_splits, num_decodes, self.num_kv_heads,
                                   num_sms=self.num_sms)
        windows = {spec.sliding_window for spec in self.layers.values() if spec.sliding_window is not None}
        meta.num_splits = choose(max_len)
        meta.window_splits = {w: choose(min(max_len, w)) for w in windows}

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayer = PLAIN_LAYER):
        # q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
        kern, meta = self._kernels, metadata_of(meta, TritonMetadata)
        n = meta.num_tokens
        # the kernels take any token/head strides but need a contiguous head dimension
        q, k, v = (t[:n] if t.stride(-1) == 1 else t[:n].contiguous() for t in (q, k, v))
        scales = getattr(self.kv_scales(kv_cache), "tensor", None)  # [2] fp32 (k, v) for an FP8 cache
        # NOTE: every new K/V is written before any attention kernel reads the cache (stream order)
        kern.reshape_and_cache(k, v, kv_cache, meta.slot_mapping[:n], scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        kern.prefill_attention(q, kv_cache, out, meta.prefill_tile_seq, meta.prefill_tile_q0, meta.query_start_loc,
                               meta.seq_lens, meta.block_tables, self.scale, self.tiles, scales, layer)
        # a window the metadata has no split count for (a layer declared after it was built): any split
        # count is correct, the global one merely spreads the window thinner
        num_splits = meta.num_splits if layer.sliding_window is None else meta.window_splits.get(
            layer.sliding_window, meta.num_splits)
        kern.decode_attention(q, kv_cache, out, meta.decode_seqs, meta.query_start_loc, meta.seq_lens,
                              meta.block_tables, self.scale, num_splits, self.tiles, scales, layer)
        return out
