"""Mixture-of-experts Llama-family models: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention is Llama's (Qwen2-MoE: q/k/v bias; Qwen3-MoE: q/k norms; Mixtral: an optional sliding
window). The MLP is a :class:`kvforge.layers.moe.FusedMoE` behind a router (``gate``, [E, H], replicated
over tensor-parallel ranks, never quantized), with Qwen2-MoE's shared expert (a dense MLP scaled by
``sigmoid(shared_expert_gate(x))``) and its dense layers (``mlp_only_layers``, ``decoder_sparse_step``).
Routing follows transformers: softmax over the experts in float32, the top k, renormalised (Mixtral;
Qwen when ``norm_topk_prob``).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.moe import FusedMoE
from kvforge.model.config import ModelConfig
from kvforge.model.interface import ModelCapabilities
from kvforge.plugins.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def _hf(config: ModelConfig, *names: str, default=None):
    """The first of ``names`` that config.json sets (transformers renamed some MoE fields)."""
    for name in names:
        if config.hf_config.get(name) is not None:
            return config.hf_config[name]
    return default


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert)."""

    def __init__(self, config: ModelConfig, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int = 0, round_weights: bool = True):
        super().__init__()
        num_experts = _hf(config, "num_local_experts", "num_experts")
        top_k = _hf(config, "num_experts_per_tok")
        if not num_experts or not top_k:
            raise ValueError("model config fields 'num_local_experts'/'num_experts' and 'num_experts_per_tok' "
                             "must be positive integers for a mixture-of-experts model")
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, intermediate_size, renormalize=renormalize,
                                round_weights=round_weights)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, intermediate_size=shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        # Mixtral keeps its routing weights in float32 (Qwen rounds them to the model dtype)
        return SparseMoeBlock(config, config.intermediate_size, renormalize=True, round_weights=False)


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: every layer's MLP is 8 experts, top 2 (checkpoint names ``block_sparse_moe.experts.N.w1``)."""

    model_cls = MixtralModel
    capabilities = ModelCapabilities(sliding_window=True, moe=True, quantization=False,
                                     notes="experts sharded over tensor-parallel ranks; quantized MoE refused")
    expert_projections = {"w1": "w1", "w3": "w3", "w2": "w2"}

    def param_for(self, name: str, w: torch.Tensor):
        return super().param_for(name.replace(".block_sparse_moe.", ".mlp."), w)


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        step = _hf(config, "decoder_sparse_step", default=1)
        dense = layer_idx in (_hf(config, "mlp_only_layers", default=[]) or []) or (layer_idx + 1) % step != 0
        if dense:
            return LlamaMLP(config)
        return SparseMoeBlock(config, _hf(config, "moe_intermediate_size"),
                              renormalize=bool(_hf(config, "norm_topk_prob", default=False)),
                              shared_intermediate_size=_hf(config, "shared_expert_intermediate_size", default=0))


class QwenMoeModel(LlamaModel):
    layer_cls = QwenMoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE (and Qwen3-MoE, the same with q/k norms and no shared expert)."""

    model_cls = QwenMoeModel
    capabilities = ModelCapabilities(sliding_window=True, moe=True, quantization=False,
                                     notes="shared expert (Qwen2-MoE), q/k norms (Qwen3-MoE); quantized MoE refused")
