"""``fp8``: FP8 e4m3 weights with a scale per output channel, activations quantized per token at run
time (dynamic) or with a checkpoint's static per-tensor scale, as vLLM's ``--quantization fp8`` does.

Two sources of weights: a bf16/fp16/fp32 checkpoint, quantized once loaded; or a checkpoint whose
``config.json`` says ``"quant_method": "fp8"`` (FP8 ``weight`` with a per-tensor or per-channel
``weight_scale``, and ``input_scale`` when ``activation_scheme`` is ``static``). compressed-tensors'
float-quantized FP8 loads through the same layer method (``compressed_tensors.py``). A per-tensor
scale is spread over its rows: a fused QKV layer whose parts have different scales stays exact.

The GEMM (docs/quantization.md has the measurements): on CUDA devices with FP8 tensor cores
(compute capability 8.9 or more) activations are quantized by one fused Triton kernel and multiplied
by kvforge's Triton FP8 GEMM (decode-sized batches) or ``torch._scaled_mm`` (row-wise scales;
larger ones), as option ``gemm`` says (``auto``: by the token count).
Elsewhere (the CPU, older GPUs) it is the reference: the same quantized operands dequantized to
float32 and multiplied, so the CPU tests see exactly the rounding the GPU kernels see.

The Triton kernels (``kvforge.kernels.fp8``) run behind :func:`quantize_per_token_fp8`,
:func:`quantize_static_fp8` and :func:`fp8_gemm`, which check their operands and fall back to torch
references where the kernels cannot run (the CPU outside TRITON_INTERPRET=1, or no triton).
Measured (H100, Llama-3-8B layers, quantization included; benchmarks/results/2026-11-24-h100-quant-kernels):
the fused quantization saves 11-25 us a layer over ``quantize_rows`` at decode; with it, the Triton
``fp8_gemm`` is 1.0-1.8x faster than bf16 at M <= 64 and faster than ``torch._scaled_mm`` there (gate_up,
M = 16: 50 us against 56), but from M = 128 on ``torch._scaled_mm`` wins, by 1.35-2.7x at M >= 512 (the
kernel reaches 60-75% of cuBLAS's FP8 throughput at M >= 2048).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvforge.kernels import runs_on
from kvforge.layers.linear import ColumnParallelLinear, LinearBase
from kvforge.layers.weights import ShardId, WeightLoader
from kvforge.model.quantization import LinearMethod, MoEMethod, QuantizationMethod, ignored
from kvforge.plugins.quantization.linear_layer import keep_when_random, linear_layer

if TYPE_CHECKING:
    from kvforge.kernels.quant_gemm import GemmConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
#: smallest scale: an all-zero row or token keeps a finite scale
MIN_SCALE = 1e-12
GEMMS = ("auto", "scaled_mm", "triton")
#: ``auto``: the Triton FP8 GEMM up to this many tokens, ``torch._scaled_mm`` above (H100, fused
#: quantization included, the four Llama-3-8B layers: 118 vs 151 us at 1 token, 127 vs 138 at 64,
#: 161 vs 140 at 128; benchmarks/results/2026-11-24-h100-quant-kernels)
TRITON_MAX_TOKENS = 64


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, cols]`` -> (FP8 values, float32 scale per row [rows, 1]), ``x ~= values * scale``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` with one given float32 scale (a checkpoint's ``input_scale``) -> FP8 values."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def _fp8_tensor_cores(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# ---- the Triton kernels, with their references ----------------------------------------------------------

#: torch on CUDA divides by a Python number as a multiplication by its float32 reciprocal
INV_FP8_MAX = float(torch.tensor(1.0) / FP8_MAX)
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
    before they are rounded to e4m3 (what the CPU tests read: kvforge.kernels.fp8 says why). NaN in a
    row is not propagated as ``quantize_rows`` does (the GPU's max ignores NaN).
    """
    q = _check_rows(x, out)
    if not runs_on(x):
        _, scale = quantize_rows(x)
        return q.copy_((x.float() / scale).clamp(-FP8_MAX, FP8_MAX)), scale  # copy_ rounds as .to(FP8)
    if x.stride(-1) != 1:
        x = x.contiguous()
    from kvforge.kernels import fp8

    return q, fp8.quantize_per_token(x, q, fp8_max=FP8_MAX, inv_fp8_max=INV_FP8_MAX, min_scale=MIN_SCALE)


def quantize_static_fp8(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` -> e4m3 ``clamp(x / scale)`` with a checkpoint's static scale (a one-element
    float32 tensor on x's device, read on the device: no host synchronisation). ``out`` as for
    :func:`quantize_per_token_fp8`."""
    q = _check_rows(x, out)
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"scale must be one float32 value, got {scale.dtype} {list(scale.shape)}")
    if not runs_on(x):
        return q.copy_((x.float() / scale.reshape(())).clamp(-FP8_MAX, FP8_MAX))
    if x.stride(-1) != 1:
        x = x.contiguous()
    from kvforge.kernels import fp8

    return fp8.quantize_static(x, scale, q, fp8_max=FP8_MAX)


def fp8_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`fp8_gemm` in float32 torch: the exact products, summed, then scaled."""
    return ((xq.float() @ wq.float().t()) * x_scale * w_scale.t()).to(out_dtype)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, *, config: GemmConfig | None = None) -> torch.Tensor:
    """``(xq [M, K] @ wq [N, K]^T) * x_scale [M, 1] * w_scale [N, 1]^T`` -> ``[M, N]`` in ``out_dtype``.

    Operands e4m3, scales float32, accumulation float32 with the scales applied to the accumulator
    (as ``torch._scaled_mm`` with row-wise scales). ``config`` overrides ``kvforge.kernels.fp8.FP8_CONFIGS``'
    entry. Graph-capturable after a first eager call of the same shape.
    """
    if xq.dim() != 2 or wq.dim() != 2 or xq.dtype != FP8 or wq.dtype != FP8 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"xq [M, K] and wq [N, K] must be float8_e4m3fn with the same K, "
                         f"got {xq.dtype} {list(xq.shape)} and {wq.dtype} {list(wq.shape)}")
    for name, s, rows in (("x_scale", x_scale, xq.shape[0]), ("w_scale", w_scale, wq.shape[0])):
        if tuple(s.shape) != (rows, 1) or s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [{rows}, 1], got {s.dtype} {list(s.shape)}")
    if not runs_on(xq):
        return fp8_gemm_reference(xq, x_scale, wq, w_scale, out_dtype)
    from kvforge.kernels import fp8

    return fp8.fp8_gemm(xq, x_scale, wq, w_scale, out_dtype, config)


@dataclass
class Fp8Weights:
    """One layer's FP8 operands (its parameters), as :meth:`Fp8LinearMethod.process_weights_after_loading`
    leaves them."""

    weight: torch.Tensor  # [out, in] e4m3
    weight_scale: torch.Tensor  # [out, 1] float32
    weight_scale_t: torch.Tensor  # [1, out], a view: torch._scaled_mm's scale_b
    input_scale: torch.Tensor | None  # [1] float32 with static activation scales
    reference: torch.Tensor | None = None  # [in, out] float32, the CPU path's dequantized weight (made once)


class Fp8LinearMethod(LinearMethod):
    """FP8 weights ``[out, in]`` with ``weight_scale [out, 1]``; ``input_scale`` (a scalar) when static."""

    def __init__(self, gemm: str = "auto", checkpoint: bool = False, static: bool = False):
        self.gemm, self.checkpoint, self.static = gemm, checkpoint, static
        self.fast: bool | None = None  # FP8 tensor cores: decided on the first call, on the layer's device
        self.weights: Fp8Weights | None = None  # once loaded

    def create_weights(self, layer: nn.Module) -> None:
        linear = linear_layer(layer)
        if not self.checkpoint:  # quantized once loaded from the full-precision weight
            linear.materialize_weight()
            return
        layer.weight = linear.make_param((("out", 1), ("in", 1)), FP8)
        layer.weight_scale = linear.make_param((("out", 1), 1), torch.float32, loader=self._scale_loader(linear))
        if self.static:
            input_scale = layer.input_scale = linear.make_param((1,), torch.float32, loader=_max_loader)
            input_scale.data.zero_()
            keep_when_random(input_scale)  # dummy weights: a scale of 1.0 (set once loaded)

    @staticmethod
    def _scale_loader(layer: LinearBase) -> WeightLoader:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            """A per-tensor scale (one value) fills its part's rows; a per-channel one is one per row."""
            loaded = loaded.float()
            if loaded.numel() == 1:
                rows = layer.part_rows(shard_id) if isinstance(layer, ColumnParallelLinear) else layer.output_size
                loaded = loaded.reshape(1, 1).expand(rows, 1)
            layer.weight_loader(param, loaded.reshape(-1, 1).contiguous(), shard_id)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.checkpoint:
            q, scale = quantize_rows(layer.get_parameter("weight").data)
            layer.weight = nn.Parameter(q, requires_grad=False)  # the full-precision copy is freed
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out, 1]
        input_scale = layer.get_parameter("input_scale") if self.static else None
        if input_scale is not None and input_scale.item() == 0:  # never loaded: dummy weights
            input_scale.data.fill_(1.0)
        weight_scale = layer.get_parameter("weight_scale")
        self.weights = Fp8Weights(layer.get_parameter("weight"), weight_scale, weight_scale.data.t(), input_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        if w is None:
            raise RuntimeError("fp8: the layer ran before its weights were loaded (process_weights_after_loading)")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fast is None:
            self.fast = _fp8_tensor_cores(x.device) and x.dtype in (torch.bfloat16, torch.float16)
        if self.fast:
            y = self._gpu(w, x2)
        else:
            if w.input_scale is not None:
                xq, xs = quantize_static(x2, w.input_scale), w.input_scale.view(1, 1)
            else:
                xq, xs = quantize_rows(x2)
            ref = w.reference
            if ref is None:
                ref = dequantize_rows(w.weight, w.weight_scale).t()
                if x.device.type == "cpu":  # kept: the CPU path is for correctness, not memory
                    w.reference = ref
            y = (dequantize_rows(xq, xs) @ ref).to(x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _gpu(self, w: Fp8Weights, x: torch.Tensor) -> torch.Tensor:
        if w.input_scale is not None:
            xq = quantize_static_fp8(x, w.input_scale)
            xs = w.input_scale.view(1, 1).expand(x.shape[0], 1).contiguous()
        else:
            xq, xs = quantize_per_token_fp8(x)
        if self.gemm == "triton" or (self.gemm == "auto" and x.shape[0] <= TRITON_MAX_TOKENS):
            return fp8_gemm(xq, xs, w.weight, w.weight_scale, x.dtype)
        scaled_mm = torch._scaled_mm  # pyright: ignore[reportPrivateImportUsage] (not in torch's stub exports)
        return scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.weight_scale_t, out_dtype=x.dtype)


def _max_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """A static activation scale: the fused parts of one layer share the largest of theirs."""
    if loaded.numel() != 1:
        raise ValueError(f"input_scale has shape {tuple(loaded.shape)}; only a per-tensor scale is supported")
    value = float(loaded.reshape(-1)[0])
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"input_scale is {value}; it must be a finite number > 0")
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1)))


@dataclass
class Fp8Options:
    gemm: str = "auto"  # "scaled_mm" (torch._scaled_mm), "triton" (kvforge's kernel), "auto" (by token count)


class Fp8Quantization(QuantizationMethod):
    """Every linear layer of the decoder in FP8 (embeddings and the LM head stay in the model dtype)."""

    name = "fp8"
    checkpoint_formats = ("fp8",)
    Options = Fp8Options

    def __init__(self, *, engine_config=None, model_config=None, gemm: str = "auto"):
        super().__init__(engine_config=engine_config, model_config=model_config)
        if gemm not in GEMMS:
            raise ValueError(f"fp8 option 'gemm' is {gemm!r}; choose one of {', '.join(GEMMS)}")
        self.gemm = gemm
        qc = self.checkpoint_config or {}
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config field 'weight_block_size' is {block!r}; expected two positive "
                             "integers, [rows, columns] (e.g. [128, 128])")
        self.block = (block[0], block[1]) if block else None
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config field 'activation_scheme' is {scheme!r}; "
                             "supported: dynamic, static")
        self.static = scheme == "static"
        self.skip_field = "ignored_layers" if qc.get("ignored_layers") else "modules_to_not_convert"
        self.skip = qc.get(self.skip_field)

    def linear_method(self, layer: nn.Module, names: list[str]) -> LinearMethod | None:
        checkpoint = self.checkpoint_config is not None
        if checkpoint and ignored(names, self.skip, self.skip_field, exact=self.skip_field == "ignored_layers"):
            return None
        if self.block is not None:
            from kvforge.plugins.quantization.fp8_moe import Fp8BlockLinearMethod

            return Fp8BlockLinearMethod(self.block)
        return Fp8LinearMethod(self.gemm, checkpoint=checkpoint, static=self.static)

    def moe_method(self, layer: nn.Module) -> MoEMethod | None:
        """FP8 experts (``kvforge.plugins.quantization.fp8_moe``): quantized on load, or a checkpoint's
        block or per-tensor scales; weight-only (static activation scales are refused)."""
        from kvforge.plugins.quantization.fp8_moe import Fp8MoEMethod

        if self.checkpoint_config is None:
            return Fp8MoEMethod("on_load")
        if self.static:
            raise ValueError("quantization_config field 'activation_scheme' is 'static': static activation "
                             "scales are not supported for mixture-of-experts layers; supported: dynamic")
        return Fp8MoEMethod("block", self.block) if self.block else Fp8MoEMethod("tensor")
