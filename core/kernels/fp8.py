"""FP8 (e4m3) activation quantization and a scaled FP8 GEMM in Triton, and their launchers.
``kvforge.plugins.quantization.fp8`` checks the operands, holds the torch references and picks the path
(docs/quantization.md has the measurements).

- ``quantize_per_token``: one kernel, one program a row; bit-identical to ``fp8.quantize_rows`` on CUDA
  (the same float32 operations: abs-max, times the float32 reciprocal of 448 (torch's division by a
  Python number on CUDA; on the CPU torch divides), clamp, an IEEE division of the row by its scale,
  round to nearest even).
- ``quantize_static``: a checkpoint's static per-tensor ``input_scale``.
- ``fp8_gemm``: row-wise activation scales times per-output-channel weight scales, applied to the fp32
  accumulator; split-K at decode sizes as the W4A16 GEMM (``quant_gemm``).

NOTE: Triton's CPU interpreter (3.9) rounds float32 to float8 wrongly (the carry out of the mantissa
is dropped, so 0.0306 becomes 0.0156; ties go up, not to even; subnormals are lost), so the CPU
tests read the quantize kernels' values before that last rounding, through a float32 ``out``; the
e4m3 results are checked bit for bit on the GPU (tests/gpu/test_quant_kernels_gpu.py). The FP8 GEMM
reads e4m3 made by torch, which the interpreter widens correctly, so it is tested on both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import launcher
from kvforge.kernels.quant_gemm import GemmConfig, SplitK, pick_config, split_tile, store_split_tile

#: M bucket (largest M) -> block sizes, the fastest of benchmarks/quant_kernels.py --sweep's candidates
#: on the H100 (us summed over the four Llama-3-8B layers; at M = 1 and 16 for the first bucket).
#: BLOCK_K is 128 throughout: the fp32 promotion interval of the FP8 accumulation (fp8_gemm_kernel).
#: Decode prefers narrow 32-column tiles: more programs stream the weights at once.
FP8_CONFIGS: dict[int, GemmConfig] = {
    16: GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4),  # 232 us (16x64: 241)
    32: GemmConfig(block_m=32, block_n=32, block_k=128, num_warps=4, num_stages=4),  # 123 us
    64: GemmConfig(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=4),  # 127 us
    128: GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4),  # 162 us
    256: GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4),  # 228 us
    1 << 30: GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),  # 1094 us at M = 2048
}
#: split K until 2 programs per SM: at M = 1 this picks the fastest of splits 1..16 on each of the four
#: layers (benchmarks/quant_kernels.py --sweep, H100); 4 a SM would be 8% slower on o
PROGRAMS_PER_SM = 2
#: elements of a row each quantize program loads at once (16 KB of fp32 in flight, 16 per thread)
QUANT_BLOCK = 4096


@triton.jit
def _saturate_div(x, scale, FP8_MAX: tl.constexpr):
    """``clamp(x / scale, -FP8_MAX, FP8_MAX)`` with an IEEE division (div_rn; Triton's ``/`` is an
    approximation within 2 ulp), as torch divides one tensor by another."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)


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
    # another with an IEEE division
    scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + offs, _saturate_div(x, scale, FP8_MAX).to(q_ptr.dtype.element_ty),
                 mask=mask)


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
    tl.store(q_ptr + row * stride_qm + offs, _saturate_div(x, scale, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def fp8_gemm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, M, N, K, k_split,
                    stride_am, stride_ak, stride_as, stride_bn, stride_bk, stride_bs,
                    stride_om, stride_on, stride_os,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[split][M, N] = (a[M, K slice] @ b[N, K slice]^T) * a_scale[M] * b_scale[N], fp32 accumulation
    (``split_tile``'s grid)."""
    offs_m, offs_n, m_mask, n_mask, k_start, k_end = split_tile(M, N, K, k_split, BLOCK_M, BLOCK_N)
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
    store_split_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_om, stride_on, stride_os)


# ---- launchers --------------------------------------------------------------------------------------------

def quantize_per_token(x: torch.Tensor, q: torch.Tensor, *, fp8_max: float, inv_fp8_max: float,
                       min_scale: float) -> torch.Tensor:
    """Each row of ``x [M, K]`` (contiguous rows) quantized into ``q``; returns the scales ``[M, 1]``
    float32. ``inv_fp8_max``: the float32 reciprocal of ``fp8_max``, as torch on CUDA multiplies by it."""
    m, k = x.shape
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(QUANT_BLOCK, triton.next_power_of_2(max(k, 1)))
        launcher(quantize_per_token_fp8_kernel, (m,))(x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=fp8_max,
                                            INV_FP8_MAX=inv_fp8_max, MIN_SCALE=min_scale, BLOCK=block,
                                            num_warps=max(1, min(8, block // 512)))
    return scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor, *, fp8_max: float) -> torch.Tensor:
    """``x [M, K]`` (contiguous rows) quantized into ``q`` under one float32 scale read on the device."""
    m, k = x.shape
    if m and k:
        block = min(1024, triton.next_power_of_2(k))
        launcher(quantize_static_fp8_kernel, (m, triton.cdiv(k, block)))(x, scale, q, k, x.stride(0), q.stride(0),
                                                               FP8_MAX=fp8_max, BLOCK=block, num_warps=4)
    return q


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, config: GemmConfig | None = None) -> torch.Tensor:
    """``(xq [M, K] @ wq [N, K]^T) * x_scale [M, 1] * w_scale [N, 1]^T`` -> ``[M, N]`` in ``out_dtype``
    (operands checked by the caller). ``config`` overrides FP8_CONFIGS' entry."""
    (m, k), n = xq.shape, wq.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = config or pick_config(FP8_CONFIGS, m)
    launch = SplitK.plan(out, k, cfg, cfg.block_k, PROGRAMS_PER_SM)
    launcher(fp8_gemm_kernel, launch.grid)(
        xq, x_scale, wq, w_scale, launch.dest, m, n, k, launch.k_split,
        *xq.stride(), x_scale.stride(0), *wq.stride(), w_scale.stride(0), *launch.dest_strides,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return launch.finish()
