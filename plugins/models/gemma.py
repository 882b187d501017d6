"""Gemma 2 and Gemma 3 (text) causal LMs.

What differs from Llama, as transformers computes it: embeddings scaled by sqrt(hidden_size) (in the
model dtype); RMSNorm multiplying by ``1 + weight`` in float32 before the cast; four norms per layer
(before and after attention, before and after the MLP, each residual add after its post-norm); a
GELU-tanh gated MLP; attention scaled by ``query_pre_attn_scalar ** -0.5``; interleaved sliding-window
and global layers (``layer_types``). Gemma 2 soft-caps attention scores and the final logits; Gemma 3
norms q and k per head and gives its sliding layers their own RoPE (``rope_parameters
["sliding_attention"]``, older configs' ``rope_local_base_freq``), the global layers the scaled one.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvforge.model.config import SLIDING, ModelConfig
from kvforge.model.interface import ModelCapabilities
from kvforge.plugins.models import fused_ops
from kvforge.plugins.models.llama import LlamaForCausalLM, LlamaModel, RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """``(x / rms(x)) * (1 + weight)`` in float32, then cast (weights are stored zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # e.g. [T, heads, D] without its partner (q/k go through fused_ops.qk_rms_norm)
            return fused_ops.rms_norm_ref(x, self.weight, self.eps, offset=True)
        return fused_ops.rms_norm(x, self.weight, self.eps, offset=True)


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        self.attn = attn
        hd = self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        shard = self.qkv_proj.shard
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        bias=config.attention_bias, input_part=(shard.q_start * hd, self.q_size))
        self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.attn_layer = attn.layer(layer_idx, sliding_window=config.window_of(layer_idx),
                                     logits_soft_cap=config.attn_logit_softcapping)

    def forward(self, positions, hidden, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = fused_ops.qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, offset=True)
        q, k = rope(q, k)
        o = self.attn.forward(q, k, v, kv_cache, meta, self.attn_layer)
        return self.o_proj(o.reshape(n, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        act = config.hf_config.get("hidden_activation") or config.hf_config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"config.json field 'hidden_activation' is {act!r}; Gemma supports 'gelu_pytorch_tanh'")
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, attn, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions, hidden, rope, kv_cache, meta) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden), rope, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn_out)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


def local_rope_config(config: ModelConfig) -> ModelConfig | None:
    """Gemma 3's sliding layers' RoPE parameters (None: Gemma 2, one RoPE for all layers)."""
    if config.model_type != "gemma3_text":
        return None
    per_type = config.hf_config.get("rope_parameters") or {}
    local = per_type.get(SLIDING) if isinstance(per_type.get(SLIDING), dict) else None
    if local is None:
        local = {"rope_type": "default", "rope_theta": config.hf_config.get("rope_local_base_freq", 10000.0)}
    scaling = {k: v for k, v in local.items() if k != "rope_theta"}
    return dataclasses.replace(config, rope_theta=float(local.get("rope_theta", 10000.0)),
                               rope_scaling=scaling if scaling.get("rope_type", "default") != "default" else None)


class GemmaModel(LlamaModel):
    """Gemma's decoder stack (or one pipeline stage of it): Llama's, with Gemma's layers and final norm,
    scaled embeddings, and Gemma 3's second RoPE for the sliding layers."""

    layer_cls = GemmaDecoderLayer

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        if self.norm is not None:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        local = local_rope_config(config)
        self.rotary_emb_local = RotaryEmbedding(local) if local is not None else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)

    def forward(self, input_ids, positions, kv_caches, attn_meta, intermediate=None):
        if self.is_first:
            hidden = self.embed(input_ids)
        else:
            hidden = intermediate[0]
        ropes = {False: self.rotary_emb.bind(positions, hidden, attn_meta)}
        if self.rotary_emb_local is not None:
            ropes[True] = self.rotary_emb_local.bind(positions, hidden, attn_meta)
        for i in range(self.start, self.end):
            rope = ropes[self.rotary_emb_local is not None and self.config.window_of(i) is not None]
            hidden = self.layers[i](positions, hidden, rope, kv_caches[i - self.start], attn_meta)
        if not self.is_last:
            return hidden, torch.zeros_like(hidden)  # (hidden, residual) as the stages exchange them
        return self.norm(hidden)


class GemmaForCausalLM(LlamaForCausalLM):
    """The model plugin for Gemma2ForCausalLM and Gemma3ForCausalLM (text)."""

    model_cls = GemmaModel
    capabilities = ModelCapabilities(sliding_window=True, notes="interleaved sliding/global layers, soft-capping")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.hf_config.get("final_logit_softcapping")
        return logits if cap is None else torch.tanh(logits / cap) * cap
