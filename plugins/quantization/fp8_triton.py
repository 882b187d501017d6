"""FP8 (e4m3) activation quantization and a scaled FP8 GEMM in Triton, to measure against the
``fp8`` method's torch ops (``quantize_rows``, about eight elementwise kernels a call, and
``torch._scaled_mm``).

- ``quantize_per_token_fp8``: one kernel, one program a row; bit-identical to ``fp8.quantize_rows``
  on CUDA (the same float32 operations: abs-max, times the float32 reciprocal of 448 (torch's
  division by a Python number on CUDA; on the CPU torch divides), clamp, an IEEE division of the
  row by its scale, round to nearest even).
- ``quantize_static_fp8``: a checkpoint's static per-tensor ``input_scale``.
- ``fp8_gemm``: row-wise activation scales times per-output-channel weight scales, applied to the
  fp32 accumulator; split-K at decode sizes as in ``int4_triton`` (``triton_gemm``).

Measured (H100, Llama-3-8B layers, quantization included; benchmarks/results/2026-11-24-h100-quant-kernels):
the fused quantization saves 11-25 us a layer over ``quantize_rows`` at decode; with it, ``fp8_gemm``
is 1.0-1.8x faster than bf16 at M <= 64 and faster than ``torch._scaled_mm`` there (gate_up, M = 16:
50 us against 56), but from M = 128 on ``torch._scaled_mm`` wins, by 1.35-2.7x at M >= 512 (this
kernel reaches 60-75% of cuBLAS's FP8 throughput at M >= 2048).

NOTE: Triton's CPU interpreter (3.9) rounds float32 to float8 wrongly (the carry out of the mantissa
is dropped, so 0.0306 becomes 0.0156; ties go up, not to even; subnormals are lost), so the CPU
tests read the quantize kernels' values before that last rounding, through a float32 ``out``; the
e4m3 results are checked bit for bit on the GPU (tests/gpu/test_quant_kernels_gpu.py). The FP8 GEMM
reads e4m3 made by torch, which the interpreter widens correctly, so it is tested on both.
"""
from __future__ import annotations

import torch

from kvforge.plugins.quantization.fp8 import FP8, FP8_MAX, MIN_SCALE, quantize_rows
from kvforge.plugins.quantization.triton_gemm import GemmConfig, SplitK, kernels, pick_config, uses_triton

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
#: torch on CUDA divides by a Python number as a multiplication by its float32 reciprocal
INV_FP8_MAX = float(torch.tensor(1.0) / FP8_MAX)
#: elements of a row each quantize program loads at once (16 KB of fp32 in flight, 16 per thread)
QUANT_BLOCK = 4096

_OUT_DTYPES = (FP8, torch.float32)


def _check_rows(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` (e4m3 or float32, x's shape, rows contiguous) or a new e4m3 tensor."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be [M, K] in float16/bfloat16/float32, got {x.dtype} {list(x.shape)}")
    if out is None:
        return torch.empty(x.shape, dtype=FP8, device=x.device)
    if out.shape != x.shape or out.dtype not in _OUT_DTYPES or out.stride(-1) != 1:
        raise ValueError(f"out must be {list(x.shape)} in float8_e4m3fn or float32 with rows contiguous, "
                         f"got {out.dtype} {list(out.shape)}")
    return out


def quantize_per_token_fp8(x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``q [M, K]`` e4m3, ``scale [M, 1]`` float32), ``x ~= q * scale``, one fused kernel.

    ``out``: where q goes (a static buffer under CUDA graphs); a float32 ``out`` receives the values
    before they are rounded to e4m3 (what the CPU tests read, see the module note). NaN in a row
    is not propagated as ``quantize_rows`` does (the GPU's max ignores NaN).
    """
    q = _check_rows(x, out)
    if not uses_triton(x):
        _, scale = quantize_rows(x)
        return q.copy_((x.float() / scale).clamp(-FP8_MAX, FP8_MAX)), scale  # copy_ rounds as .to(FP8)
    if x.stride(-1) != 1:
        x = x.contiguous()
    triton, kern = kernels()
    m, k = x.shape
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(QUANT_BLOCK, triton.next_power_of_2(max(k, 1)))
        kern.quantize_per_token_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                                 INV_FP8_MAX=INV_FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block,
                                                 num_warps=max(1, min(8, block // 512)))
    return q, scale


def quantize_static_fp8(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` -> e4m3 ``clamp(x / scale)`` with a checkpoint's static scale (a one-element
    float32 tensor on x's device, read on the device: no host synchronisation). ``out`` as for
    :func:`quantize_per_token_fp8`."""
    q = _check_rows(x, out)
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"scale must be one float32 value, got {scale.dtype} {list(scale.shape)}")
    if not uses_triton(x):
        return q.copy_((x.float() / scale.reshape(())).clamp(-FP8_MAX, FP8_MAX))
    if x.stride(-1) != 1:
        x = x.contiguous()
    triton, kern = kernels()
    m, k = x.shape
    if m and k:
        block = min(1024, triton.next_power_of_2(k))
        kern.quantize_static_fp8_kernel[(m, triton.cdiv(k, block))](x, scale, q, k, x.stride(0), q.stride(0),
                                                                    FP8_MAX=FP8_MAX, BLOCK=block, num_warps=4)
    return q


def fp8_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`fp8_gemm` in float32 torch: the exact products, summed, then scaled."""
    return ((xq.float() @ wq.float().t()) * x_scale * w_scale.t()).to(out_dtype)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, *, config: GemmConfig | None = None) -> torch.Tensor:
    """``(xq [M, K] @ wq [N, K]^T) * x_scale [M, 1] * w_scale [N, 1]^T`` -> ``[M, N]`` in ``out_dtype``.

    Operands e4m3, scales float32, accumulation float32 with the scales applied to the accumulator
    (as ``torch._scaled_mm`` with row-wise scales). ``config`` overrides FP8_CONFIGS' entry.
    Graph-capturable after a first eager call of the same shape.
    """
    if xq.dim() != 2 or wq.dim() != 2 or xq.dtype != FP8 or wq.dtype != FP8 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"xq [M, K] and wq [N, K] must be float8_e4m3fn with the same K, "
                         f"got {xq.dtype} {list(xq.shape)} and {wq.dtype} {list(wq.shape)}")
    (m, k), n = xq.shape, wq.shape[0]
    for name, s, rows in (("x_scale", x_scale, m), ("w_scale", w_scale, n)):
        if tuple(s.shape) != (rows, 1) or s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [{rows}, 1], got {s.dtype} {list(s.shape)}")
    if not uses_triton(xq):
        return fp8_gemm_reference(xq, x_scale, wq, w_scale, out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    _, kern = kernels()
    cfg = config or pick_config(FP8_CONFIGS, m)
    launch = SplitK.plan(out, k, cfg, cfg.block_k, PROGRAMS_PER_SM)
    kern.fp8_gemm_kernel[launch.grid](
        xq, x_scale, wq, w_scale, launch.dest, m, n, k, launch.k_split,
        *xq.stride(), x_scale.stride(0), *wq.stride(), w_scale.stride(0), *launch.dest_strides,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return launch.finish()
