"""Gemma 2 and Gemma 3 (text) causal LMs.

What differs from Llama, as transformers computes it: embeddings scaled by sqrt(hidden_size) (in the
model dtype); RMSNorm multiplying by ``1 + weight`` in float32 before the cast; four norms per layer
(before and after attention, before and after the MLP, each residual add after its post-norm); a
GELU-tanh gated MLP; attention scaled by ``query_pre_attn_scalar ** -0.5``; interleaved sliding-window
and global layers (``layer_types``). Gemma 2 soft-caps attention scores and the final logits; Gemma 3
norms q and k per head and gives its sliding layers their own RoPE (``rope_parameters
["sliding_attention"]``, older configs' ``rope_local_base_freq``), the global layers the scaled one.

The family's fields are :class:`GemmaConfig`'s, read from ``config.json`` or from a llama.cpp GGUF
(``gemma3``: the values llama.cpp hard-codes instead of writing them included).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvforge.model.config import (
    FULL,
    SLIDING,
    ConfigFields,
    GGUFArchitecture,
    GGUFMetadata,
    HFConfig,
    ModelConfig,
    windowed_layers,
)
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.plugins.models import fused_ops
from kvforge.plugins.models.llama import LlamaForCausalLM, LlamaModel, Rope, RotaryEmbedding

#: Gemma 3 values llama.cpp hard-codes instead of writing them (llama-model.cpp, LLM_ARCH_GEMMA3): every
#: 6th layer global, the sliding layers' RoPE base, and the 27B (62 layers) scaling queries by
#: hidden_size / heads instead of head_dim; transformers' Gemma3TextConfig has the same defaults.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


@dataclass
class GemmaConfig(ModelConfig):
    """A Gemma 2 / 3 config: the general fields and the family's own."""

    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim's
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logit / cap) (Gemma 2)
    hidden_activation: str = "gelu_pytorch_tanh"  # the gated MLP's activation
    # the sliding layers' RoPE (Gemma 3): base and scaling dict (None: plain); None base: one RoPE for all
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def attention_features(self) -> frozenset[str]:
        capped = self.attn_logit_softcapping is not None
        return super().attention_features | frozenset({"logits_soft_cap"} if capped else ())

    def to_hf_dict(self) -> HFConfig:
        d = super().to_hf_dict()
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        d.setdefault("final_logit_softcapping", self.final_logit_softcapping)
        d.setdefault("hidden_activation", self.hidden_activation)
        if self.local_rope_theta is not None and "rope_parameters" not in d:
            d.setdefault("rope_local_base_freq", self.local_rope_theta)
        return d


def gemma_layer_types(model_type: str, layers: int, pattern: int) -> list[str]:
    """transformers' rule where a config has no ``layer_types``: Gemma 2 alternates (sliding first),
    Gemma 3 makes every ``pattern``-th layer global."""
    if model_type == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


def _local_rope(hf: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's sliding layers' (RoPE base, scaling): ``rope_parameters["sliding_attention"]``
    (transformers 5), else ``rope_local_base_freq``."""
    per_type = hf.get("rope_parameters") or {}
    local = per_type.get(SLIDING) if isinstance(per_type.get(SLIDING), dict) else None
    if local is None:
        return float(hf.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_BASE)), None
    scaling = {k: v for k, v in local.items() if k != "rope_theta"}
    return float(local.get("rope_theta", GEMMA3_LOCAL_ROPE_BASE)), (
        scaling if scaling.get("rope_type", "default") != "default" else None)


class GemmaRMSNorm(nn.Module):
    """``(x / rms(x)) * (1 + weight)`` in float32, then cast (weights are stored zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # e.g. [T, heads, D] without its partner (q/k go through fused_ops.qk_rms_norm)
            return fused_ops.rms_norm_ref(x, self.weight, self.eps, offset=True)
        # without a residual, rms_norm returns the normed tensor alone
        return cast(torch.Tensor, fused_ops.rms_norm(x, self.weight, self.eps, offset=True))


class GemmaAttention(nn.Module):
    def __init__(self, config: GemmaConfig, attn: AttentionBackend, layer_idx: int):
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

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: Rope, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
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
    def __init__(self, config: GemmaConfig):
        super().__init__()
        act = config.hidden_activation
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"config.json field 'hidden_activation' is {act!r}; Gemma supports 'gelu_pytorch_tanh'")
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: GemmaConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, attn, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: Rope, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden), rope, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn_out)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


def local_rope_config(config: GemmaConfig) -> GemmaConfig | None:
    """The config of Gemma 3's sliding layers' RoPE (None: Gemma 2, one RoPE for all layers)."""
    if config.local_rope_theta is None:
        return None
    return dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=config.local_rope_scaling)


class GemmaModel(LlamaModel):
    """Gemma's decoder stack (or one pipeline stage of it): Llama's, with Gemma's layers and final norm,
    scaled embeddings, and Gemma 3's second RoPE for the sliding layers."""

    layer_cls = GemmaDecoderLayer

    def __init__(self, config: GemmaConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        if self.norm is not None:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        local = local_rope_config(config)
        self.rotary_emb_local = RotaryEmbedding(local) if local is not None else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        elif intermediate is None:
            raise ValueError("a pipeline stage after the first needs the previous stage's hidden states")
        else:
            hidden = intermediate[0]
        ropes = {False: self.rotary_emb.bind(positions, hidden, attn_meta)}
        if self.rotary_emb_local is not None:
            ropes[True] = self.rotary_emb_local.bind(positions, hidden, attn_meta)
        capture = self.capture
        for i in range(self.start, self.end):
            if capture is not None:  # (Gemma's layers carry the residual stream in hidden)
                capture.record(i, hidden)
            rope = ropes[self.rotary_emb_local is not None and self.config.window_of(i) is not None]
            hidden = self.layers[i](positions, hidden, rope, kv_caches[i - self.start], attn_meta)
        if not self.is_last:
            return hidden, torch.zeros_like(hidden)  # (hidden, residual) as the stages exchange them
        if self.norm is None:
            raise RuntimeError("the last pipeline stage holds the final norm")
        out = self.norm(hidden)
        if capture is not None:
            capture.record_final(out)
        return out


GEMMA_PRESETS: dict[str, ModelConfig] = {
    "gemma-3-27b": GemmaConfig(  # google/gemma-3-27b-it's text_config
        architecture="Gemma3ForCausalLM", model_type="gemma3_text", vocab_size=262208, hidden_size=5376,
        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072, tie_word_embeddings=True, qk_norm=True, query_pre_attn_scalar=168,
        sliding_window=1024, layer_types=gemma_layer_types("gemma3_text", 62, GEMMA3_SLIDING_WINDOW_PATTERN),
        bos_token_id=2, eos_token_ids=[1, 106], torch_dtype="bfloat16", local_rope_theta=GEMMA3_LOCAL_ROPE_BASE),
}


class GemmaForCausalLM(LlamaForCausalLM):
    """The model plugin for Gemma2ForCausalLM and Gemma3ForCausalLM (text)."""

    model_cls = GemmaModel
    config_class = GemmaConfig
    family = ModelFamily(
        model_types={"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"},
        # llama.cpp's gemma3 files: the text model; its own names for the norm before the MLP and the two
        # post-norms; every norm stored as its multiplier 1 + w (Gemma3Model.norm_shift); a chat turn ends
        # with <end_of_turn>, which the files do not name as such
        gguf_architectures={"gemma3": GGUFArchitecture(
            "gemma3_text", block_names={"ffn_norm": "pre_feedforward_layernorm",
                                        "post_attention_norm": "post_attention_layernorm",
                                        "post_ffw_norm": "post_feedforward_layernorm"},
            norm_shift=1.0, end_of_turn="<end_of_turn>")},
        presets=GEMMA_PRESETS,
    )
    capabilities = ModelCapabilities(sliding_window=True, notes="interleaved sliding/global layers, soft-capping")

    def __init__(self, config: GemmaConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        self.final_logit_softcapping = config.final_logit_softcapping

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> GemmaConfig:
        """Gemma's fields, its q/k norms (Gemma 3) and its layer pattern where ``layer_types`` is missing."""
        model_type = fields["model_type"]
        window = fields.get("sliding_window")
        if model_type == "gemma3_text":
            fields["qk_norm"] = True
        if window is not None and not hf.get("layer_types"):
            pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
            fields["layer_types"] = windowed_layers(
                gemma_layer_types(model_type, fields["num_hidden_layers"], pattern), window)
        local_theta, local_scaling = _local_rope(hf) if model_type == "gemma3_text" else (None, None)
        return GemmaConfig(
            **fields, query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            hidden_activation=str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"),
            local_rope_theta=local_theta, local_rope_scaling=local_scaling)

    @classmethod
    def config_from_gguf(cls, fields: ConfigFields, gguf: GGUFMetadata) -> GemmaConfig:
        """``attention.sliding_window`` from the file; the layer pattern, the local RoPE base
        (``rope.freq_base_swa`` where a file has it) and the query scale as llama.cpp hard-codes them
        (:data:`GEMMA3_SLIDING_WINDOW_PATTERN`...); GELU-tanh as llama.cpp computes it."""
        window = gguf.get("attention.sliding_window")
        window = int(window) if window else None
        blocks, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
        scalar = fields["hidden_size"] // heads if blocks == GEMMA3_27B_LAYERS else fields["head_dim"]
        local_theta = float(gguf.get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
        soft_cap, final_cap = gguf.get("attn_logit_softcapping"), gguf.get("final_logit_softcapping")
        fields["hf_config"] = {
            "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN, "rope_local_base_freq": local_theta,
            "query_pre_attn_scalar": scalar, "final_logit_softcapping": final_cap, "attn_logit_softcapping": soft_cap,
        }
        fields["sliding_window"] = window
        types = gemma_layer_types("gemma3_text", blocks, GEMMA3_SLIDING_WINDOW_PATTERN)
        fields["layer_types"] = windowed_layers(types, window)
        return GemmaConfig(**fields, query_pre_attn_scalar=scalar, attn_logit_softcapping=soft_cap,
                           final_logit_softcapping=final_cap, local_rope_theta=local_theta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
