"""W4A16: a GEMM with 4-bit weights and 16-bit activations (Triton), and its torch reference.

The canonical layout (AWQ, GPTQ and compressed-tensors checkpoints are converted into it on load):

- ``qweight`` int32 ``[K // 8, N]``: bits ``4j .. 4j+3`` of ``qweight[r, n]`` hold ``q[8r + j, n]``,
  an unsigned 4-bit value 0..15 (GPTQ's sequential order along K);
- ``scales``, ``zeros`` ``[K // G, N]`` in the activation dtype; zeros are float zero points;
- ``w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``, computed in float32 and rounded
  once to the activation dtype. G (the group size) is 32, 64, 128 or K (one group: channel-wise).

``w4a16_gemm`` has two paths:

- M up to 128 (decode, small prefill chunks): one fused kernel that unpacks and dequantizes each
  weight tile in registers and multiplies it on the tensor cores with fp32 accumulation, split along
  K when the N tiles alone would leave SMs idle (``triton_gemm``).
- M from DEQUANT_MIN_M on (prefill): the weights are dequantized once into a ``[K, N]`` temporary by
  a Triton kernel and multiplied by ``torch.matmul`` (cuBLAS, compute-bound there); the fused kernel
  would dequantize every weight tile again for each tile of M.

NOTE (H100, Llama-3-8B layers, benchmarks/results/2026-11-24-h100-quant-kernels): at M <= 16 the
fused kernel streams 0.55-0.95 TB/s of 4-bit weights where bf16 ``F.linear`` streams 2.0-2.7 TB/s,
so it is only 1.0-1.35x faster than bf16 (with a quarter of the weight memory); at M = 64 it runs
at 0.85-1.0x bf16's speed, and slower beyond. It is bound by the dequantization arithmetic (about six integer and float32 operations per
weight), not by HBM: a variant without tensor cores (FMA only) reached no more than ~1 TB/s either.
Going faster needs two weights per instruction (bf16x2 arithmetic through inline PTX, as Marlin
does), which Triton's CPU interpreter cannot run.

On the CPU (outside TRITON_INTERPRET=1) both paths are the reference, ``x @ dequantize_int4(...)``.
"""
from __future__ import annotations

import torch

# the torch reference (and the CPU path): the layout's own dequantization, in float32
from kvforge.plugins.quantization.int4 import dequantize as dequantize_int4
from kvforge.plugins.quantization.triton_gemm import GemmConfig, SplitK, kernels, pick_config, uses_triton

#: from this many tokens on, dequantize + torch.matmul. Measured (H100, the four Llama-3-8B layers):
#: the fused kernel is faster at M = 128 on all four, dequantize + matmul at M = 256 on all four
DEQUANT_MIN_M = 129
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

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- launchers --------------------------------------------------------------------------------------

def _check(x: torch.Tensor | None, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group_size: int) -> tuple[int, int]:
    """(K, N) of a valid set of operands; ValueError naming the first thing that is not."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [K // 8, N], got {qweight.dtype} {list(qweight.shape)}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if group_size <= 0 or k % group_size or group_size % 8:
        raise ValueError(f"group_size must be a multiple of 8 that divides K = {k}, got {group_size}")
    if group_size != k and group_size % 16:
        raise ValueError(f"group_size must be a multiple of 16 (or K = {k}, one group), got {group_size}")
    want = (k // group_size, n)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != want or t.dtype not in _ACT_DTYPES:
            raise ValueError(f"{name} must be [K // group_size, N] = {list(want)} in float16/bfloat16/float32, "
                             f"got {t.dtype} {list(t.shape)}")
    if x is not None:
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [M, K] with K = {k} (8 x qweight's rows), got {list(x.shape)}")
        if x.dtype != scales.dtype or x.dtype != zeros.dtype:
            raise ValueError(f"x, scales and zeros must share a dtype, got {x.dtype}, {scales.dtype}, {zeros.dtype}")
    return k, n


def _block_k(config_block_k: int, group_size: int, k: int) -> int:
    """The config's BLOCK_K, halved until it divides the group size (one group: as it is)."""
    block_k = config_block_k
    while group_size != k and group_size % block_k:
        block_k //= 2
    return block_k


def dequantize_int4_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """:func:`dequantize_int4` as one Triton kernel: the same float32 arithmetic, so the same bits."""
    k, n = _check(None, qweight, scales, zeros, group_size)
    if not uses_triton(qweight):
        return dequantize_int4(qweight, scales, zeros, group_size)
    triton, kern = kernels()
    w = torch.empty((k, n), dtype=scales.dtype, device=qweight.device)  # [K, N]
    block_r, block_n = 8, 128  # a program writes 64 x 128 weights (16 KB in bf16) from 4 KB packed
    grid = (triton.cdiv(k // 8, block_r), triton.cdiv(n, block_n))
    kern.dequant_int4_kernel[grid](
        qweight, scales, zeros, w, n, k, group_size, *qweight.stride(), *scales.stride(), *zeros.stride(),
        *w.stride(), BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return w


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, *, config: GemmConfig | None = None,
               dequant_min_m: int = DEQUANT_MIN_M) -> torch.Tensor:
    """``x [M, K] @ w [K, N]`` -> ``[M, N]`` in ``x``'s dtype, accumulated in float32.

    ``scales``, ``zeros`` and ``x`` share a dtype (float16, bfloat16 or float32). ``config``
    overrides INT4_CONFIGS' entry (the benchmark's sweep); from ``dequant_min_m`` tokens on, the
    weights are dequantized and multiplied by ``torch.matmul``. No host synchronisation: safe to
    capture in a CUDA graph once its kernels have compiled (a first eager call of the same shape).
    """
    k, n = _check(x, qweight, scales, zeros, group_size)
    m = x.shape[0]
    if not uses_triton(x):
        return x @ dequantize_int4(qweight, scales, zeros, group_size)
    if m >= dequant_min_m:
        return x @ dequantize_int4_triton(qweight, scales, zeros, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _, kern = kernels()
    cfg = config or pick_config(INT4_CONFIGS, m)
    block_k = _block_k(cfg.block_k, group_size, k)
    launch = SplitK.plan(out, k, cfg, block_k, PROGRAMS_PER_SM)
    kern.w4a16_kernel[launch.grid](
        x, qweight, scales, zeros, launch.dest, m, n, k, group_size, launch.k_split,
        *x.stride(), *qweight.stride(), *scales.stride(), *zeros.stride(), *launch.dest_strides,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (tf32 has 10 bits)
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return launch.finish()
