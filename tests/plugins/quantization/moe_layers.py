"""Single quantized ``FusedMoE`` layers, built and filled the way the engine does (inside
``quantization.building``, every tensor through its loader), for the layer and kernel tests."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from kvforge.layers.moe import FusedMoE
from kvforge.layers.weights import full_shape, load_full
from kvforge.model import quantization

#: format id -> (quantization method name, checkpoint quantization_config or None: quantized on load)
FORMATS = {
    "mxfp4": ("mxfp4", {"quant_method": "mxfp4"}),
    "fp8-block16": ("fp8", {"quant_method": "fp8", "weight_block_size": [16, 16]}),
    "fp8-block128": ("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]}),  # Qwen3 / DeepSeek
    "fp8-tensor": ("fp8", {"quant_method": "fp8"}),
    "fp8-on-load": ("fp8", None),
}


def method(fmt: str) -> quantization.QuantizationMethod:
    from kvforge.plugins.quantization.fp8 import Fp8Quantization
    from kvforge.plugins.quantization.mxfp4 import Mxfp4Quantization

    name, qc = FORMATS[fmt]
    cls = Mxfp4Quantization if name == "mxfp4" else Fp8Quantization
    return cls(model_config=SimpleNamespace(quantization_config=qc))


def build_layer(fmt: str, experts: int = 4, top_k: int = 2, hidden: int = 64, inter: int | None = None,
                seed: int = 0) -> FusedMoE:
    """A gpt-oss-style layer (biases, swigluoai) for mxfp4, a Qwen-style one (silu) for fp8, random tensors;
    ``inter`` defaults to 64 for mxfp4 (groups of 32), 40 for fp8 (a partial 16-block); 128-blocks get
    H = 256 and I = 320 (two whole blocks of H, a partial third of I)."""
    gen = torch.Generator().manual_seed(seed)
    gpt_oss = fmt == "mxfp4"
    inter = inter or (64 if gpt_oss else 40)
    if fmt == "fp8-block128":
        hidden, inter = 256, 320
    with quantization.building(method(fmt)):
        layer = FusedMoE(experts, top_k, hidden, inter, bias=gpt_oss, activation="swigluoai" if gpt_oss else "silu",
                         scoring="topk_softmax" if gpt_oss else "softmax")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            shape = full_shape(p)
            if name.endswith("_blocks"):  # every byte: every e2m1 code
                value = torch.randint(0, 256, shape, generator=gen).to(torch.uint8)
            elif name.endswith("_scales"):  # e8m0 around 2^-4
                value = torch.randint(120, 126, shape, generator=gen).to(torch.uint8)
            elif "scale" in name:
                value = torch.rand(shape, generator=gen) * 0.01 + 0.001
            elif p.dtype == torch.float8_e4m3fn:
                value = (torch.randn(shape, generator=gen) * 64).to(torch.float8_e4m3fn)
            else:
                value = torch.randn(shape, generator=gen) * 0.1
            load_full(p, value)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def route(layer: FusedMoE, num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H], topk_weights [T, k], topk_ids [T, k]) for ``num_tokens`` random tokens."""
    from kvforge.layers.moe import select_experts_ref

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, layer.hidden_size, generator=gen)
    logits = torch.randn(num_tokens, layer.num_experts, generator=gen)
    weights, ids = select_experts_ref(logits, layer.top_k, layer.scoring, layer.renormalize, layer.round_weights)
    return x, weights, ids
