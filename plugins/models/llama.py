"""Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat varlen batch and a paged KV cache.

The numerics follow Hugging Face's implementation (RMSNorm in float32, neox-style RoPE from a float32
cos/sin cache, residual adds in the model dtype) so that logits match ``transformers`` to float noise.
Q/K/V and gate/up projections are fused; :data:`STACKED_PARAMS` tells :meth:`LlamaForCausalLM.load_weights`
where each checkpoint tensor goes. The layers are ``kvforge.layers``' parallel ones, which own their
weight loading and split themselves over the tensor-parallel group the model is built in: this
file never branches on tensor parallelism.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterable

import torch
from torch import nn

from kvforge import parallel_state
from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from kvforge.layers.vocab import vocab_parallel_logits
from kvforge.model_config import ModelConfig
from kvforge.plugins.models import fused_ops

#: checkpoint module name -> (fused module name, shard id)
STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
#: FP8 KV-cache scales: the name after "model.layers.N." -> set_kv_scales keyword (compressed-tensors;
#: older checkpoints use the K/V projections' output_scale)
KV_SCALE_NAMES = {"self_attn.k_scale": ("k_scale",), "self_attn.v_scale": ("v_scale",),
                  "self_attn.k_proj.output_scale": ("k_scale",), "self_attn.v_proj.output_scale": ("v_scale",),
                  "self_attn.kv_scale": ("k_scale", "v_scale")}  # AutoFP8: one scale for both
#: checkpoint tensors that hold nothing we need (recomputed buffers)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)`` (float32 statistics, cast back before the weight multiply, as HF does); with
        ``residual``: adds ``x`` into it in place and returns ``(norm(residual), residual)``."""
        return fused_ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with the config's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = config.rope_scaling
    rope_type = rs["rope_type"] if rs else "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rs["factor"]
    if rope_type == "freq_factors":  # GGUF rope_freqs tensor: llama.cpp divides each frequency by it
        return inv_freq / torch.tensor(rs["factors"], dtype=torch.float32)
    if rope_type == "llama3":  # HF's _compute_llama3_parameters
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs.get("original_max_position_embeddings", config.max_position_embeddings)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"model config field 'rope_scaling' has rope_type {rope_type!r}; supported: "
                     "default, linear, llama3, freq_factors")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half) from a float32 cos/sin cache indexed by absolute position."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq = rope_inv_freq(config)  # [head_dim // 2]
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin rows for the torch path, gathered once per forward and shared by every layer; None
        when the fused kernel runs (it reads the caches itself)."""
        if fused_ops.use_fused(like):
            return None
        return fused_ops.rope_tables(positions, self.cos, self.sin, like.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, heads, head_dim]; k: [T, kv_heads, head_dim] (rotated in place when fused)
        if tables is not None:
            return fused_ops.rope_with_tables(q, k, *tables)
        return fused_ops.rope(positions, q, k, self.cos, self.sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn = attn  # shared by all layers; not a module
        hd = self.head_dim = config.head_dim
        # rows: q | k | v of this rank's heads (kvforge.parallel_state.head_shard)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        shard = self.qkv_proj.shard
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        bias=config.attention_out_bias, input_part=(shard.q_start * hd, self.q_size))
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: Callable,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        o = self.attn.forward(q, k, v, kv_cache, meta)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # rows: gate | up (this rank's part of each)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))  # gate_up: [T, 2 * intermediate]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, attn, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: Callable, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried separately so that each residual add is fused into the next
        norm: returns (this layer's MLP output, the residual stream before it is added)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rope, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it (``parallel_state.current_stage()``): the first
    stage embeds, the last one norms; layers outside the stage are ``MissingLayer``s, so parameter
    names keep their global layer index."""

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__()
        stage = parallel_state.current_stage()
        self.start, self.end = stage.layers(config.num_hidden_layers)
        self.is_first, self.is_last = stage.is_first, stage.is_last
        # the last stage of a tied model computes its logits with the embedding
        wants_embed = stage.is_first or (stage.is_last and config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if wants_embed else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attn, i) if self.start <= i < self.end else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``kv_caches[i]`` is the cache of this stage's i-th layer. The first stage embeds
        ``input_ids``; a later one continues from ``intermediate`` = (hidden, residual) of the stage
        before. The last stage returns the normed hidden states, the others (hidden, residual)."""
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate
        rope = functools.partial(self.rotary_emb, tables=self.rotary_emb.tables(positions, hidden))
        for i in range(self.start, self.end):
            hidden, residual = self.layers[i](positions, hidden, residual, rope, kv_caches[i - self.start], attn_meta)
        if not self.is_last:
            return hidden, residual
        return self.norm(hidden, residual)[0]


class MissingLayer(nn.Identity):
    """A layer another pipeline stage holds."""


class LlamaForCausalLM(nn.Module):
    """The model plugin for LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    #: fused module -> the checkpoint modules it holds (quantization formats name those)
    packed_modules_mapping = {fused: [m for m, (f, _) in STACKED_PARAMS.items() if f == fused]
                              for fused, _ in STACKED_PARAMS.values()}

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn)
        # tied: logits use embed_tokens.weight and the checkpoint's lm_head.weight (if any) is skipped
        last = parallel_state.current_stage().is_last
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size)
                        if last and not config.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [num_tokens] int64 (flat varlen batch) -> hidden [num_tokens, hidden_size]
        (a pipeline stage other than the last: (hidden, residual) for the next one)."""
        return self.model(input_ids, positions, kv_caches, attn_meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size] (on every tensor-parallel rank)."""
        return vocab_parallel_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused) parameters; ValueError on an unknown name,
        a shape mismatch, or parameters left unfilled."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | int | None]] = set()
        for name, w in weights:
            if name.endswith(IGNORED_SUFFIXES) or (self.lm_head is None and name == "lm_head.weight"):
                continue
            if not self._on_this_stage(name):
                continue
            if name.startswith("model.layers.") and name.split(".", 3)[3] in KV_SCALE_NAMES:
                layer = int(name.split(".")[2])  # the FP8 KV cache's scales live on the attention backend
                self.model.layers[layer].self_attn.attn.set_kv_scales(
                    layer, **{k: w for k in KV_SCALE_NAMES[name.split(".", 3)[3]]})
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, module_name = module_path.rpartition(".")
            key: tuple[str, str | int | None] = (name, None)
            if module_name in STACKED_PARAMS:
                fused, shard = STACKED_PARAMS[module_name]
                key = (f"{parent}.{fused}.{leaf}", shard)
            param = params.get(key[0])
            if param is None and name.endswith(".bias") and not w.any():
                continue  # an all-zero bias some quantizers save (AutoGPTQ's QuantLinear) adds nothing
            if param is None:
                raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:  # each layer copies its own part (of its own shard, under tensor parallelism)
                loader(param, w, key[1])
            except ValueError as exc:
                raise ValueError(f"checkpoint weight {name!r}: {exc}") from None
            loaded.add(key)
        missing = [f"{n}[{s}]" if s is not None else n
                   for n, s in self._expected_keys() if (n, s) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {', '.join(missing[:20])}"
                             + (" ..." if len(missing) > 20 else ""))

    def _on_this_stage(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` belongs to a module this pipeline stage holds."""
        m = self.model
        if name.startswith("model.layers."):
            return m.start <= int(name.split(".")[2]) < m.end
        if name.startswith("model.embed_tokens."):
            return m.embed_tokens is not None
        if name.startswith("model.norm."):
            return m.norm is not None
        return True

    def _expected_keys(self) -> list[tuple[str, str | int | None]]:
        keys: list[tuple[str, str | int | None]] = []
        for name, _ in self.named_parameters():
            fused = name.rsplit(".", 2)[-2]
            shards = [s for f, s in STACKED_PARAMS.values() if f == fused]
            if shards:
                keys.extend((name, s) for s in shards)
            else:
                keys.append((name, None))
        return keys
