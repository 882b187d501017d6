"""``fp8`` on an FP8-capable GPU (H100/H200): the linear layers run ``torch._scaled_mm`` with row-wise
scales, and its result is the reference's (the same FP8 operands dequantized and multiplied)."""
import pytest
import torch

from kvforge import quantization
from kvforge.layers import ColumnParallelLinear
from kvforge.plugins.quantization.fp8 import FP8, Fp8Quantization, dequantize_rows, quantize_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")]


@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_fp8_layer_uses_scaled_mm_and_matches_the_reference(tokens):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    with torch.device("cuda"), quantization.building(Fp8Quantization()):
        layer = ColumnParallelLinear(512, 1024).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, w)
    quantization.process_after_loading(layer)
    y = layer(x)
    assert layer.quant_method.use_scaled_mm and layer.weight.dtype == FP8 and y.dtype == torch.bfloat16
    xq, xs = quantize_rows(x)
    ref = dequantize_rows(xq, xs) @ dequantize_rows(layer.weight, layer.weight_scale).t()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
