"""INT4 weight-only linear layers (W4A16): one kernel layout that every INT4 format is converted to
once loaded, and ``int4``, weights quantized on load by round-to-nearest (docs/quantization.md).

The kernel layout (the W4A16 kernels: ``kvforge.kernels.int4``), for a layer ``y = x W^T`` with
``K`` inputs and ``N`` outputs, group size ``G``:

- ``qweight`` int32 ``[K / 8, N]``: bits ``4j..4j+3`` of ``qweight[r, n]`` hold ``q[8r + j, n]``, an
  unsigned 4-bit value (GPTQ's order, so one int32 load feeds eight consecutive inputs of a column);
- ``scales`` and ``zeros`` ``[K / G, N]`` in the activation dtype;
- ``w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``.

Formats differ only in how the checkpoint packs ``q`` and the zero points (AWQ packs eight outputs
per int32 in the order 0, 2, 4, 6, 1, 3, 5, 7; GPTQ packs eight inputs, and stores zero points minus
one; compressed-tensors stores signed values offset by 8). Each format's method unpacks its
tensors to ``(q, scales, zeros)`` and :meth:`Int4LinearMethod.finish` packs the kernel layout.

:func:`w4a16_gemm` has two Triton paths (docs/quantization.md has the measurements):

- M up to 128 (decode, small prefill chunks): one fused kernel that unpacks and dequantizes each
  weight tile in registers and multiplies it on the tensor cores with fp32 accumulation, split along
  K when the N tiles alone would leave SMs idle.
- M from DEQUANT_MIN_M on (prefill): the weights are dequantized once into a ``[K, N]`` temporary by
  a Triton kernel and multiplied by ``torch.matmul`` (cuBLAS, compute-bound there); the fused kernel
  would dequantize every weight tile again for each tile of M.

NOTE (H100, Llama-3-8B layers, benchmarks/results/2026-11-24-h100-quant-kernels): at M <= 16 the
fused kernel streams 0.55-0.95 TB/s of 4-bit weights where bf16 ``F.linear`` streams 2.0-2.7 TB/s,
so it is only 1.0-1.35x faster than bf16 (with a quarter of the weight memory); at M = 64 it runs
at 0.85-1.0x bf16's speed, and slower beyond. It is bound by the dequantization arithmetic (about six
integer and float32 operations per weight), not by HBM: a variant without tensor cores (FMA only)
reached no more than ~1 TB/s either. Going faster needs two weights per instruction (bf16x2 arithmetic
through inline PTX, as Marlin does), which Triton's CPU interpreter cannot run.

Where the kernels cannot run (the CPU outside TRITON_INTERPRET=1, or no triton) both paths are the
reference, ``x @ dequantize(...)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvforge.kernels import runs_on
from kvforge.model.quantization import LinearMethod, QuantizationMethod
from kvforge.plugins.quantization.linear_layer import linear_layer

if TYPE_CHECKING:
    from kvforge.kernels.quant_gemm import GemmConfig

#: AWQ's GEMM layout: nibble ``i`` of an int32 holds output column ``8c + AWQ_ORDER[i]``
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SEQUENTIAL = tuple(range(8))
#: group sizes the kernel tiles (besides one group over all inputs, channel-wise)
GROUP_SIZES = (32, 64, 128)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``q [R, C]`` (values 0..15) -> int32 ``[R / 8, C]``, nibble ``j`` of row ``r`` = ``q[8r + j]``."""
    q = q.to(torch.int32).reshape(q.shape[0] // 8, 8, q.shape[1])
    out = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32, device=q.device)
    for j in range(8):
        out |= q[:, j] << (4 * j)
    return out


def unpack_rows(p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_rows`: int32 ``[R / 8, C]`` -> int32 ``[R, C]`` of 0..15."""
    shifts = _SHIFTS.to(p.device).view(1, 8, 1)
    return ((p.unsqueeze(1) >> shifts) & 0xF).reshape(p.shape[0] * 8, p.shape[1])


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """``q [R, C]`` -> int32 ``[R, C / 8]``, nibble ``i`` of word ``c`` = ``q[:, 8c + order[i]]``."""
    q = q.to(torch.int32).reshape(q.shape[0], q.shape[1] // 8, 8)
    out = torch.zeros(q.shape[0], q.shape[1], dtype=torch.int32, device=q.device)
    for i, col in enumerate(order):
        out |= q[:, :, col] << (4 * i)
    return out


def unpack_cols(p: torch.Tensor, order: tuple[int, ...] = SEQUENTIAL) -> torch.Tensor:
    """The inverse of :func:`pack_cols`: int32 ``[R, C / 8]`` -> int32 ``[R, C]`` of 0..15."""
    nibbles = (p.unsqueeze(-1) >> _SHIFTS.to(p.device)) & 0xF  # [R, C/8, i]
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(p.shape[0], p.shape[1] * 8)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The kernel layout -> ``W^T [K, N]`` in the scales' dtype, computed in float32 (the reference the
    Triton kernels are held to: :func:`dequantize_int4_triton` gives the same bits)."""
    q = unpack_rows(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = zeros.float().repeat_interleave(group_size, dim=0)
    return ((q - z) * s).to(scales.dtype)


def quantize_rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric INT4 of ``w [N, K]`` per group of ``group_size`` inputs ->
    ``(q [K, N] int32 0..15, scales [K/G, N], zeros [K/G, N])``, float32, as AWQ's and GPTQ's zero-point
    formats store them (an exact zero stays exact: the zero point is an integer)."""
    n, k = w.shape
    g = w.float().t().reshape(k // group_size, group_size, n)
    lo = g.amin(dim=1).clamp(max=0)
    hi = g.amax(dim=1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (g / scales.unsqueeze(1)).round().add(zeros.unsqueeze(1)).clamp(0, 15)
    return q.reshape(k, n).to(torch.int32), scales, zeros


@dataclass
class Int4Weights:
    """One layer's kernel layout (its parameters ``qweight``, ``scales``, ``zeros``), as :meth:`finish` made it."""

    qweight: torch.Tensor  # [K / 8, N] int32
    scales: torch.Tensor  # [K / G, N] in the model dtype
    zeros: torch.Tensor  # [K / G, N] in the model dtype
    group_size: int  # G (K for one group)
    reference: torch.Tensor | None = None  # [K, N] float32, the CPU path's dequantized weight (made once)


class Int4LinearMethod(LinearMethod):
    """The kernel layout and its GEMM: the Triton W4A16 kernel on CUDA, dequantize-then-matmul elsewhere."""

    def __init__(self, group_size: int):
        self.group_size = group_size  # -1: one group over all of this rank's inputs
        self.weights: Int4Weights | None = None  # once loaded (finish)

    def finish(self, layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Install the kernel layout from ``q [K, N]`` (0..15), ``scales``/``zeros [K/G, N]``; drops every
        other parameter of the layer except the bias."""
        dtype = linear_layer(layer).params_dtype
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            delattr(layer, name)
        w = self.weights = Int4Weights(nn.Parameter(pack_rows(q), requires_grad=False),
                                       nn.Parameter(scales.to(dtype).contiguous(), requires_grad=False),
                                       nn.Parameter(zeros.to(dtype).contiguous(), requires_grad=False),
                                       q.shape[0] if self.group_size == -1 else self.group_size)
        layer.qweight, layer.scales, layer.zeros = w.qweight, w.scales, w.zeros

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        if w is None:
            raise RuntimeError("int4: the layer ran before its weights were loaded (process_weights_after_loading)")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x.is_cuda:
            y = w4a16_gemm(x2, w.qweight, w.scales, w.zeros, w.group_size)
        else:  # the reference: dequantized once (float32, kept: the CPU path is for correctness, not memory)
            if w.reference is None:
                w.reference = dequantize(w.qweight, w.scales.float(), w.zeros.float(), w.group_size)
            y = (x2.float() @ w.reference).to(x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


# ---- the Triton kernels, with their reference ----------------------------------------------------------

#: from this many tokens on, dequantize + torch.matmul. Measured (H100, the four Llama-3-8B layers):
#: the fused kernel is faster at M = 128 on all four, dequantize + matmul at M = 256 on all four
DEQUANT_MIN_M = 129
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def dequantize_int4_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """:func:`dequantize` as one Triton kernel: the same float32 arithmetic, so the same bits."""
    _check(None, qweight, scales, zeros, group_size)
    if not runs_on(qweight):
        return dequantize(qweight, scales, zeros, group_size)
    from kvforge.kernels import int4

    return int4.dequantize(qweight, scales, zeros, group_size)


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, *, config: GemmConfig | None = None,
               dequant_min_m: int = DEQUANT_MIN_M) -> torch.Tensor:
    """``x [M, K] @ w [K, N]`` -> ``[M, N]`` in ``x``'s dtype, accumulated in float32.

    ``scales``, ``zeros`` and ``x`` share a dtype (float16, bfloat16 or float32). ``config``
    overrides ``kvforge.kernels.int4.INT4_CONFIGS``' entry (the benchmark's sweep); from ``dequant_min_m``
    tokens on, the weights are dequantized and multiplied by ``torch.matmul``. No host synchronisation:
    safe to capture in a CUDA graph once its kernels have compiled (a first eager call of the same shape).
    """
    _check(x, qweight, scales, zeros, group_size)
    if not runs_on(x):
        return x @ dequantize(qweight, scales, zeros, group_size)
    if x.shape[0] >= dequant_min_m:
        return x @ dequantize_int4_triton(qweight, scales, zeros, group_size)
    from kvforge.kernels import int4

    return int4.w4a16_gemm(x, qweight, scales, zeros, group_size, config)


def check_group_size(field: str, group_size: int) -> None:
    if group_size != -1 and group_size not in GROUP_SIZES:
        raise ValueError(f"{field} is {group_size}; supported: {', '.join(map(str, GROUP_SIZES))} or -1 "
                         "(one group per output channel)")


class RtnInt4Linear(Int4LinearMethod):
    """A full-precision weight, quantized once loaded."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.get_parameter("weight").data
        group = w.shape[1] if self.group_size == -1 else self.group_size
        if w.shape[1] % group:
            raise ValueError(f"int4: a layer's {w.shape[1]} inputs (on this rank) do not split into groups of "
                             f"{group}; set the option group_size ([plugins.int4] in a config file) to one that "
                             "divides them, or -1")
        self.finish(layer, *quantize_rtn(w, group))


def group_dim(group_size: int) -> tuple[str, int] | int:
    """The input dimension of a per-group tensor: one row per ``group_size`` inputs, or with one
    group over all inputs (-1) a single row that every tensor-parallel rank keeps whole."""
    return 1 if group_size == -1 else ("in", group_size)


@dataclass
class Int4Options:
    group_size: int = 128  # inputs per scale: 32, 64, 128, or -1 (one per output channel)


class Int4Quantization(QuantizationMethod):
    """``int4``: weight-only INT4 quantized on load (round-to-nearest, asymmetric, ``group_size``
    inputs per scale; default 128). Faster than calibrated formats to produce, and less accurate: load
    an AWQ or GPTQ checkpoint for quality (docs/quantization.md)."""

    name = "int4"
    Options = Int4Options

    def __init__(self, *, engine_config=None, model_config=None, group_size: int = 128):
        super().__init__(engine_config=engine_config, model_config=model_config)
        check_group_size("int4 option 'group_size'", group_size)
        self.group_size = group_size

    def linear_method(self, layer: nn.Module, names: list[str]) -> LinearMethod:
        return RtnInt4Linear(self.group_size)
