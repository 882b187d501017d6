"""The Triton kernels behind :func:`kvforge.lora.ops.segmented_matmul` (that module states the contract).

Punica-style segmented GEMM over a work list: the grid is (entries of ``LoRABatch.tiles`` [x K splits],
N tiles). A program reads its tile ``(slot, first, rows)`` (``rows == 0``: an unused entry, it returns
at once), gathers its rows of x through ``order[first:first + rows]``, multiplies them with its slot's
weights in BLOCK_K steps (``tl.dot``, float32 accumulator) and stores, or adds to the old values in
float32 and stores, with masks on rows and N. Rows of no slot are never in ``order``, so nothing
touches them. The work list (built on the host, ``kvforge.lora.ops.tile_grouping``) holds only the
tiles a step needs, so a graph sized for 512 rows launches 24 programs per N tile and K split, not a
row tile per slot for every possible slot size.

The shrink at decode (few rows, N = rank small, K = hidden large) would be a handful of programs each
walking all of K; there K is split across programs, each writing a float32 partial product to a
workspace at the rows' grouped positions, and a second kernel sums the partials in split order and
stores: deterministic, no atomics (the price: one more launch, and ``split_k * T * N`` float32 bytes).

NOTE (CUDA graphs): no host synchronisation, no ``.item()``; the grid and the tiles depend on shapes
and the work list's length only, while the grouping is read from device memory, so a captured launch
replays correctly for any grouping that fits the work list.

Tiles measured on an H100 (benchmarks/lora_kernels.py, 256 decode rows over 8 rank-16 adapters,
Llama-3-8B shapes): shrink 32 x 64 x 128 with 8 K splits (16 for K = 14336), expand 32 x 128.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvforge.lora.ops import TILE_ROWS
from kvforge.triton_support import fit_block, kernel_loader

if TYPE_CHECKING:
    from kvforge.lora.ops import LoRABatch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: rows per program of the split-K sum (no tl.dot there, so any power of two)
REDUCE_BLOCK_M = 32


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


_triton = kernel_loader("kvforge.lora.triton_ops:build_kernels")


def available() -> bool:
    """Whether triton imports (and the kernels build)."""
    return _triton() is not None


def build_kernels(triton, tl):
    """The kernels, built once (triton passed in, so that importing this module never needs it)."""

    @triton.jit
    def segment_kernel(x_ptr, w_ptr, dest_ptr, order_ptr, tiles_ptr, N, K,
                       stride_xm, stride_xk, stride_ws, stride_wn, stride_wk, stride_dsplit, stride_dm, stride_dn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr, CAST_FP32: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
        """dest[rows of one slot's row tile, N tile] (=, +=) x[rows] @ w[slot]^T, or one K split's partial."""
        tile = tl.program_id(0) // SPLIT_K
        split = tl.program_id(0) % SPLIT_K
        pid_n = tl.program_id(1)
        count = tl.load(tiles_ptr + tile * 3 + 2)
        if count == 0:
            return
        slot = tl.load(tiles_ptr + tile * 3)
        first = tl.load(tiles_ptr + tile * 3 + 1)
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = offs_m < count
        rows = tl.load(order_ptr + first + offs_m, mask=row_ok, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
        w_ptrs = (w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :].to(tl.int64) * stride_wn
                  + offs_k[:, None] * stride_wk)  # [BLOCK_K, BLOCK_N]: w[slot]^T
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(split * BLOCK_K, K, BLOCK_K * SPLIT_K):
            if EVEN_K:
                xs = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                ws = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = tl.arange(0, BLOCK_K) < K - k0
                xs = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                ws = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if CAST_FP32:  # mixed dtypes (the expand's float32 x, 16-bit B): exact float32 products
                xs = xs.to(tl.float32)
                ws = ws.to(tl.float32)
            acc = tl.dot(xs, ws, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * SPLIT_K * stride_xk
            w_ptrs += BLOCK_K * SPLIT_K * stride_wk
        mask = row_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            ptrs = dest_ptr + rows[:, None] * stride_dm + offs_n[None, :] * stride_dn
            if ACCUMULATE:
                acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, acc.to(dest_ptr.dtype.element_ty), mask=mask)
        else:  # this split's float32 partial, at the rows' grouped positions (reduce_kernel sums them)
            positions = (first + offs_m).to(tl.int64)
            ptrs = dest_ptr + split * stride_dsplit + positions[:, None] * stride_dm + offs_n[None, :] * stride_dn
            tl.store(ptrs, acc, mask=mask)

    @triton.jit
    def reduce_kernel(partial_ptr, order_ptr, starts_ptr, out_ptr, num_slots, N,
                      stride_psplit, stride_pm, stride_om, stride_on,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                      ACCUMULATE: tl.constexpr):
        """out[order[positions], N tile] (=, +=) the sum of the K splits' partials, in split order."""
        pid_m = tl.program_id(0)
        total = tl.load(starts_ptr + num_slots)  # rows that have a slot
        if pid_m * BLOCK_M >= total:
            return
        positions = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = positions < total
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (offs_n < N)[None, :]
        p_ptrs = partial_ptr + positions.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
        acc = tl.load(p_ptrs, mask=mask, other=0.0)
        for split in tl.static_range(1, SPLIT_K):
            acc += tl.load(p_ptrs + split * stride_psplit, mask=mask, other=0.0)
        rows = tl.load(order_ptr + positions, mask=row_ok, other=0).to(tl.int64)
        ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        if ACCUMULATE:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return {"segment": segment_kernel, "reduce": reduce_kernel}


def segmented_matmul_triton(x: torch.Tensor, weights: torch.Tensor, batch: LoRABatch, out: torch.Tensor, *,
                            accumulate: bool, tiles: SegmentTiles | None = None) -> None:
    """segmented_matmul's Triton path (arguments already checked by it): x [T, K], weights [S, N, K],
    out [T, N], any strides. ``tiles``: :func:`pick_tiles`'s choice by default (benchmarks sweep others)."""
    loaded = _triton()
    if loaded is None:
        raise ValueError("segmented_matmul: impl 'triton' needs triton, which does not import here")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"segmented_matmul: impl 'triton' needs CUDA tensors (or TRITON_INTERPRET=1); got {x.device}")
    for name, t in (("x", x), ("weights", weights), ("out", out)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"segmented_matmul: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
    triton, kernels = loaded
    num_rows, k = x.shape
    n = weights.shape[1]
    num_tiles = batch.tiles.shape[0]
    if num_rows == 0 or n == 0 or batch.num_slots == 0 or num_tiles == 0:
        return
    # 16-bit operands of one dtype go to the tensor cores as they are (exact products, float32 sums);
    # anything else is widened to float32 and multiplied exactly ("ieee", not tf32), like the reference
    cast = not (x.dtype == weights.dtype and x.dtype != torch.float32)
    tiles = tiles or pick_tiles(num_tiles, n, k, fp32=cast)
    if tiles.block_m != TILE_ROWS:
        raise ValueError(f"segmented_matmul: block_m must be the work list's TILE_ROWS ({TILE_ROWS}); got {tiles.block_m}")
    common = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k,
                  ACCUMULATE=accumulate, EVEN_K=k % tiles.block_k == 0, CAST_FP32=cast,
                  DOT_PRECISION="ieee" if cast else "tf32", num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    grid = (num_tiles * tiles.split_k, triton.cdiv(n, tiles.block_n))
    if tiles.split_k == 1:
        kernels["segment"][grid](x, weights, out, batch.order, batch.tiles, n, k, x.stride(0), x.stride(1),
                                 weights.stride(0), weights.stride(1), weights.stride(2), 0, out.stride(0),
                                 out.stride(1), **common)
        return
    # partial: [split_k, T, N] float32, row p = the p-th grouped row (order[p])
    partial = torch.empty((tiles.split_k, num_rows, n), dtype=torch.float32, device=x.device)
    kernels["segment"][grid](x, weights, partial, batch.order, batch.tiles, n, k, x.stride(0), x.stride(1),
                             weights.stride(0), weights.stride(1), weights.stride(2), partial.stride(0),
                             partial.stride(1), partial.stride(2), **common)
    grid = (triton.cdiv(num_rows, REDUCE_BLOCK_M), triton.cdiv(n, tiles.block_n))
    kernels["reduce"][grid](partial, batch.order, batch.starts, out, batch.num_slots, n, partial.stride(0),
                            partial.stride(1), out.stride(0), out.stride(1), BLOCK_M=REDUCE_BLOCK_M,
                            BLOCK_N=tiles.block_n, SPLIT_K=tiles.split_k, ACCUMULATE=accumulate,
                            num_warps=4)
