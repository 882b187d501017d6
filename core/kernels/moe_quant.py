"""The fused mixture-of-experts GEMMs over quantized experts: ``kvforge.kernels.moe``'s gate/up and
down kernels, with each weight tile loaded in its stored format and dequantized in registers to the
activations' dtype before ``tl.dot`` (weight-only: the activations stay in the model dtype).

Formats (``FORMAT``):
- 1, FP8 e4m3: weights ``[E, N, K]`` e4m3, float32 scales ``[E, ceil(N / BN), ceil(K / BK)]``;
  ``w[n, k] = q[n, k] * scale[n // BN, k // BK]`` (a 128x128 block, a channel: BN = 1 and BK = K,
  or a tensor: BN = N, BK = K). The up half of a gate/up tensor starts at scale row ``S_UP``.
- 2, MXFP4: weights ``[E, N, K / 2]`` uint8, two e2m1 values a byte (element ``2j`` in the low
  nibble), uint8 e8m0 scales ``[E, N, K / 32]``: ``w[n, k] = e2m1(q[n, k]) * 2^(scale[n, k // 32] - 127)``.

NOTE (CUDA graphs): as ``kvforge.kernels.moe``: no host synchronisation, grids from shapes only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvforge.kernels import fit_block, launcher
from kvforge.kernels.moe import _grouped_tile, _store_activation, _store_routed

if TYPE_CHECKING:
    from kvforge.layers.fused_moe import ExpertBlocks, MoeTiles

FORMATS = {"fp8": 1, "mxfp4": 2}


@triton.jit
def _e2m1(nibble):
    """An e2m1 code (sign, 2 exponent bits, 1 mantissa bit) -> float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    exp = (nibble >> 1) & 3
    man = (nibble & 1).to(tl.float32)
    mag = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where((nibble & 8) != 0, -mag, mag)


@triton.jit
def _weight_tile(w_ptr, s_ptr, expert, rows, s_rows, offs_k, mask, stride_we, stride_wn, stride_se, stride_sn,
                 BN: tl.constexpr, BK: tl.constexpr, FORMAT: tl.constexpr, dt: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile ``W[rows, offs_k]^T`` of one expert, dequantized to ``dt`` (``s_rows``:
    the scale rows of ``rows``)."""
    w_base = w_ptr + expert * stride_we + rows[None, :].to(tl.int64) * stride_wn
    s_base = s_ptr + expert * stride_se
    if FORMAT == 1:
        q = tl.load(w_base + offs_k[:, None], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_base + s_rows[None, :] * stride_sn + offs_k[:, None] // BK, mask=mask,
                    other=0.0)
        w = q * s
    else:
        byte = tl.load(w_base + offs_k[:, None] // 2, mask=mask, other=0).to(tl.int32)
        nibble = tl.where(offs_k[:, None] % 2 == 0, byte & 15, byte >> 4)
        e8m0 = tl.load(s_base + s_rows[None, :] * stride_sn + offs_k[:, None] // 32, mask=mask,
                       other=127).to(tl.float32)
        w = _e2m1(nibble) * tl.exp2(e8m0 - 127.0)
    return w.to(dt)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def quant_gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, out_ptr,
                         num_pairs, num_blocks, top_k, inter, hidden, alpha, limit, s_up,
                         stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                         FORMAT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """act[rows of one block, N tile] = act(x @ gate^T, x @ up^T), the weights dequantized per tile."""
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
    dt = out_ptr.dtype.element_ty
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        xs = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
        mask = k_ok[:, None] & n_ok[None, :]
        wg = _weight_tile(w_ptr, s_ptr, expert, offs_n, offs_n // BN, offs_k, mask, stride_we, stride_wn, stride_se,
                          stride_sn, BN, BK, FORMAT, dt)
        wu = _weight_tile(w_ptr, s_ptr, expert, inter + offs_n, s_up + offs_n // BN, offs_k, mask, stride_we,
                          stride_wn, stride_se, stride_sn, BN, BK, FORMAT, dt)
        acc_gate = tl.dot(xs, wg, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(xs, wu, acc_up, input_precision=DOT_PRECISION)
    gate = acc_gate.to(dt).to(tl.float32)
    up = acc_up.to(dt).to(tl.float32)
    if HAS_BIAS:
        bias = b_ptr + expert * stride_be + offs_n
        gate = (gate + tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        up = (up + tl.load(bias + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    _store_activation(gate, up, out_ptr, offs_m, offs_n, n_ok, stride_om, alpha, limit, ACTIVATION)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def quant_down_kernel(a_ptr, w_ptr, s_ptr, b_ptr, pairs_ptr, block_expert_ptr, num_padded_ptr, routing_ptr,
                      out_ptr, num_pairs, num_blocks, hidden, inter,
                      stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      HAS_BIAS: tl.constexpr, FORMAT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """out[pair, N tile] = routing[pair] * (act[row] @ w2[expert]^T + bias), w2 dequantized per tile."""
    pid_m, pid_n = _grouped_tile(num_blocks, hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :], mask=k_ok[None, :],
                    other=0.0)
        w = _weight_tile(w_ptr, s_ptr, expert, offs_n, offs_n // BN, offs_k, k_ok[:, None] & n_ok[None, :], stride_we,
                         stride_wn, stride_se, stride_sn, BN, BK, FORMAT, dt)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    y = acc.to(dt).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0)
        y = (y + bias.to(tl.float32)[None, :]).to(dt).to(tl.float32)
    _store_routed(y, pairs_ptr, routing_ptr, out_ptr, offs_m, offs_n, n_ok, num_pairs, stride_om)


def quantized_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                      topk_weights: torch.Tensor, blocks: ExpertBlocks, tiles: MoeTiles, *, fmt: str, inter: int,
                      groups13: tuple[int, int], groups2: tuple[int, int], s_up: int, activation: int,
                      w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, swiglu_alpha: float,
                      swiglu_limit: float) -> torch.Tensor:
    """As ``kvforge.kernels.moe.experts`` ([T * k, H], row ``t * k + j``), over stored weights: w13
    ``[E, 2I, H']`` and w2 ``[E, H, I']`` (H' = H, or H / 2 bytes for MXFP4), their scales s13 / s2
    (rows contiguous along K), ``groups``: each tensor's (BN, BK) for FP8, ignored for MXFP4."""
    num_pairs, hidden = topk_weights.numel(), x.shape[1]
    code = FORMATS[fmt]
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(BLOCK_M=tiles.block_m, GROUP_M=tiles.group_m, FORMAT=code, DOT_PRECISION=dot_precision,
                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    aligned = (blocks.sorted_pairs, blocks.block_expert, blocks.num_padded)
    # act: [num_rows, I], in sorted (padded) pair order
    act = torch.empty((blocks.num_blocks * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    block_n, block_k = fit_block(tiles.block_n_up, inter), fit_block(tiles.block_k, hidden)
    bn, bk = groups13 if code == 1 else (1, 32)
    b13 = w13_bias if w13_bias is not None else x
    launcher(quant_gate_up_kernel, (blocks.num_blocks * triton.cdiv(inter, block_n),))(
        x, w13, s13, b13, *aligned, act, num_pairs, blocks.num_blocks, topk_weights.shape[1], inter, hidden,
        float(swiglu_alpha), float(swiglu_limit), s_up, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), b13.stride(0), act.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=w13_bias is not None, ACTIVATION=activation, BN=bn, BK=bk, **common)
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    block_n, block_k = fit_block(tiles.block_n_down, hidden), fit_block(tiles.block_k, inter)
    bn, bk = groups2 if code == 1 else (1, 32)
    b2 = w2_bias if w2_bias is not None else x
    launcher(quant_down_kernel, (blocks.num_blocks * triton.cdiv(hidden, block_n),))(
        act, w2, s2, b2, *aligned, topk_weights.reshape(-1).contiguous(), per_pair, num_pairs, blocks.num_blocks,
        hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), b2.stride(0),
        per_pair.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=w2_bias is not None, BN=bn, BK=bk, **common)
    return per_pair
