"""W4A16: the Triton GEMM with 4-bit weights and 16-bit activations, the INT4 dequantization kernel, and
their launchers. ``kvforge.plugins.quantization.int4`` defines the layout, checks the operands, holds the
torch reference and picks the path (fused GEMM for M up to 128, dequantize + ``torch.matmul`` beyond,
the reference off CUDA); docs/quantization.md has the measurements.

The layout: ``qweight`` int32 ``[K // 8, N]`` (bits ``4j .. 4j+3`` of ``qweight[r, n]`` hold
``q[8r + j, n]``), ``scales``, ``zeros`` ``[K // G, N]`` in the activation dtype, and
``w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]`` computed in float32.

The fused kernel unpacks and dequantizes each weight tile in registers and multiplies it on the tensor
cores with fp32 accumulation, split along K when the N tiles alone would leave SMs idle (``quant_gemm``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import launcher
from kvforge.kernels.quant_gemm import GemmConfig, SplitK, pick_config, split_tile, store_split_tile

#: split K until the grid has 4 programs per SM: at M = 1 this picks the fastest of splits 1..16 on
#: each of the four layers (benchmarks/quant_kernels.py --sweep, H100); 2 a SM left gate_up 12% slower
PROGRAMS_PER_SM = 4

#: M bucket (largest M) -> block sizes of the fused kernel, the fastest of benchmarks/quant_kernels.py
#: --sweep's candidates on the H100 (us summed over the four layers, at M = 1 and 16 for the first
#: bucket). BLOCK_K 64 beat 128 wherever both were tried.
#: The last two buckets serve only callers that raise ``dequant_min_m``.
INT4_CONFIGS: dict[int, GemmConfig] = {
    16: GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4),  # 285 us (16x64x128: 324)
    32: GemmConfig(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4),  # 159 us
    64: GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),  # 189 us
    128: GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),  # 278 us
    256: GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
    1 << 30: GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
}


@triton.jit
def unpack_int4_tile(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 [ROWS, COLS] -> float32 [ROWS * 8, COLS]: row 8r + j is bits 4j..4j+3 of row r."""
    shifts = tl.arange(0, 8) * 4
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [ROWS, 8, COLS]
    # NOTE: 0x4B000000 is 2**23 as float32; OR-ing a 4-bit integer into its mantissa and subtracting
    # 2**23 converts it exactly with one integer op and one add, where an int-to-float conversion
    # runs at a quarter of the FP32 rate (the dequantization competes with the loads at decode)
    q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return tl.reshape(q, [ROWS * 8, COLS])


@triton.jit(do_not_specialize=["M"])
def w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group_size, k_split,
                 stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
                 stride_om, stride_on, stride_os,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """out[split][M, N] = x[M, K slice] @ w[K slice, N] (``split_tile``'s grid)."""
    offs_m, offs_n, m_mask, n_mask, k_start, k_end = split_tile(M, N, K, k_split, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qw_ptr + offs_r[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                         mask=(offs_r[:, None] < K // 8) & n_mask[None, :], other=0)
        # NOTE: a K block never straddles two groups (the launcher makes BLOCK_K divide the group
        # size, or there is one group), so one row of scales and zeros serves the whole block
        g = k0 // group_size
        s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=n_mask, other=0.0).to(tl.float32)
        w = (unpack_int4_tile(packed, BLOCK_K // 8, BLOCK_N) - z[None, :]) * s[None, :]
        acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc, input_precision=DOT_PRECISION)
    store_split_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_om, stride_on, stride_os)


@triton.jit
def dequant_int4_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size,
                        stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_ok, stride_on,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """w[K, N] from the packed layout; a program: BLOCK_R packed rows (8 * BLOCK_R rows of w) x BLOCK_N."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    packed = tl.load(qw_ptr + offs_r[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                     mask=(offs_r[:, None] < K // 8) & n_mask[None, :], other=0)
    q = unpack_int4_tile(packed, BLOCK_R, BLOCK_N)  # [8 * BLOCK_R, BLOCK_N]
    offs_k = tl.program_id(0) * BLOCK_R * 8 + tl.arange(0, BLOCK_R * 8)
    mask = (offs_k[:, None] < K) & n_mask[None, :]
    g = (offs_k // group_size)[:, None]
    s = tl.load(s_ptr + g * stride_sg + offs_n[None, :] * stride_sn, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_zg + offs_n[None, :] * stride_zn, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + offs_k.to(tl.int64)[:, None] * stride_ok + offs_n[None, :] * stride_on
    tl.store(out, ((q - z) * s).to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers --------------------------------------------------------------------------------------------

def _block_k(config_block_k: int, group_size: int, k: int) -> int:
    """The config's BLOCK_K, halved until it divides the group size (one group: as it is)."""
    block_k = config_block_k
    while group_size != k and group_size % block_k:
        block_k //= 2
    return block_k


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [K, N]`` in the scales' dtype (operands checked by the caller): the float32 arithmetic of the
    torch reference, so the same bits."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty((k, n), dtype=scales.dtype, device=qweight.device)  # [K, N]
    block_r, block_n = 8, 128  # a program writes 64 x 128 weights (16 KB in bf16) from 4 KB packed
    grid = (triton.cdiv(k // 8, block_r), triton.cdiv(n, block_n))
    launcher(dequant_int4_kernel, grid)(
        qweight, scales, zeros, w, n, k, group_size, *qweight.stride(), *scales.stride(), *zeros.stride(),
        *w.stride(), BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return w


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               config: GemmConfig | None = None) -> torch.Tensor:
    """``x [M, K] @ w [K, N]`` -> ``[M, N]`` in x's dtype by the fused kernel (operands checked by the
    caller). ``config`` overrides INT4_CONFIGS' entry. No host synchronisation."""
    (m, k), n = x.shape, qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or pick_config(INT4_CONFIGS, m)
    block_k = _block_k(cfg.block_k, group_size, k)
    launch = SplitK.plan(out, k, cfg, block_k, PROGRAMS_PER_SM)
    launcher(w4a16_kernel, launch.grid)(
        x, qweight, scales, zeros, launch.dest, m, n, k, group_size, launch.k_split,
        *x.stride(), *qweight.stride(), *scales.stride(), *zeros.stride(), *launch.dest_strides,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (tf32 has 10 bits)
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return launch.finish()
