"""``flashinfer``: paged attention through FlashInfer's batch prefill and batch decode wrappers (CUDA).

Per step, :meth:`FlashInferAttentionBackend.build_metadata` splits the batch into decode sequences
(one query token) and the rest (prefill chunks, with or without a cached prefix) and plans each
wrapper once; every layer's :meth:`~FlashInferAttentionBackend.forward` then only launches kernels.
The cache keeps kvforge's default layout, so K and V are each NHD pages
``[num_blocks, block_size, kv_heads, head_size]`` and are passed to FlashInfer as a ``(k, v)`` tuple.

Facts relied on (flashinfer-python 0.7.x; verified on the H200, see shared/gpu/README.md):
``plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
num_kv_heads, head_dim, page_size, causal=, sm_scale=, q_data_type=, kv_data_type=)`` takes host
index arrays (``1 <= last_page_len <= page_size``); ``causal=True`` aligns the mask bottom-right
(query ``i`` of a ``q_len`` chunk over ``kv_len`` keys sees keys ``<= kv_len - q_len + i``), which is
what a chunk after a cached prefix needs; ``run(q, (k_cache, v_cache), out=)``. The first plan of a
dtype/head size JIT-compiles (minutes, then cached under ~/.cache/flashinfer).

FP8 cache (``kv_cache_dtype`` fp8, flashinfer 0.7.2's decode.py/prefill.py): ``plan(...,
q_data_type=bf16, kv_data_type=torch.float8_e4m3fn)`` builds the mixed-precision kernels (a bf16
query over e4m3 pages: the CUDA-core decode, and the FA2 prefill, which ``determine_attention_backend``
picks because its FA3 path wants an FP8 query); ``run(q, (k, v), k_scale=, v_scale=, out=)`` takes the
layer's scales as floats: ``k_scale`` multiplies ``sm_scale`` and ``v_scale`` the output (``out *=
v_scale``, skipped when exactly 1.0). The floats are the layer's :class:`~kvforge.attention.KVScales`,
fixed before the cache is allocated, so a captured decode graph holds the right values.

CUDA graphs (decode steps only: ``cuda_graph_query_lens=(1,)``): one decode wrapper per captured batch
size, built with ``use_cuda_graph=True`` over index buffers of its own; ``plan()`` is re-run before
each replay (it rewrites those buffers and the wrapper's device plan in place; in graph mode the
split-KV layout depends on the batch size only, so the captured grid stays valid). New K/V are written
by kvforge's Triton ``reshape_and_cache``, which skips the padding rows' slot -1.

Per-layer variants: FlashInfer fixes the sliding window (``window_left = window - 1``, the keys left of
the query it still sees) and the soft cap (``logits_soft_cap``) when a wrapper is planned, so the backend
keeps one set of wrappers per distinct :attr:`~kvforge.attention.AttentionLayer.plan_key` among the
layers built, plans each set every step and runs a layer through its key's set (a model with one key
plans and replays exactly as before). A window's plan leaves out the blocks wholly before the window
(``window_skip_blocks``): FlashInfer aligns the causal mask and the window to the end of the context, so
no score changes, the work stays bounded by the window, and the block-table entries given back there
(0) are never handed to it. Sinks: not declared. What 0.7.2's ``run(sinks=)`` does depends on the
kernel behind the wrapper: the CUDA-core decode this backend plans by default never receives them
(decode.py leaves them out of that kernel's arguments: they would be dropped silently), and other
paths refuse them or take them as a plan-time variant of another wrapper (cute-dsl's ``AttentionWithSink``).

Async scheduling: ``plan()`` fills the wrapper's pinned host buffer and queues its copy to the
device behind the running step. Before planning again, the backend waits on an event recorded after
the previous plan (that copy runs as soon as the previous step's kernels end, which the engine has
waited for by then), so the buffer is never rewritten under a queued copy. Index arrays go in pinned
(fresh per step) or already on the device, so that no ``plan()`` copy blocks the host.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol, TypedDict, TypeVar

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

INSTALL_HINT = "flashinfer is not installed: pip install flashinfer-python"
W = TypeVar("W")


def _import_flashinfer() -> ModuleType:
    """The optional ``flashinfer`` package, imported by name (an ``ImportError`` when it is absent)."""
    return importlib.import_module("flashinfer")


# -- host-side planning (pure numpy, tested on the CPU) -------------------------------------------
def plan_paged_indices(seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
                       skip_blocks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR page table for sequences of ``seq_lens`` (each >= 1) tokens.

    Returns ``(indptr [n+1] int32, indices [indptr[-1]] int32, last_page_len [n] int32)``: sequence
    ``i`` uses pages ``indices[indptr[i]:indptr[i+1]]`` (entries ``skip_blocks[i]`` up to
    ``ceil(seq_len / block_size)`` of its block-table row; ``skip_blocks`` None: from the first), the
    last one holding ``last_page_len[i]`` tokens.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    end = -(-seq_lens // block_size)
    start = np.zeros_like(end) if skip_blocks is None else np.asarray(skip_blocks, dtype=np.int64)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(end - start, out=indptr[1:])
    # row-major boolean indexing concatenates each row's entries start[i]:end[i], in row order
    cols = np.arange(block_tables.shape[1])[None, :]
    used = (cols >= start[:, None]) & (cols < end[:, None])
    indices = np.ascontiguousarray(block_tables[used], dtype=np.int32)
    last_page_len = ((seq_lens - 1) % block_size + 1).astype(np.int32)
    return indptr, indices, last_page_len


def window_skip_blocks(seq_lens: np.ndarray, query_lens: np.ndarray | int, window: int | None,
                       block_size: int) -> np.ndarray | None:
    """[n] int64: the leading blocks of each sequence wholly before its first query's sliding window (that
    query sits at ``seq_len - q_len`` and sees keys from ``seq_len - q_len - window + 1``); None without
    a window. FlashInfer sees the context from the first block kept on: query ``i`` of ``q_len`` over
    ``kv_len`` keys sees keys ``kv_len - q_len + i - window_left .. kv_len - q_len + i``, the same keys
    whichever whole blocks before them are left out."""
    if window is None:
        return None
    first_visible = np.asarray(seq_lens, dtype=np.int64) - query_lens - window + 1
    return np.maximum(first_visible, 0) // block_size


def token_indices(query_start_loc: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Flat-batch token indices of sequences ``seqs`` (ascending), concatenated in that order."""
    starts = query_start_loc[seqs].astype(np.int64)
    lens = query_start_loc[seqs + 1].astype(np.int64) - starts
    if not len(lens):
        return np.zeros(0, dtype=np.int64)
    # index j of the output belongs to sequence k: starts[k] + (j - offset of k in the output)
    offsets = np.cumsum(lens) - lens
    return np.repeat(starts - offsets, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def as_slice(tokens: np.ndarray) -> slice | None:
    """``tokens`` as a slice when they form one contiguous ascending run, else None."""
    if len(tokens) and tokens[-1] - tokens[0] + 1 == len(tokens):
        return slice(int(tokens[0]), int(tokens[-1]) + 1)
    return None


Tokens = slice | torch.Tensor  # a contiguous run of the flat batch, or [n] int64 device indices
PlanKey = tuple[int | None, float | None]  # AttentionLayer.plan_key: (sliding window, logits soft cap)


class KVScaleArgs(TypedDict, total=False):
    """``run()``'s FP8 cache scales (an FP8 cache's :class:`~kvforge.attention.KVScales`)."""

    k_scale: float
    v_scale: float


class PagedWrapper(Protocol):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` / ``BatchDecodeWithPagedKVCacheWrapper`` as this
    backend calls them (flashinfer 0.7; the library is optional, so its types are not imported)."""

    def plan(self, *args: object, **kwargs: object) -> None: ...

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *,
            out: torch.Tensor | None = None, k_scale: float = ..., v_scale: float = ...) -> torch.Tensor: ...


@dataclass
class FlashInferPlan:
    """``FlashInferMetadata.plan``: the flat-batch tokens each wrapper reads and writes this step
    (None: no such sequences), the same for every plan key. The plans themselves live in the wrappers."""

    step: int  # the backend's plan counter when this was built
    decode: Tokens | None
    prefill: Tokens | None


@dataclass
class FlashInferMetadata(AttentionMetadata):
    plan: FlashInferPlan | None = None  # an eager step's
    graph_wrappers: dict[PlanKey, PagedWrapper] | None = None  # a captured decode step's, by plan key


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    capabilities = AttentionCapabilities(
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        kv_cache_dtypes=(torch.float8_e4m3fn,),
        head_sizes=(64, 128, 256),
        block_sizes=(16, 32, 64, 128),
        supports_cuda_graphs=True,
        cuda_graph_query_lens=(1,),  # verification steps (q > 1) run eagerly through the prefill wrapper
        supports_async_scheduling=True,
        min_compute_capability=(8, 0),
        sliding_window=True,  # window_left, planned per plan key
        logits_soft_cap=True,  # logits_soft_cap, likewise
        attention_sinks=False,  # run(sinks=) misses the kernels planned here (module docstring)
        auto_priority=30,
    )

    @dataclass
    class Options:
        """``[plugins.flashinfer]`` options."""

        workspace_mib: int = 128  # float workspace shared by both wrappers (split-KV partials)
        decode_use_tensor_cores: bool = False  # FlashInfer's tensor-core decode (prefill kernel)

        def __post_init__(self) -> None:
            if not isinstance(self.workspace_mib, int) or self.workspace_mib < 16:
                raise ValueError(f"workspace_mib must be an integer >= 16, got {self.workspace_mib!r}")
            if not isinstance(self.decode_use_tensor_cores, bool):
                raise ValueError(f"decode_use_tensor_cores must be true or false, "
                                 f"got {self.decode_use_tensor_cores!r}")

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        try:
            _import_flashinfer()
        except ImportError as exc:
            if getattr(exc, "name", None) == "flashinfer":
                return [INSTALL_HINT]
            return [f"flashinfer failed to import: {exc!r}"]
        return []

    def __init__(self, *, workspace_mib: int = 128, decode_use_tensor_cores: bool = False, **kwargs):
        super().__init__(**kwargs)
        self._flashinfer = _import_flashinfer()
        self._use_tensor_cores = decode_use_tensor_cores
        # NOTE: FlashInfer wants the float workspace zeroed before its first use
        # NOTE: every wrapper shares the float workspace (split-KV partials): they run one after another
        self._workspace = torch.zeros(workspace_mib << 20, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[PlanKey, tuple[PagedWrapper, PagedWrapper]] = {}  # plan key -> (prefill, decode)
        self._graph_decode: dict[tuple[int, PlanKey], PagedWrapper] = {}  # (captured batch size, plan key) -> wrapper
        self._planned: torch.cuda.Event | None = None  # recorded after the last plan's copies were queued
        self._step = 0

    def _pinned(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t.pin_memory() if self.device.type == "cuda" else t

    def _on_device(self, a: np.ndarray) -> torch.Tensor:
        return self._pinned(a).to(self.device, non_blocking=self.device.type == "cuda")

    def _before_plan(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()

    def _after_plan(self) -> None:
        if self.device.type != "cuda":
            return
        if self._planned is None:
            self._planned = torch.cuda.Event()
        self._planned.record()

    @staticmethod
    def _variant_kwargs(key: PlanKey) -> dict[str, float]:
        """A plan key as plan()'s keyword arguments (none for plain attention: its plan is unchanged)."""
        window, cap = key
        kw: dict[str, float] = {}
        if window is not None:
            kw["window_left"] = window - 1
        if cap is not None:
            kw["logits_soft_cap"] = cap
        return kw

    def _eager_wrappers(self, key: PlanKey) -> tuple[PagedWrapper, PagedWrapper]:
        """The (prefill, decode) wrappers of ``key``, made when the key is first planned."""
        pair = self._wrappers.get(key)
        if pair is None:
            fi = self._flashinfer
            pair = self._wrappers[key] = (
                fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"),
                fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=self._use_tensor_cores))
        return pair

    def _plan_decode(self, wrapper: PagedWrapper, key: PlanKey, seq_lens: np.ndarray,
                     block_tables: np.ndarray) -> None:
        skip = window_skip_blocks(seq_lens, 1, key[0], self.block_size)
        indptr, indices, last = plan_paged_indices(seq_lens, block_tables, self.block_size, skip)
        # indptr and last_page_len on the host (plan reads them there), the indices on the device
        wrapper.plan(self._pinned(indptr), self._on_device(indices), self._pinned(last), self.num_heads,
                     self.num_kv_heads, self.head_size, self.block_size, sm_scale=self.scale,
                     q_data_type=self.dtype, kv_data_type=self.kv_cache_dtype, **self._variant_kwargs(key))

    def _plan_prefill(self, wrapper: PagedWrapper, key: PlanKey, qo_indptr: np.ndarray, seq_lens: np.ndarray,
                      query_lens: np.ndarray, block_tables: np.ndarray) -> None:
        skip = window_skip_blocks(seq_lens, query_lens, key[0], self.block_size)
        indptr, indices, last = plan_paged_indices(seq_lens, block_tables, self.block_size, skip)
        # after the index arrays: num_qo_heads, num_kv_heads, head_dim, page_size; the rest by keyword
        wrapper.plan(self._pinned(qo_indptr), self._pinned(indptr), self._on_device(indices), self._pinned(last),
                     self.num_heads, self.num_kv_heads, self.head_size, self.block_size, causal=True,
                     sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.kv_cache_dtype,
                     **self._variant_kwargs(key))

    def build_metadata(self, layout: BatchLayout) -> FlashInferMetadata:
        meta = FlashInferMetadata(**self.layout_fields(layout))
        self._step += 1
        qsl = layout.query_start_loc
        query_lens = layout.query_lens
        decode = np.flatnonzero(query_lens == 1)
        prefill = np.flatnonzero(query_lens > 1)
        plan = FlashInferPlan(self._step, None, None)
        qo_indptr = np.zeros(len(prefill) + 1, dtype=np.int32)  # the prefill sequences' query offsets
        np.cumsum(query_lens[prefill], out=qo_indptr[1:])
        self._before_plan()
        for key in self.plan_keys:  # one key (one plan per wrapper) unless the layers differ
            prefill_wrapper, decode_wrapper = self._eager_wrappers(key)
            if len(decode):
                self._plan_decode(decode_wrapper, key, layout.seq_lens[decode], layout.block_tables[decode])
            if len(prefill):
                self._plan_prefill(prefill_wrapper, key, qo_indptr, layout.seq_lens[prefill],
                                   query_lens[prefill], layout.block_tables[prefill])
        if len(decode):
            plan.decode = self._tokens(qsl[decode].astype(np.int64))
        if len(prefill):
            plan.prefill = self._tokens(token_indices(qsl, prefill))
        self._after_plan()
        meta.plan = plan
        return meta

    def build_graph_metadata(self, layout: BatchLayout) -> FlashInferMetadata:
        """A decode graph of ``layout.num_seqs`` rows: a wrapper of its own per plan key, over fixed index
        buffers (``meta.graph_wrappers``: {plan key: wrapper})."""
        n = layout.num_seqs
        if layout.num_tokens != n:
            raise ValueError("flashinfer: CUDA graphs of decode steps only (one query token per sequence)")
        fields = self.layout_fields(layout)
        wrappers: dict[PlanKey, PagedWrapper] = {}
        for key in self.plan_keys:
            wrapper = self._graph_decode.get((n, key))
            if wrapper is None:
                def index_buffer(size: int) -> torch.Tensor:
                    return torch.zeros(size, dtype=torch.int32, device=self.device)

                wrapper = self._graph_decode[n, key] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._use_tensor_cores,
                    paged_kv_indptr_buffer=index_buffer(n + 1),
                    paged_kv_indices_buffer=index_buffer(n * layout.block_tables.shape[1]),
                    paged_kv_last_page_len_buffer=index_buffer(n))
            wrappers[key] = wrapper
        meta = FlashInferMetadata(**fields, graph_wrappers=wrappers)
        self._replan_graph(wrappers, layout)
        return meta

    def update_graph_metadata(self, meta: AttentionMetadata, layout: BatchLayout) -> None:
        super().update_graph_metadata(meta, layout)
        wrappers = metadata_of(meta, FlashInferMetadata).graph_wrappers
        if wrappers is None:
            raise ValueError("flashinfer: update_graph_metadata of metadata that build_graph_metadata did not make")
        self._replan_graph(wrappers, layout)

    def _replan_graph(self, wrappers: dict[PlanKey, PagedWrapper], layout: BatchLayout) -> None:
        self._before_plan()
        for key, wrapper in wrappers.items():
            self._plan_decode(wrapper, key, layout.seq_lens, layout.block_tables)
        self._after_plan()

    def _layer_wrapper(self, wrappers: dict[PlanKey, W], layer: AttentionLayer) -> W:
        wrapper = wrappers.get(layer.plan_key)
        if wrapper is None:
            raise RuntimeError(f"flashinfer: no plan for layer {layer.index} (sliding window, soft cap) "
                               f"{layer.plan_key}; planned: {list(wrappers)}. Declare every layer with "
                               "backend.layer() before the first step")
        return wrapper

    def _tokens(self, tokens: np.ndarray) -> Tokens:
        contiguous = as_slice(tokens)
        if contiguous is not None:
            return contiguous
        t = torch.from_numpy(tokens)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=self.device.type == "cuda")

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, layer: AttentionLayer = PLAIN_LAYER):
        # q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
        meta = metadata_of(meta, FlashInferMetadata)
        n = meta.num_tokens
        q = q[:n].contiguous()
        # NOTE: every new K/V of the step is written before either wrapper reads the cache; slot -1
        # (graph padding) writes nothing
        scales = self.kv_scales(kv_cache)
        write_kv(k[:n], v[:n], kv_cache, meta.slot_mapping[:n], None if scales is None else scales.tensor)
        scale_kw: KVScaleArgs = {} if scales is None else {"k_scale": scales.k, "v_scale": scales.v}
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_size]
        out = torch.empty_like(q)
        if meta.graph_wrappers is not None:  # a captured decode step: every row is a decode
            self._layer_wrapper(meta.graph_wrappers, layer).run(q, (k_cache, v_cache), out=out, **scale_kw)
            return out
        plan = meta.plan
        if plan is None or plan.step != self._step:
            raise RuntimeError("flashinfer: metadata from an earlier step; the wrappers hold one step's plan")
        prefill_wrapper, decode_wrapper = self._layer_wrapper(self._wrappers, layer)
        for wrapper, tokens in ((decode_wrapper, plan.decode), (prefill_wrapper, plan.prefill)):
            if tokens is None:
                continue
            if isinstance(tokens, slice):
                wrapper.run(q[tokens], (k_cache, v_cache), out=out[tokens], **scale_kw)
            else:  # interleaved in the batch: gather the queries, scatter the outputs
                out[tokens] = wrapper.run(q.index_select(0, tokens), (k_cache, v_cache), **scale_kw)
        return out
