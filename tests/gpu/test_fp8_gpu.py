"""``fp8`` on an FP8-capable GPU (H100/H200): the linear layers run on FP8 tensor cores (the Triton FP8
GEMM or ``torch._scaled_mm`` with row-wise scales, as the ``gemm`` option says), and the result is the
reference's (the same FP8 operands dequantized and multiplied)."""
import pytest
import torch

from kvforge.layers import ColumnParallelLinear
from kvforge.model import quantization
from kvforge.plugins.quantization.fp8 import FP8, Fp8Quantization, dequantize_rows, quantize_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")]


@pytest.mark.parametrize("gemm", ["auto", "scaled_mm", "triton"])
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_fp8_layer_runs_on_fp8_tensor_cores_and_matches_the_reference(tokens, gemm):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    method = Fp8Quantization(gemm=gemm)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            with quantization.building(method):
                layer = ColumnParallelLinear(512, 1024)
            quantization.attach_all(layer, method)
    finally:
        torch.set_default_dtype(old)
    layer.weight.weight_loader(layer.weight, w)
    quantization.process_after_loading(layer)
    y = layer(x)
    assert layer.quant_method.fast and layer.weight.dtype == FP8 and y.dtype == torch.bfloat16
    xq, xs = quantize_rows(x)
    ref = dequantize_rows(xq, xs) @ dequantize_rows(layer.weight, layer.weight_scale).t()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
