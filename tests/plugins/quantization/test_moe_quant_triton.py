"""The quantized fused-MoE kernels (``kvforge.kernels.moe_quant``: weight tiles dequantized in the kernel)
in Triton's CPU interpreter, against the experts dequantized to float32 and run through the torch
reference, for every format: MXFP4 (gpt-oss: biases, swigluoai), FP8 with 16x16 blocks (a partial last
block of I), per-tensor and per-channel (quantized on load) scales.

As in test_int4_triton.py, the interpreter must be on before triton is first imported: the kernel tests
run in a subprocess with TRITON_INTERPRET=1 (test_kernels_in_interpreter).
To debug one case: TRITON_INTERPRET=1 python -m pytest tests/plugins/quantization/test_moe_quant_triton.py
"""
import importlib.util

import pytest
import torch
from moe_layers import FORMATS, build_layer, route

from kvforge.kernels import runs_on
from kvforge.layers.fused_moe import fused_experts_ref
from testing_support import IN_INTERPRETER, interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the interpreter")
def test_kernels_in_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(__file__)


def _reference(layer, x, weights, ids):
    deq = layer.quant_method.dequantize(layer)
    return fused_experts_ref(x, deq.w13, deq.w2, weights, ids, activation=layer.activation, w13_bias=layer.w13_bias,
                             w2_bias=layer.w2_bias, swiglu_alpha=layer.swiglu_alpha, swiglu_limit=layer.swiglu_limit)


@interpreted
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_kernel_matches_the_dequantized_reference(fmt, num_tokens):
    layer = build_layer(fmt)
    x, weights, ids = route(layer, num_tokens)
    assert runs_on(x)  # so apply() takes the kernels
    got = layer.quant_method.apply(layer, x, weights, ids)
    want = _reference(layer, x, weights, ids)
    scale = float(want.abs().max())
    assert scale > 1e-3  # not a vacuous zero
    # float32 sums in another order: a few ulps of the largest terms (a misplaced scale is off by up to 10x)
    torch.testing.assert_close(got, want, atol=2e-6 * scale, rtol=1e-5)


@interpreted
def test_kernel_sees_each_expert_scale():
    """Doubling one expert's scales doubles exactly the contributions that expert makes."""
    layer = build_layer("fp8-block16")
    x, weights, ids = route(layer, 4)
    before = layer.quant_method.apply(layer, x, weights, ids)
    with torch.no_grad():
        layer.get_parameter("w2_weight_scale_inv")[1].mul_(2.0)
    after = layer.quant_method.apply(layer, x, weights, ids)
    torch.testing.assert_close(after, _reference(layer, x, weights, ids), atol=1e-5, rtol=1e-5)
    uses = (ids == 1).any(dim=1)
    assert not torch.allclose(after[uses], before[uses]) and torch.equal(after[~uses], before[~uses])
