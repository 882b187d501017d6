"""Batched LoRA matmuls: every token row multiplied by its own adapter's weights, in one call.

A step mixes requests of many adapters (and of none: the base model). Punica/S-LoRA's answer is a
segmented GEMM (SGMV): group the token rows by adapter slot once per step (:func:`group_rows` on the
host, a stable sort), then each kernel program multiplies one slot's weights with a tile of that
slot's rows, gathered through the grouping. LoRA needs two such products per adapted layer::

    shrink: h[T, R]  = x[T, K=hidden] @ A[slot].T      (A: [S, R, K], R = 8..192)
    expand: y[T, N] += h[T, R]        @ B[slot].T      (B: [S, N, R], N = 1024..28672, accumulate)

The shrink's output h has the model's dtype (rounded once, as peft's bf16 ``lora_A`` output is), so
that the expand multiplies 16-bit operands on the tensor cores.

:func:`segmented_matmul` does both: the Triton kernel (``kvforge.kernels.lora``) on CUDA, the torch
reference :func:`segmented_matmul_torch` elsewhere. Both compute the products in float32 and round once,
when storing (for ``accumulate``, after adding the old value in float32).

NOTE (CUDA graphs): the kernel's grid is sized by the length of ``LoRABatch.tiles``, fixed at capture
(:func:`tile_capacity` of the graph's padded token count), never by the grouping; the grouping lives in
device buffers (``order``, ``starts``, ``tiles``) that a replay reads afresh, so one graph serves any
grouping.

Tiles measured on an H100 (benchmarks/lora_kernels.py, 256 decode rows over 8 rank-16 adapters,
Llama-3-8B shapes): shrink 32 x 64 x 128 with 8 K splits (16 for K = 14336), expand 32 x 128.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from kvforge.kernels import fit_block, triton_imports

IMPLS = ("auto", "torch", "triton")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- the grouping (host) ---------------------------------------------------------------------------

def group_rows(row_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Group token rows by adapter slot.

    row_slots: int [T], each row's slot in [0, num_slots), or -1 for no adapter.
    Returns ``(order, starts)``: order int32 [T'] the rows that have a slot, by increasing slot and,
    within a slot, in increasing row order (a stable sort); starts int32 [num_slots + 1], slot s's rows
    are ``order[starts[s]:starts[s + 1]]``. Rows of -1 are left out (T' = rows with a slot).
    """
    row_slots = np.asarray(row_slots)
    _check_slots("row_slots", row_slots, num_slots)
    with_slot = np.flatnonzero(row_slots >= 0)
    slots = row_slots[with_slot].astype(np.int64)
    order = with_slot[np.argsort(slots, kind="stable")].astype(np.int32)
    return order, _starts(np.bincount(slots, minlength=num_slots), num_slots)


def group_request_rows(req_slots: np.ndarray, query_lens: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`group_rows` of ``np.repeat(req_slots, query_lens)``, for rows that come in per-request runs
    (the engine's layout): sorts the requests, not the rows, then expands each request to its run.

    req_slots: int [B] each request's slot or -1; query_lens: int [B] >= 0, its rows this step.
    """
    req_slots, query_lens = np.asarray(req_slots), np.asarray(query_lens)
    if req_slots.shape != query_lens.shape or req_slots.ndim != 1:
        raise ValueError(f"req_slots {req_slots.shape} and query_lens {query_lens.shape} must be one [B] shape")
    if query_lens.size and (not np.issubdtype(query_lens.dtype, np.integer) or query_lens.min() < 0):
        raise ValueError(f"query_lens must be integers >= 0; got {query_lens.dtype} down to {query_lens.min()}")
    _check_slots("req_slots", req_slots, num_slots)
    req_slots, query_lens = req_slots.astype(np.int64), query_lens.astype(np.int64)
    first_row = np.cumsum(query_lens) - query_lens  # [B]: each request's first row
    with_slot = np.flatnonzero(req_slots >= 0)
    requests = with_slot[np.argsort(req_slots[with_slot], kind="stable")]  # [B']: by slot, stable
    lens = query_lens[requests]
    out_first = np.cumsum(lens) - lens  # [B']: where each request's run starts in order
    order = np.repeat(first_row[requests] - out_first, lens) + np.arange(int(lens.sum()))
    counts = np.bincount(req_slots[with_slot], weights=query_lens[with_slot], minlength=num_slots)
    return order.astype(np.int32), _starts(counts.astype(np.int64), num_slots)


def _check_slots(name: str, slots: np.ndarray, num_slots: int) -> None:
    if slots.ndim != 1 or not (slots.size == 0 or np.issubdtype(slots.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array; got shape {slots.shape}, dtype {slots.dtype}")
    if num_slots < 0:
        raise ValueError(f"num_slots must be >= 0; got {num_slots}")
    if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"{name} must lie in [-1, {num_slots}) (num_slots = {num_slots}); "
                         f"got values in [{int(slots.min())}, {int(slots.max())}]")


def _starts(counts: np.ndarray, num_slots: int) -> np.ndarray:
    starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts[:num_slots], out=starts[1:])
    return starts


# ---- one step's grouping on the device --------------------------------------------------------------

#: rows per kernel program: each slot's rows are cut into tiles of at most this many
TILE_ROWS = 32


def tile_capacity(num_rows: int, num_slots: int) -> int:
    """Tiles that any grouping of ``num_rows`` rows over ``num_slots`` slots can need (each slot's last
    tile may be partial): what a CUDA graph of ``num_rows`` rows sizes its grid by."""
    return -(-num_rows // TILE_ROWS) + num_slots


def tile_grouping(starts: np.ndarray, capacity: int) -> np.ndarray:
    """The kernels' work list: int32 [capacity, 3], one ``(slot, first, rows)`` per tile, where tile
    rows are ``order[first:first + rows]``, all of one slot, ``rows <= TILE_ROWS``; unused entries are
    zeros (``rows == 0``: the program returns at once)."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.diff(starts)
    per_slot = -(-counts // TILE_ROWS)  # tiles of each slot
    num_tiles = int(per_slot.sum())
    if num_tiles > capacity:
        raise ValueError(f"the grouping needs {num_tiles} row tiles; the capacity is {capacity}")
    slot = np.repeat(np.arange(len(counts)), per_slot)
    nth = np.arange(num_tiles) - np.repeat(np.cumsum(per_slot) - per_slot, per_slot)  # tile index within its slot
    first = starts[slot] + nth * TILE_ROWS
    tiles = np.zeros((capacity, 3), dtype=np.int32)
    tiles[:num_tiles] = np.stack([slot, first, np.minimum(TILE_ROWS, starts[slot + 1] - first)], axis=1)
    return tiles


@dataclass
class LoRABatch:
    """One step's grouping of token rows by slot, as the kernels read it.

    NOTE: ``order``, ``starts`` and ``tiles`` are the buffers a CUDA graph captures: a new grouping is
    copied into them (same tensors) before a replay. The kernels' grid is ``tiles``' length, fixed at
    capture (:func:`tile_capacity` of the graph's rows), never the grouping's actual tile count.
    """

    order: torch.Tensor  # [capacity] int32: rows grouped by slot; only the first starts[-1] meaningful
    starts: torch.Tensor  # [num_slots + 1] int32: slot s's rows are order[starts[s]:starts[s + 1]]
    tiles: torch.Tensor  # [tile capacity, 3] int32: tile_grouping(starts), the kernels' work list
    num_slots: int
    host_starts: np.ndarray | None = None  # [num_slots + 1] the same starts on the host; None in graphs

    def __post_init__(self):
        if self.num_slots < 0:
            raise ValueError(f"LoRABatch: num_slots ({self.num_slots}) must be >= 0")
        for name, dims in (("order", 1), ("starts", 1), ("tiles", 2)):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != dims:
                raise ValueError(f"LoRABatch.{name} must be {dims}-D int32; got {t.dtype} {tuple(t.shape)}")
        if self.tiles.shape[1] != 3:
            raise ValueError(f"LoRABatch.tiles must be [tiles, 3]; got {tuple(self.tiles.shape)}")
        if self.starts.shape[0] != self.num_slots + 1:
            raise ValueError(f"LoRABatch.starts has {self.starts.shape[0]} entries, expected num_slots + 1 = "
                             f"{self.num_slots + 1}")
        if self.host_starts is not None and self.host_starts.shape != (self.num_slots + 1,):
            raise ValueError(f"LoRABatch.host_starts has shape {self.host_starts.shape}, expected "
                             f"({self.num_slots + 1},)")

    @classmethod
    def from_grouping(cls, order: np.ndarray, starts: np.ndarray, *, device: torch.device | str,
                      capacity: int | None = None, tiles: int | None = None) -> LoRABatch:
        """A batch from :func:`group_rows`'s result: ``order`` zero-padded to ``capacity`` rows (default:
        its length), a work list of ``tiles`` entries (default: the tiles the grouping needs;
        ``ValueError`` if fewer)."""
        capacity = len(order) if capacity is None else capacity
        if capacity < len(order):
            raise ValueError(f"capacity ({capacity}) is below the {len(order)} grouped rows")
        padded = np.zeros(capacity, dtype=np.int32)
        padded[:len(order)] = order
        starts = starts.astype(np.int32)
        need = int((-(-np.diff(starts) // TILE_ROWS)).sum())
        work = tile_grouping(starts, need if tiles is None else tiles)
        return cls(order=torch.from_numpy(padded).to(device), starts=torch.from_numpy(starts).to(device),
                   tiles=torch.from_numpy(work).to(device), num_slots=len(starts) - 1, host_starts=starts)


# ---- the matmul --------------------------------------------------------------------------------------

def segmented_matmul(x: torch.Tensor, weights: torch.Tensor, batch: LoRABatch, out: torch.Tensor, *,
                     accumulate: bool, impl: str = "auto") -> None:
    """For each slot s and each of its rows r: ``out[r] = x[r] @ weights[s].T`` (``accumulate``:
    ``out[r] += ...``), in float32, rounded to out's dtype once. Rows of no slot are left untouched.

    x: [T, K] (rows may be strided); weights: [S, N, K] with S >= batch.num_slots; out: [T, N] (may be a
    column slice of a wider tensor). ``impl``: "auto" (Triton for CUDA tensors where triton imports,
    else torch), "torch", or "triton" (also on the CPU under TRITON_INTERPRET=1, for tests).
    """
    _check_args(x, weights, batch, out, impl)
    if impl == "auto":
        impl = "triton" if x.is_cuda and triton_imports() else "torch"
    if impl == "torch":
        segmented_matmul_torch(x, weights, batch, out, accumulate=accumulate)
    else:
        segmented_matmul_triton(x, weights, batch, out, accumulate=accumulate)


@dataclass(frozen=True)
class SegmentTiles:
    """One launch's tiles: ``block_m`` grouped rows x ``block_n`` output columns per program, K in
    ``block_k`` steps, split over ``split_k`` programs (1: no split, no second kernel)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def pick_tiles(num_tiles: int, n: int, k: int, *, fp32: bool) -> SegmentTiles:
    """Tiles for a launch over a work list of ``num_tiles`` row tiles (shapes only: graph-safe).
    ``fp32``: the dot runs on float32 operands (a 64-wide K step then, half the registers of a 16-bit
    128-wide one). Rows per program are always ``TILE_ROWS`` (the work list's tiles)."""
    if n < k:
        # shrink (N = rank 8..192, K = hidden): one N tile covers most ranks, so x is read once; a long
        # K walk. At decode there are too few row tiles to stream A [R, K] at bandwidth: split K (about
        # 512 columns a split, up to 16 splits) unless the work list alone fills the GPU (prefill)
        block_n, block_k, stages = 64, (64 if fp32 else 128), 3
        split_k = 1 if num_tiles >= 128 else max(1, min(16, k // 512))
    else:
        # expand (K = rank, N = 1024..28672): one or a few K steps, memory-bound on out's read-modify-write
        block_n, block_k, split_k, stages = 128, 64, 1, 2
    return SegmentTiles(block_m=TILE_ROWS, block_n=fit_block(block_n, n), block_k=fit_block(block_k, k),
                        split_k=split_k, num_warps=4, num_stages=stages)


def segmented_matmul_triton(x: torch.Tensor, weights: torch.Tensor, batch: LoRABatch, out: torch.Tensor, *,
                            accumulate: bool, tiles: SegmentTiles | None = None) -> None:
    """segmented_matmul's Triton path (arguments already checked by it): x [T, K], weights [S, N, K],
    out [T, N], any strides. ``tiles``: :func:`pick_tiles`'s choice by default (benchmarks sweep others)."""
    if not triton_imports():
        raise ValueError("segmented_matmul: impl 'triton' needs triton, which does not import here")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"segmented_matmul: impl 'triton' needs CUDA tensors (or TRITON_INTERPRET=1); got {x.device}")
    for name, t in (("x", x), ("weights", weights), ("out", out)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"segmented_matmul: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
    num_tiles, n, k = batch.tiles.shape[0], weights.shape[1], x.shape[1]
    if x.shape[0] == 0 or n == 0 or batch.num_slots == 0 or num_tiles == 0:
        return
    # 16-bit operands of one dtype go to the tensor cores as they are (exact products, float32 sums);
    # anything else is widened to float32 and multiplied exactly ("ieee", not tf32), like the reference
    cast = not (x.dtype == weights.dtype and x.dtype != torch.float32)
    tiles = tiles or pick_tiles(num_tiles, n, k, fp32=cast)
    if tiles.block_m != TILE_ROWS:
        raise ValueError(f"segmented_matmul: block_m must be the work list's TILE_ROWS ({TILE_ROWS}); got {tiles.block_m}")
    from kvforge.kernels import lora

    lora.segmented_matmul(x, weights, batch, out, accumulate=accumulate, tiles=tiles, cast=cast)


def segmented_matmul_torch(x: torch.Tensor, weights: torch.Tensor, batch: LoRABatch, out: torch.Tensor, *,
                           accumulate: bool) -> None:
    """The reference of :func:`segmented_matmul` (same arguments): a loop over the slots that have rows,
    each gathering its rows, multiplying in float32 and writing them back."""
    starts = batch.host_starts if batch.host_starts is not None else batch.starts.tolist()  # tolist: a sync
    order = batch.order.long()
    for slot in range(batch.num_slots):
        begin, end = int(starts[slot]), int(starts[slot + 1])
        if begin == end:
            continue
        rows = order[begin:end]
        y = x.index_select(0, rows).float() @ weights[slot].float().t()  # [rows, N] float32
        if accumulate:
            y += out.index_select(0, rows).float()
        out.index_copy_(0, rows, y.to(out.dtype))


def _check_args(x, weights, batch, out, impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"segmented_matmul: impl {impl!r} is not one of {', '.join(IMPLS)}")
    if x.dim() != 2 or weights.dim() != 3 or out.dim() != 2:
        raise ValueError(f"segmented_matmul expects x [T, K], weights [S, N, K], out [T, N]; got x "
                         f"{tuple(x.shape)}, weights {tuple(weights.shape)}, out {tuple(out.shape)}")
    num_rows, k = x.shape
    if weights.shape[2] != k or tuple(out.shape) != (num_rows, weights.shape[1]):
        raise ValueError(f"segmented_matmul: weights {tuple(weights.shape)} and out {tuple(out.shape)} do not fit "
                         f"[S, N, K] and [T, N] with x [T, K] = {tuple(x.shape)}")
    if batch.num_slots > weights.shape[0]:
        raise ValueError(f"segmented_matmul: the batch has {batch.num_slots} slots, weights only {weights.shape[0]}")
    devices = {t.device for t in (x, weights, out, batch.order, batch.starts)}
    if len(devices) != 1:
        raise ValueError(f"segmented_matmul: x, weights, out and the batch must share a device; got {devices}")
