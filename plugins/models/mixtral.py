"""Mixture-of-experts Llama-family models: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention is Llama's (Qwen2-MoE: q/k/v bias; Qwen3-MoE: q/k norms; Mixtral: an optional sliding
window). The MLP is a :class:`kvforge.layers.moe.FusedMoE` behind a router (``gate``, [E, H], replicated
over tensor-parallel ranks, never quantized), with Qwen2-MoE's shared expert (a dense MLP scaled by
``sigmoid(shared_expert_gate(x))``) and its dense layers (``mlp_only_layers``, ``decoder_sparse_step``).
Routing follows transformers: softmax over the experts in float32, the top k, renormalised (Mixtral;
Qwen when ``norm_topk_prob``). The MoE fields are config.json's (``hf_config``), read here.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvforge.layers.moe import FusedMoE
from kvforge.model.config import ConfigFields, HFConfig, ModelConfig
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.plugins.models.llama import (
    LLAMA_WEIGHTS,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    qwen_windows,
    require_silu,
)


def _hf_int(config: ModelConfig, *names: str, default: int | None = None) -> int:
    """The first of ``names`` that config.json sets (transformers renamed some MoE fields), an integer;
    ``ValueError`` naming them if none is set and there is no default."""
    value = next((config.hf_config[n] for n in names if config.hf_config.get(n) is not None), default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"model config field {' / '.join(map(repr, names))} must be an integer for a "
                         f"mixture-of-experts model, got {value!r}")
    return value


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert)."""

    def __init__(self, config: ModelConfig, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int = 0, round_weights: bool = True):
        super().__init__()
        num_experts = _hf_int(config, "num_local_experts", "num_experts", default=0)
        top_k = _hf_int(config, "num_experts_per_tok", default=0)
        if not num_experts or not top_k:
            raise ValueError("model config fields 'num_local_experts'/'num_experts' and 'num_experts_per_tok' "
                             "must be positive integers for a mixture-of-experts model")
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, intermediate_size, renormalize=renormalize,
                                round_weights=round_weights)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, intermediate_size=shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
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
    weight_map = dataclasses.replace(LLAMA_WEIGHTS, renames=((".block_sparse_moe.", ".mlp."),),
                                     expert_projections={"w1": "w1", "w3": "w3", "w2": "w2"})
    family = ModelFamily(model_types={"mixtral": "MixtralForCausalLM"})
    capabilities = ModelCapabilities(sliding_window=True, moe=True, quantization=True,
                                     notes="experts sharded over tensor-parallel ranks; fp8 experts")

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> ModelConfig:
        require_silu(hf)
        return cls.config_class(**fields)


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        step = _hf_int(config, "decoder_sparse_step", default=1)
        dense = layer_idx in (config.hf_config.get("mlp_only_layers") or []) or (layer_idx + 1) % step != 0
        if dense:
            return LlamaMLP(config)
        return SparseMoeBlock(config, _hf_int(config, "moe_intermediate_size"),
                              renormalize=bool(config.hf_config.get("norm_topk_prob", False)),
                              shared_intermediate_size=_hf_int(config, "shared_expert_intermediate_size", default=0))


class QwenMoeModel(LlamaModel):
    layer_cls = QwenMoeDecoderLayer


QWEN_MOE_PRESETS: dict[str, ModelConfig] = {
    "qwen3-30b-a3b": ModelConfig(  # Qwen/Qwen3-30B-A3B's config.json
        architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        qk_norm=True, bos_token_id=151643, eos_token_ids=[151645], torch_dtype="bfloat16",
        hf_config={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
}


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE (and Qwen3-MoE, the same with q/k norms and no shared expert)."""

    model_cls = QwenMoeModel
    family = ModelFamily(model_types={"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"},
                         presets=QWEN_MOE_PRESETS)
    capabilities = ModelCapabilities(sliding_window=True, moe=True, quantization=True,
                                     notes="shared expert (Qwen2-MoE), q/k norms (Qwen3-MoE); fp8 experts (block FP8 "
                                           "checkpoints)")

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> ModelConfig:
        """Qwen2-MoE's q/k/v biases (not on o_proj) and windowed even layers below ``max_window_layers``;
        Qwen3-MoE's q/k norms and every layer windowed; both only with ``use_sliding_window``."""
        require_silu(hf)
        if fields["model_type"] == "qwen2_moe":
            fields["attention_bias"], fields["attention_out_bias"] = True, False
            qwen_windows(fields, hf, lambda layer, limit: layer % 2 == 0 and layer < limit)
        else:
            if fields["model_type"] == "qwen3_moe":
                fields["qk_norm"] = True
            qwen_windows(fields, hf, None)
        return cls.config_class(**fields)
