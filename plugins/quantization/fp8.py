"""``fp8``: weights quantized on load to FP8 e4m3 with one scale per output channel, activations
quantized per token at run time (dynamic), as vLLM's ``--quantization fp8`` does for a bf16/fp16
checkpoint.

On CUDA devices with FP8 tensor cores (compute capability 8.9 or more) the GEMM is
``torch._scaled_mm`` with row-wise scales. Elsewhere (the CPU, older GPUs) it is the reference: the
same quantized operands dequantized to float32 and multiplied, so the CPU tests see exactly the
rounding the GPU kernel sees (docs/quantization.md).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.quantization import LinearMethod, QuantizationMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
#: smallest scale: an all-zero row or token keeps a finite scale
MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, cols]`` -> (FP8 values, float32 scale per row [rows, 1]), ``x ~= values * scale``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def _scaled_mm_works(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod(LinearMethod):
    def __init__(self) -> None:
        self.use_scaled_mm: bool | None = None  # decided on the first call, on the layer's device

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)  # the full-precision copy is freed
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out, 1]

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_rows(x2)
        if self.use_scaled_mm is None:
            self.use_scaled_mm = _scaled_mm_works(x.device) and x.dtype in (torch.bfloat16, torch.float16)
        if self.use_scaled_mm:
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale.t(),
                                 out_dtype=x.dtype)
        else:
            y = (dequantize_rows(xq, xs) @ dequantize_rows(layer.weight, layer.weight_scale).t()).to(x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


class Fp8Quantization(QuantizationMethod):
    """Every linear layer of the decoder in FP8 (embeddings and the LM head stay in the model dtype)."""

    name = "fp8"

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return Fp8LinearMethod()
