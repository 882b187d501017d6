"""Triton kernels of the quantized linear layers; the launchers (``int4_triton``, ``fp8_triton``,
``triton_gemm``) import this module on first use, so triton stays an optional dependency.

NOTE: every ``@triton.jit`` function lives at module level: Triton's CPU interpreter
(TRITON_INTERPRET=1, the tests) re-executes a kernel's source in its module globals, so a helper
kernel held in a closure would not be found.

The GEMMs do not specialise on M (Triton would compile apart for M == 1 and M % 16 == 0; M only
masks rows), so one compilation serves every batch size of a bucket.

Addresses along M (and along K of a dequantized weight) are int64: an 8192-token prefill through a
28672-wide layer has 2**28 outputs, and a larger batch would overflow int32 offsets.
"""
from __future__ import annotations

import triton
import triton.language as tl

# ---- W4A16 ------------------------------------------------------------------------------------------

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
    """out[split][M, N] = x[M, K slice] @ w[K slice, N]. Grid: (M tiles, N tiles, K splits), M fastest,
    so the programs that run together share a weight tile; each split covers ``k_split`` of K."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_start = pid_s * k_split
    k_end = tl.minimum(k_start + k_split, K)
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
    out = out_ptr + pid_s.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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


# ---- FP8 --------------------------------------------------------------------------------------------

@triton.jit
def quantize_per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm,
                                  FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                                  BLOCK: tl.constexpr):
    """One row: scale = max(amax * INV_FP8_MAX, MIN_SCALE), q = clamp(x / scale) in q's dtype. Two
    passes over the row (the second read comes from L2), so any K fits in registers."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # NOTE: the arithmetic of fp8.quantize_rows on CUDA, operation for operation: torch divides a
    # tensor by a Python number as a multiplication by its float32 reciprocal, and one tensor by
    # another with an IEEE division (div_rn; Triton's `/` is an approximation within 2 ulp)
    scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_static_fp8_kernel(x_ptr, scale_ptr, q_ptr, K, stride_xm, stride_qm,
                               FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """q = clamp(x / scale) in q's dtype, one scale for the tensor (an IEEE division, as torch's
    division by a one-element tensor). Grid: (rows, K blocks)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def fp8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, M, N, K, k_split,
                    stride_am, stride_ak, stride_as, stride_bn, stride_bk, stride_bs,
                    stride_om, stride_on, stride_os,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[split][M, N] = (a[M, K slice] @ b[N, K slice]^T) * a_scale[M] * b_scale[N], fp32 accumulation.
    Grid as w4a16_kernel's."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_start = pid_s * k_split
    k_end = tl.minimum(k_start + k_split, K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + offs_k[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        # NOTE: Hopper's FP8 tensor cores accumulate with ~14 bits of mantissa (DeepSeek-V3, section
        # 3.3.2); promoting the sum into the fp32 accumulator once per BLOCK_K (128 in every config,
        # DeepSeek's interval) keeps the accuracy of torch._scaled_mm without fast accumulation
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    a_scale = tl.load(a_scale_ptr + offs_m * stride_as, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_mask, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    out = out_ptr + pid_s.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ---- split-K ----------------------------------------------------------------------------------------

@triton.jit
def sum_splits_kernel(part_ptr, out_ptr, numel, num_splits, BLOCK: tl.constexpr):
    """out[M, N] = part[split, M, N].sum(0) in out's dtype; both contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    part = part_ptr + offs
    for _ in range(num_splits):
        acc += tl.load(part, mask=mask, other=0.0)
        part += numel
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
