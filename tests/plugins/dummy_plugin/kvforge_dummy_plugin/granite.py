"""IBM Granite (``GraniteForCausalLM``) as a third-party model plugin: Llama plus four multipliers, in one
file, built only from kvforge's public model parts (docs/adding_a_model.md uses it as the template).

transformers' Granite: embeddings times ``embedding_multiplier``; attention scaled by
``attention_multiplier`` (not head_dim ** -0.5); each residual branch times ``residual_multiplier``;
logits divided by ``logits_scaling``. The backend's scale is the engine's (head_dim ** -0.5), so the
queries are rescaled by ``attention_multiplier / head_dim ** -0.5`` before attention instead.
"""
from __future__ import annotations

import torch

from kvforge.model import ModelCapabilities
from kvforge.plugins.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteAttention(LlamaAttention):
    def __init__(self, config, attn, layer_idx):
        super().__init__(config, attn, layer_idx)
        self.q_rescale = config.hf_config.get("attention_multiplier", config.head_dim ** -0.5) / attn.scale

    def forward(self, positions, hidden, rope, kv_cache, meta):
        rescaled = lambda q, k: rope(q * self.q_rescale, k)  # noqa: E731 - RoPE is linear: scale first
        return super().forward(positions, hidden, rescaled, kv_cache, meta)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(self, config, attn, layer_idx):
        super().__init__(config, attn, layer_idx)
        self.residual_multiplier = config.hf_config.get("residual_multiplier", 1.0)

    def forward(self, positions, hidden, residual, rope, kv_cache, meta):
        # the base layer adds each branch into the residual inside the next norm: scale the branch first
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rope, kv_cache, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    def embed(self, input_ids):
        return self.embed_tokens(input_ids) * self.config.hf_config.get("embedding_multiplier", 1.0)


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel
    capabilities = ModelCapabilities(notes="third-party example (kvforge-dummy-plugin)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.hf_config.get("logits_scaling", 1.0)
