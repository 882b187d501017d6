"""The fused mixture-of-experts Triton kernels and their launchers: the routing, the alignment of the
(token, slot) pairs into blocks of one expert (one program, or three), and the gate/up and down GEMMs.
``kvforge.layers.fused_moe`` describes the algorithm, holds the torch reference and the tile table,
and calls these.

NOTE (CUDA graphs): no launcher synchronises with the host; grids depend on shapes only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvforge.kernels import fit_block, launcher

if TYPE_CHECKING:
    from kvforge.layers.fused_moe import ExpertBlocks, MoeTiles

#: pairs each program of the parallel alignment takes
ALIGN_PARALLEL_CHUNK = 256
#: pairs one step of the alignment program takes (its one-hot tile: ALIGN_CHUNK x experts)
ALIGN_CHUNK = 64


# ---- shared tile code ---------------------------------------------------------------------------------

@triton.jit
def _grouped_tile(num_blocks, n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block, N tile) of this program: GROUP_M blocks of M share a sweep over N (L2 reuse of the x rows
    and the weight tiles)."""
    pid = tl.program_id(0)
    group = GROUP_M * tl.cdiv(n, BLOCK_N)
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % group) % group_rows, (pid % group) // group_rows


@triton.jit
def _lay_out_blocks(counts, block_expert_ptr, num_padded_ptr, pairs_ptr, num_pairs, num_experts, num_blocks,
                    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """From the pairs per expert (``counts`` [EXPERTS]): the rows in use, every block's expert, padding in
    every row of ``pairs``. Returns each expert's first row."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        # the block's expert: how many experts end at or before its first row (E past the end)
        ended = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(ended, num_experts), mask=blocks < num_blocks)
    for r0 in range(0, num_blocks * BLOCK_M, FILL):
        rows = r0 + tl.arange(0, FILL)
        tl.store(pairs_ptr + rows, tl.full([FILL], 0, tl.int32) + num_pairs, mask=rows < num_blocks * BLOCK_M)
    return padded_end - padded


@triton.jit
def _store_activation(gate, up, out_ptr, offs_m, offs_n, n_ok, stride_om, alpha, limit, ACTIVATION: tl.constexpr):
    """Store act(gate, up) (float32 [BLOCK_M, BLOCK_N], rounded as the reference rounds) at rows offs_m."""
    dt = out_ptr.dtype.element_ty
    if ACTIVATION == 0:  # silu(gate) * up
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
    else:  # swigluoai: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    # NOTE: padding rows are written too (finite: their x rows load as zeros), so the down kernel
    # reads whole blocks unmasked
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, act.to(dt), mask=n_ok[None, :])


@triton.jit
def _store_routed(y, pairs_ptr, routing_ptr, out_ptr, offs_m, offs_n, n_ok, num_pairs, stride_om):
    """Store routing[pair] * y (float32 [BLOCK_M, BLOCK_N]) at each real row's pair; padding rows are dropped."""
    pairs = tl.load(pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    y = y * tl.load(routing_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# ---- the GEMMs ----------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def gate_up_kernel(x_ptr, w_ptr, b_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, out_ptr,
                   num_pairs, num_blocks, top_k, inter, hidden, alpha, limit,
                   stride_xt, stride_xh, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """act[rows of one block, N tile] = act(x[tokens] @ gate^T, x[tokens] @ up^T) for the block's expert."""
    pid_m, pid_n = _grouped_tile(num_blocks, inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            xs = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wg = tl.load(gate_ptrs, mask=n_ok[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < hidden - k0
            xs = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(gate_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_gate = tl.dot(xs, wg, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(xs, wu, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    # rounded where the reference rounds: the projection, the bias add, the activation
    dt = out_ptr.dtype.element_ty
    gate = acc_gate.to(dt).to(tl.float32)
    up = acc_up.to(dt).to(tl.float32)
    if HAS_BIAS:
        bias = b_ptr + expert * stride_be + offs_n * stride_bn
        gate = (gate + tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        up = (up + tl.load(bias + inter * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt)
        up = up.to(tl.float32)
    _store_activation(gate, up, out_ptr, offs_m, offs_n, n_ok, stride_om, alpha, limit, ACTIVATION)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def down_kernel(a_ptr, w_ptr, b_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, routing_ptr, out_ptr,
                num_pairs, num_blocks, hidden, inter,
                stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[pair, N tile] = routing[pair] * (act[row] @ w2[expert]^T + bias) for one block's rows."""
    pid_m, pid_n = _grouped_tile(num_blocks, hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dt = out_ptr.dtype.element_ty
    y = acc.to(dt).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0)
        y = (y + bias.to(tl.float32)[None, :]).to(dt).to(tl.float32)
    _store_routed(y, pairs_ptr, routing_ptr, out_ptr, offs_m, offs_n, n_ok, num_pairs, stride_om)


# ---- the alignment ------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts, num_blocks,
                 BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    """align_pairs as one program: count the pairs per expert, pad, lay out the blocks, then place
    each pair after the earlier pairs of its expert (a one-hot [CHUNK, EXPERTS] tile per step)."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=EXPERTS).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    next_row = _lay_out_blocks(counts, block_expert_ptr, num_padded_ptr, pairs_ptr, num_pairs, num_experts,
                               num_blocks, BLOCK_M, CHUNK, CHUNK)
    tl.debug_barrier()  # the padding is written before the pairs overwrite their rows
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=EXPERTS).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of the same expert in this chunk
        dest = tl.sum((before + next_row[None, :]) * onehot, axis=1)
        tl.store(pairs_ptr + dest, offs, mask=offs < num_pairs)
        next_row += tl.sum(onehot, axis=0)


@triton.jit(do_not_specialize=["num_pairs"])
def align_count_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, CHUNK: tl.constexpr):
    """Count each chunk's pairs per expert; a pair's rank in its expert is the count it found."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=ok, sem="relaxed")
    tl.store(rank_ptr + offs, rank, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def align_layout_kernel(counts_ptr, start_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                        num_experts, num_blocks, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr,
                        CHUNK: tl.constexpr, FILL: tl.constexpr):
    """From the counts: each expert's first row, every block's expert, and padding in every row."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    start = _lay_out_blocks(counts, block_expert_ptr, num_padded_ptr, pairs_ptr, num_pairs, num_experts,
                            num_blocks, BLOCK_M, CHUNK, FILL)
    tl.store(start_ptr + experts, start, mask=experts < num_experts)


@triton.jit(do_not_specialize=["num_pairs"])
def align_scatter_kernel(ids_ptr, rank_ptr, start_ptr, pairs_ptr, num_pairs, CHUNK: tl.constexpr):
    """Each pair to its expert's first row plus its rank (the padding is already written)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    dest = tl.load(start_ptr + ids, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
    tl.store(pairs_ptr + dest, offs.to(tl.int32), mask=ok)


# ---- the routing --------------------------------------------------------------------------------------

@triton.jit
def route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts, top_k,
                 SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, ROUND: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's routing, as kvforge.layers.moe.select_experts computes it: softmax over the experts
    then the top k (renormalised, rounded), or the top k logits then a softmax over them. The k are
    written best first; of equal scores the lowest expert wins."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    dt = logits_ptr.dtype.element_ty
    if SOFTMAX_FIRST:
        e = tl.where(ok, tl.exp(x - tl.max(x, axis=0)), 0.0)
        score = tl.where(ok, e / tl.sum(e, axis=0), float("-inf"))
    else:
        score = x
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < top_k
    sel_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    sel_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in range(top_k):
        best = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == best, offs, BLOCK_E), axis=0)
        sel_w = tl.where(kk == j, best, sel_w)
        sel_i = tl.where(kk == j, idx, sel_i)
        score = tl.where(offs == idx, float("-inf"), score)
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            sel_w = sel_w / tl.sum(tl.where(k_ok, sel_w, 0.0), axis=0)
        if ROUND:
            sel_w = sel_w.to(dt).to(tl.float32)
    else:  # a softmax over the k logits, in the logits' dtype (computed in float32, then rounded)
        e = tl.where(k_ok, tl.exp(sel_w - tl.max(tl.where(k_ok, sel_w, float("-inf")), axis=0)), 0.0)
        sel_w = (e / tl.sum(e, axis=0)).to(dt).to(tl.float32)
    tl.store(weights_ptr + t * top_k + kk, sel_w, mask=k_ok)
    tl.store(ids_ptr + t * top_k + kk, sel_i.to(tl.int64), mask=k_ok)


# ---- launchers ----------------------------------------------------------------------------------------

def route(router_logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool,
          round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) of ``router_logits`` [T, E], a program per token."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        launcher(route_kernel, (num_tokens,))(router_logits, weights, ids, router_logits.stride(0), num_experts, top_k,
                                    SOFTMAX_FIRST=softmax_first, RENORMALIZE=renormalize, ROUND=round_weights,
                                    BLOCK_E=triton.next_power_of_2(num_experts),
                                    BLOCK_K=triton.next_power_of_2(top_k), num_warps=1 if num_experts <= 64 else 2)
    return weights, ids


def _block_buffers(num_blocks: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Empty (sorted_pairs, block_expert, num_padded) for ``num_blocks`` blocks."""
    return (torch.empty((num_blocks * block_m,), dtype=torch.int32, device=device),
            torch.empty((num_blocks,), dtype=torch.int32, device=device),
            torch.empty((1,), dtype=torch.int32, device=device))


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert, num_padded) of ``ExpertBlocks``, in one program (a stable order)."""
    sorted_pairs, block_expert, num_padded = _block_buffers(num_blocks, block_m, topk_ids.device)
    launcher(align_kernel, (1,))(topk_ids.reshape(-1), sorted_pairs, block_expert, num_padded, topk_ids.numel(),
                       num_experts, num_blocks, BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts),
                       CHUNK=ALIGN_CHUNK, num_warps=4)
    return sorted_pairs, block_expert, num_padded


def align_pairs_parallel(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align_pairs` for many pairs, in parallel: count them per expert with atomics (each pair's
    old count is its rank in its expert), lay out the blocks from the counts in one program, then
    scatter every pair to its expert's start plus its rank. The order within an expert is the atomics'
    (not stable): each pair's row is computed on its own, so the output does not depend on it."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    counts = torch.zeros((num_experts,), dtype=torch.int32, device=device)
    rank = torch.empty((num_pairs,), dtype=torch.int32, device=device)
    start = torch.empty((num_experts,), dtype=torch.int32, device=device)
    sorted_pairs, block_expert, num_padded = _block_buffers(num_blocks, block_m, device)
    grid = (triton.cdiv(num_pairs, ALIGN_PARALLEL_CHUNK),)
    launcher(align_count_kernel, grid)(ids, counts, rank, num_pairs, CHUNK=ALIGN_PARALLEL_CHUNK)
    launcher(align_layout_kernel, (1,))(counts, start, sorted_pairs, block_expert, num_padded, num_pairs, num_experts,
                              num_blocks, BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts),
                              CHUNK=ALIGN_CHUNK, FILL=1024, num_warps=4)
    launcher(align_scatter_kernel, grid)(ids, rank, start, sorted_pairs, num_pairs, CHUNK=ALIGN_PARALLEL_CHUNK)
    return sorted_pairs, block_expert, num_padded


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            blocks: ExpertBlocks, tiles: MoeTiles, *, activation: int, w13_bias: torch.Tensor | None,
            w2_bias: torch.Tensor | None, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    """The gate/up then the down kernel over the aligned pairs: [T * k, H], row ``t * k + j`` the routing
    weight times expert ``topk_ids[t, j]``'s output for token t. ``activation``: the ACTIVATION code."""
    num_pairs, (_, hidden), inter = topk_weights.numel(), x.shape, w13.shape[1] // 2
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays fp32; 16-bit ignores it
    common = dict(BLOCK_M=tiles.block_m, GROUP_M=tiles.group_m, DOT_PRECISION=dot_precision,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    aligned = (blocks.sorted_pairs, blocks.block_expert, blocks.num_padded)

    # act: [num_rows, I], in sorted (padded) pair order
    act = torch.empty((blocks.num_blocks * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    block_n, block_k = fit_block(tiles.block_n_up, inter), fit_block(tiles.block_k, hidden)
    b13 = w13_bias if w13_bias is not None else w13
    launcher(gate_up_kernel, (blocks.num_blocks * triton.cdiv(inter, block_n),))(
        x, w13, b13, *aligned, act, num_pairs, blocks.num_blocks, topk_weights.shape[1], inter, hidden,
        float(swiglu_alpha), float(swiglu_limit), x.stride(0), x.stride(1), w13.stride(0), w13.stride(1),
        w13.stride(2), b13.stride(0), b13.stride(-1), act.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=w13_bias is not None, ACTIVATION=activation,
        EVEN_K=hidden % block_k == 0, **common)

    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    block_n, block_k = fit_block(tiles.block_n_down, hidden), fit_block(tiles.block_k, inter)
    b2 = w2_bias if w2_bias is not None else w2
    launcher(down_kernel, (blocks.num_blocks * triton.cdiv(hidden, block_n),))(
        act, w2, b2, *aligned, topk_weights.reshape(-1).contiguous(), per_pair, num_pairs, blocks.num_blocks,
        hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), b2.stride(0), b2.stride(-1),
        per_pair.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=w2_bias is not None,
        EVEN_K=inter % block_k == 0, **common)
    return per_pair
