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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvforge.model.quantization import LinearMethod, QuantizationMethod, ignored

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


class Fp8LinearMethod(LinearMethod):
    """FP8 weights ``[out, in]`` with ``weight_scale [out, 1]``; ``input_scale`` (a scalar) when static."""

    def __init__(self, gemm: str = "auto", checkpoint: bool = False, static: bool = False):
        self.gemm, self.checkpoint, self.static = gemm, checkpoint, static
        self.fast: bool | None = None  # FP8 tensor cores: decided on the first call, on the layer's device

    def create_weights(self, layer: nn.Module) -> None:
        if not self.checkpoint:  # quantized once loaded from the full-precision weight
            layer.materialize_weight()
            return
        layer.weight = layer.make_param((("out", 1), ("in", 1)), FP8)
        layer.weight_scale = layer.make_param((("out", 1), 1), torch.float32, loader=self._scale_loader(layer))
        if self.static:
            layer.input_scale = layer.make_param((1,), torch.float32, loader=_max_loader)
            layer.input_scale.data.zero_()
            layer.input_scale.random_fill = False  # dummy weights: a scale of 1.0 (set once loaded)

    @staticmethod
    def _scale_loader(layer: nn.Module) -> Any:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            """A per-tensor scale (one value) fills its part's rows; a per-channel one is one per row."""
            loaded = loaded.float()
            if loaded.numel() == 1:
                rows = layer.part_rows(shard_id) if hasattr(layer, "part_rows") else layer.output_size
                loaded = loaded.reshape(1, 1).expand(rows, 1)
            layer.weight_loader(param, loaded.reshape(-1, 1).contiguous(), shard_id)
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.checkpoint:
            q, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(q, requires_grad=False)  # the full-precision copy is freed
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out, 1]
        layer.weight_scale_t = layer.weight_scale.data.t()  # [1, out]: _scaled_mm's scale_b
        if self.static and layer.input_scale.item() == 0:  # never loaded: dummy weights
            layer.input_scale.data.fill_(1.0)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fast is None:
            self.fast = _fp8_tensor_cores(x.device) and x.dtype in (torch.bfloat16, torch.float16)
            if self.fast:  # imported once, here: the module imports triton (and this one)
                from kvforge.plugins.quantization import fp8_triton
                self.kernels = fp8_triton
        if self.fast:
            y = self._gpu(layer, x2)
        else:
            if self.static:
                xq, xs = quantize_static(x2, layer.input_scale), layer.input_scale.view(1, 1)
            else:
                xq, xs = quantize_rows(x2)
            w = getattr(layer, "reference_weight", None)
            if w is None:
                w = dequantize_rows(layer.weight, layer.weight_scale).t()
                if x.device.type == "cpu":  # kept: the CPU path is for correctness, not memory
                    layer.reference_weight = w
            y = (dequantize_rows(xq, xs) @ w).to(x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])

    def _gpu(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        fp8_triton = self.kernels

        if self.static:
            xq = fp8_triton.quantize_static_fp8(x, layer.input_scale)
            xs = layer.input_scale.view(1, 1).expand(x.shape[0], 1).contiguous()
        else:
            xq, xs = fp8_triton.quantize_per_token_fp8(x)
        if self.gemm == "triton" or (self.gemm == "auto" and x.shape[0] <= TRITON_MAX_TOKENS):
            return fp8_triton.fp8_gemm(xq, xs, layer.weight, layer.weight_scale, x.dtype)
        return torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale_t, out_dtype=x.dtype)


def _max_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
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
        if qc.get("weight_block_size"):
            raise ValueError(f"quantization_config field 'weight_block_size' is {qc['weight_block_size']}: "
                             "block-wise FP8 checkpoints are not supported; supported: per-tensor and "
                             "per-channel FP8 weight scales")
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
        return Fp8LinearMethod(self.gemm, checkpoint=checkpoint, static=self.static)
