"""What the built-in linear methods ask of their layer (``kvforge.plugins.quantization.linear_layer``) and
the typed operands they keep once loaded (``Int4Weights``, ``Fp8Weights``)."""
from __future__ import annotations

import pytest
import torch

from kvforge import quantization
from kvforge.layers import ColumnParallelLinear
from kvforge.plugins.quantization.fp8 import Fp8LinearMethod, Fp8Quantization
from kvforge.plugins.quantization.int4 import Int4LinearMethod, Int4Quantization
from kvforge.plugins.quantization.linear_layer import keep_when_random, linear_layer


def test_a_linear_method_refuses_a_module_that_is_not_a_kvforge_linear_layer():
    with pytest.raises(TypeError, match="given a Linear, not a kvforge linear layer"):
        Fp8LinearMethod(checkpoint=True).create_weights(torch.nn.Linear(4, 4))
    layer = ColumnParallelLinear(8, 8)
    assert linear_layer(layer) is layer


def test_a_parameter_marked_to_keep_is_left_out_of_random_weights():
    p = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    keep_when_random(p)
    assert p.random_fill is False


@pytest.mark.parametrize("method", [Int4LinearMethod(32), Fp8LinearMethod()], ids=["int4", "fp8"])
def test_a_layer_run_before_its_weights_load_says_so(method):
    with pytest.raises(RuntimeError, match="before its weights were loaded"):
        method.apply(ColumnParallelLinear(32, 32), torch.zeros(1, 32))


@pytest.mark.parametrize("quant", [Int4Quantization(group_size=32), Fp8Quantization()], ids=["int4", "fp8"])
def test_the_loaded_operands_are_the_layer_s_parameters(quant):
    with quantization.building(quant):
        layer = ColumnParallelLinear(32, 16)
    quantization.attach_all(torch.nn.Sequential(layer), quant)
    layer.weight.weight_loader(layer.weight, torch.randn(16, 32, generator=torch.Generator().manual_seed(0)))
    quantization.process_after_loading(layer)
    weights = layer.quant_method.weights
    names = ("qweight", "scales", "zeros") if isinstance(quant, Int4Quantization) else ("weight", "weight_scale")
    assert all(getattr(weights, n) is getattr(layer, n) for n in names)
    assert layer(torch.randn(3, 32)).shape == (3, 16)
