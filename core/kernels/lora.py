"""The Triton kernels behind :func:`kvforge.lora.ops.segmented_matmul` (that module states the contract,
checks the arguments and picks the tiles), and their launcher.

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
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvforge.kernels import launcher

if TYPE_CHECKING:
    from kvforge.lora.ops import LoRABatch, SegmentTiles

#: rows per program of the split-K sum (no tl.dot there, so any power of two)
REDUCE_BLOCK_M = 32


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
    for split in tl.static_range(1, SPLIT_K):  # pyright: ignore[reportGeneralTypeIssues] - unrolled by Triton
        acc += tl.load(p_ptrs + split * stride_psplit, mask=mask, other=0.0)
    rows = tl.load(order_ptr + positions, mask=row_ok, other=0).to(tl.int64)
    ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def segmented_matmul(x: torch.Tensor, weights: torch.Tensor, batch: LoRABatch, out: torch.Tensor, *,
                     accumulate: bool, tiles: SegmentTiles, cast: bool) -> None:
    """The launch of :func:`kvforge.lora.ops.segmented_matmul_triton` (arguments checked, tiles chosen and
    the batch non-empty there): x [T, K], weights [S, N, K], out [T, N], any strides. ``cast``: widen the
    operands to float32 and multiply exactly ("ieee"), else tf32 (ignored by 16-bit operands)."""
    num_rows, k = x.shape
    n = weights.shape[1]
    num_tiles = batch.tiles.shape[0]
    common = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k,
                  ACCUMULATE=accumulate, EVEN_K=k % tiles.block_k == 0, CAST_FP32=cast,
                  DOT_PRECISION="ieee" if cast else "tf32", num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    grid = (num_tiles * tiles.split_k, triton.cdiv(n, tiles.block_n))
    if tiles.split_k == 1:
        launcher(segment_kernel, grid)(x, weights, out, batch.order, batch.tiles, n, k, x.stride(0), x.stride(1),
                             weights.stride(0), weights.stride(1), weights.stride(2), 0, out.stride(0),
                             out.stride(1), **common)
        return
    # partial: [split_k, T, N] float32, row p = the p-th grouped row (order[p])
    partial = torch.empty((tiles.split_k, num_rows, n), dtype=torch.float32, device=x.device)
    launcher(segment_kernel, grid)(x, weights, partial, batch.order, batch.tiles, n, k, x.stride(0), x.stride(1),
                         weights.stride(0), weights.stride(1), weights.stride(2), partial.stride(0),
                         partial.stride(1), partial.stride(2), **common)
    grid = (triton.cdiv(num_rows, REDUCE_BLOCK_M), triton.cdiv(n, tiles.block_n))
    launcher(reduce_kernel, grid)(partial, batch.order, batch.starts, out, batch.num_slots, n, partial.stride(0),
                        partial.stride(1), out.stride(0), out.stride(1), BLOCK_M=REDUCE_BLOCK_M,
                        BLOCK_N=tiles.block_n, SPLIT_K=tiles.split_k, ACCUMULATE=accumulate, num_warps=4)
