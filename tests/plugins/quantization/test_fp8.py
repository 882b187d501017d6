"""``quantization="fp8"``: FP8 e4m3 weights (a scale per output channel) and per-token activations.
Accuracy on the real default model against its GGUF weights dequantized to float32: the mean KL
divergence of the next-token distribution over a fixed 1,000+-token text, and greedy agreement over
8 prompts x 64 tokens. A dequantizer that drops or misplaces a scale fails both bounds by far."""
from __future__ import annotations

import pytest
import torch

from kvforge import LLM, quantization
from kvforge.layers import ColumnParallelLinear, RowParallelLinear
from kvforge.plugins.quantization.fp8 import FP8, Fp8Quantization, dequantize_rows, quantize_rows
from quantization_accuracy import mean_kl, passage_logits, top1_agreement

#: bounds (docs/quantization.md): FP8 e4m3 with per-channel weight and per-token activation scales
#: is known to stay within ~1e-2 nats of mean KL on small models; measured here: see the docs
MAX_MEAN_KL = 0.05
MIN_GREEDY_AGREEMENT = 0.85  # of the reference's 8 x 64 greedy tokens, ranked first by the quantized model


def test_fp8_rows_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[5] = 0  # an all-zero row keeps a finite scale and comes back as zeros
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (64, 1) and torch.isfinite(scale).all()
    back = dequantize_rows(q, scale)
    # 3 mantissa bits: relative error at most 2^-4 for normal values, absolute 2^-10 * scale below them
    assert (back - x).abs().le(torch.maximum(x.abs() / 16, scale * 2 ** -9)).all()
    assert back[5].eq(0).all()
    assert (back.abs().amax(dim=1) - x.abs().amax(dim=1)).abs().le(x.abs().amax(dim=1) / 16).all()


def test_fp8_layers_apply_the_quantized_operands():
    g = torch.Generator().manual_seed(1)
    w1, w2, x = torch.randn(48, 32, generator=g), torch.randn(32, 48, generator=g), torch.randn(5, 32, generator=g)
    method = Fp8Quantization()
    with quantization.building(method):
        col, row = ColumnParallelLinear(32, 48), RowParallelLinear(48, 32)
    assert col.weight.is_meta  # deferred until the layer's method is known
    quantization.attach_all(torch.nn.Sequential(col, row), method)
    col.weight.weight_loader(col.weight, w1)
    row.weight.weight_loader(row.weight, w2)
    quantization.process_after_loading(torch.nn.Sequential(col, row))
    assert col.weight.dtype == FP8 and row.weight_scale.shape == (32, 1)
    h = col(x)
    xq, xs = quantize_rows(x)
    ref = dequantize_rows(xq, xs) @ dequantize_rows(*quantize_rows(w1)).t()
    torch.testing.assert_close(h, ref, rtol=0, atol=1e-5)  # exactly the dequantized product
    rel = (row(h) - x @ w1.t() @ w2.t()).norm() / (x @ w1.t() @ w2.t()).norm()
    assert 1e-4 < rel < 0.1  # quantized (not a silent full-precision path), and close


@pytest.fixture(scope="module")
def reference_logits(float32_passage):
    return float32_passage[:2]  # conftest's: the float32 passage logits and their count, computed once


def test_fp8_weights_mean_kl_on_the_default_model_is_bounded(reference_logits):
    ref, n = reference_logits
    kl = mean_kl(passage_logits(quant="fp8")[0], ref)
    print(f"fp8 weights: mean KL {kl:.5f} nats over {n} positions")
    assert n >= 1000 and 0 < kl < MAX_MEAN_KL


def test_fp8_greedy_agreement_with_float32_over_8_prompts_x_64_tokens(float32_greedy):
    engine = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=64)
    fp8 = LLM(quantization="fp8", **engine)
    assert fp8.llm_engine.executor.driver.model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    share = top1_agreement(fp8, float32_greedy)  # (conftest's: reference_greedy of LLM(**engine), once)
    print(f"fp8 weights: greedy agreement {share:.3f}")
    assert share >= MIN_GREEDY_AGREEMENT


def test_unknown_quantization_is_refused_naming_the_supported_methods():
    with pytest.raises(ValueError, match="(?s)int3.*fp8"):
        LLM(quantization="int3", device="cpu", max_model_len=128, num_gpu_blocks_override=16)
