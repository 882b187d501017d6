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
import re
from typing import Any, Callable, Iterable

import torch
from torch import nn

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from kvforge.layers.moe import FusedMoE
from kvforge.layers.vocab import vocab_parallel_logits
from kvforge.model.config import ModelConfig
from kvforge.model.interface import ModelCapabilities
from kvforge.plugins.models import fused_ops
from kvforge.rank import parallel_state

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
#: one expert's projection of an MoE layer: "model.layers.3.mlp.experts.7.gate_proj.weight"
EXPERT_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<leaf>weight|bias)$")
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


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32, with the config's rope scaling applied (as
    transformers' ``modeling_rope_utils`` computes them); ``long``: LongRoPE's long factors."""
    dim = rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
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
    if rope_type == "yarn":  # HF's _compute_yarn_parameters (gpt-oss)
        base, factor = config.rope_theta, _yarn_factor(config)
        old_ctx = rs.get("original_max_position_embeddings") or config.max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(rs.get("beta_fast") or 32), correction_dim(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if rope_type == "longrope":  # HF's _compute_longrope_parameters: short or long factors
        factors = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta ** exponents)
    raise ValueError(f"model config field 'rope_scaling' has rope_type {rope_type!r}; supported: "
                     "default, linear, llama3, yarn, longrope, freq_factors")


def rotary_dim(config: ModelConfig) -> int:
    """How many leading dims of each head RoPE rotates (all but with ``partial_rotary_factor``)."""
    return int(config.head_dim * config.partial_rotary_factor)


def _yarn_factor(config: ModelConfig) -> float:
    rs = config.rope_scaling
    return rs.get("factor") or config.max_position_embeddings / rs.get("original_max_position_embeddings", config.max_position_embeddings)


def _longrope_original(config: ModelConfig) -> int:
    rs = config.rope_scaling
    return int(rs.get("original_max_position_embeddings")
               or config.hf_config.get("original_max_position_embeddings") or config.max_position_embeddings)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (YaRN, LongRoPE), else 1."""
    rs = config.rope_scaling
    rope_type = rs["rope_type"] if rs else "default"
    if rs and rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if rope_type == "yarn":
        factor = _yarn_factor(config)
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")

        def get(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        return get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
    if rope_type == "longrope":
        original = _longrope_original(config)
        factor = rs.get("factor") or config.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half) from a float32 cos/sin cache indexed by absolute position, over the
    first :func:`rotary_dim` dims of each head. LongRoPE keeps a second (long-factor) cache after the
    first: a token whose sequence is longer than ``original_max_position_embeddings`` after this step
    reads it, as transformers switches factors on the sequence length."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim, self.rot_dim = config.head_dim, rotary_dim(config)
        self.max_pos = config.max_position_embeddings
        longrope = bool(config.rope_scaling) and config.rope_scaling["rope_type"] == "longrope"
        self.original_max = _longrope_original(config) if longrope else None
        factor = rope_attention_factor(config)
        tables = [self._table(rope_inv_freq(config, long=long), factor) for long in ((False, True) if longrope else (False,))]
        self.register_buffer("cos", torch.cat([c for c, _ in tables]), persistent=False)
        self.register_buffer("sin", torch.cat([s for _, s in tables]), persistent=False)

    def _table(self, inv_freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(self.max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rot_dim]
        return emb.cos() * factor, emb.sin() * factor

    def bind(self, positions: torch.Tensor, like: torch.Tensor, meta: AttentionMetadata) -> Callable:
        """``rope(q, k)`` for this forward's tokens: the cache rows are gathered once and shared by every
        layer (torch path), or read by the fused kernel."""
        index = positions
        if self.original_max is not None:  # LongRoPE: the long cache for tokens of long sequences
            q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            seq_len = torch.repeat_interleave(meta.seq_lens, q_lens, output_size=positions.shape[0])
            index = positions + (seq_len > self.original_max).to(positions.dtype) * self.max_pos
        tables = None
        if not (fused_ops.use_fused(like) and self.rot_dim == self.head_dim):
            tables = fused_ops.rope_tables(index, self.cos, self.sin, like.dtype)
        return functools.partial(self.forward, index, tables=tables)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] cache rows; q: [T, heads, head_dim]; k: [T, kv_heads, head_dim] (rotated in place when fused)
        if tables is None:
            return fused_ops.rope(positions, q, k, self.cos, self.sin)
        if self.rot_dim == self.head_dim:
            return fused_ops.rope_with_tables(q, k, *tables)
        r = self.rot_dim
        q_rot, k_rot = fused_ops.rope_with_tables(q[..., :r], k[..., :r], *tables)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn = attn  # shared by all layers; not a module
        hd = self.head_dim = config.head_dim
        # rows: q | k | v of this rank's heads (kvforge.rank.parallel_state.head_shard)
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
        self.attn_layer = attn.layer(layer_idx, sliding_window=config.window_of(layer_idx))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rope: Callable,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``rope(q, k)``: :meth:`RotaryEmbedding.bind` for this forward's tokens."""
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.reshape(n, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = fused_ops.qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = rope(q, k)
        o = self.attn.forward(q, k, v, kv_cache, meta, self.attn_layer)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        # rows: gate | up (this rank's part of each)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2)
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))  # gate_up: [T, 2 * intermediate]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP. Subclasses override :attr:`attention_cls` and :meth:`make_mlp`."""

    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_cls(config, attn, layer_idx)
        self.mlp = self.make_mlp(config, layer_idx)
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

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it (``parallel_state.current_stage()``): the first
    stage embeds, the last one norms; layers outside the stage are ``MissingLayer``s, so parameter
    names keep their global layer index."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__()
        stage = parallel_state.current_stage()
        self.config = config
        self.start, self.end = stage.layers(config.num_hidden_layers)
        self.is_first, self.is_last = stage.is_first, stage.is_last
        # the last stage of a tied model computes its logits with the embedding
        wants_embed = stage.is_first or (stage.is_last and config.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if wants_embed else None
        self.layers = nn.ModuleList(self.layer_cls(config, attn, i) if self.start <= i < self.end else MissingLayer()
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
            hidden, residual = self.embed(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb.bind(positions, hidden, attn_meta)
        for i in range(self.start, self.end):
            hidden, residual = self.layers[i](positions, hidden, residual, rope, kv_caches[i - self.start], attn_meta)
        if not self.is_last:
            return hidden, residual
        return self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input embeddings (a family that scales them overrides this)."""
        return self.embed_tokens(input_ids)


def _moe_shards(param: nn.Parameter) -> list[tuple[int, str]]:
    """The (expert, projection) parts an MoE layer's parameter is loaded from; [] for other parameters."""
    layer = getattr(param, "weight_loader", None)
    moe = getattr(layer, "__self__", None)
    if not isinstance(moe, FusedMoE):
        return []
    parts = ("w1", "w3") if param is moe.w13 or param is moe.w13_bias else ("w2",)
    return [(e, s) for e in range(moe.num_experts) for s in parts]


class MissingLayer(nn.Identity):
    """A layer another pipeline stage holds."""


class LlamaForCausalLM(nn.Module):
    """The model plugin for LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM;
    the base of the other families' (they swap :attr:`model_cls` / its ``layer_cls`` and map their
    checkpoint names in :meth:`param_for`)."""

    #: fused module -> the checkpoint modules it holds (quantization formats name those)
    packed_modules_mapping = {fused: [m for m, (f, _) in STACKED_PARAMS.items() if f == fused]
                              for fused, _ in STACKED_PARAMS.values()}
    model_cls: type[nn.Module] = LlamaModel
    capabilities = ModelCapabilities(sliding_window=True, notes="Llama 2/3, Mistral, Qwen2, Qwen3")

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, attn)
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
            key = self.param_for(name, w)
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
            loaded.update(self._keys_filled(key, param))
        missing = [f"{n}[{s}]" if s is not None else n
                   for n, s in self._expected_keys() if (n, s) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {', '.join(missing[:20])}"
                             + (" ..." if len(missing) > 20 else ""))

    def param_for(self, name: str, w: torch.Tensor) -> tuple[str, Any]:
        """(parameter name, shard id) that the checkpoint tensor ``name`` loads into: fused Q/K/V and
        gate/up parts (:data:`STACKED_PARAMS`), each expert's projections of an MoE layer
        (``kvforge.layers.moe``), else the same name."""
        expert = EXPERT_NAME.match(name)
        if expert is not None and expert["proj"] in self.expert_projections:
            shard = self.expert_projections[expert["proj"]]
            param = f"{expert['experts']}.{'w13' if shard in ('w1', 'w3') else 'w2'}"
            return param + ("_bias" if expert["leaf"] == "bias" else ""), (int(expert["e"]), shard)
        module_path, _, leaf = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        if module_name in STACKED_PARAMS:
            fused, shard = STACKED_PARAMS[module_name]
            return f"{parent}.{fused}.{leaf}", shard
        return name, None

    #: an MoE checkpoint's per-expert projection names -> "w1" (gate), "w3" (up), "w2" (down)
    expert_projections: dict[str, str] = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def _keys_filled(self, key: tuple[str, Any], param: nn.Parameter) -> list[tuple[str, Any]]:
        """The expected keys one load fills (a stacked MoE tensor fills every expert's)."""
        if isinstance(key[1], tuple) and key[1][0] is None:
            return [(key[0], s) for s in _moe_shards(param)]
        if key[1] is None:  # a checkpoint that stores a fused parameter whole (Phi-3's qkv_proj, gate_up_proj)
            fused = key[0].rsplit(".", 2)[-2]
            return [(key[0], s) for f, s in STACKED_PARAMS.values() if f == fused] or [key]
        return [key]

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

    def _expected_keys(self) -> list[tuple[str, Any]]:
        keys: list[tuple[str, Any]] = []
        for name, p in self.named_parameters():
            if _moe_shards(p):
                keys.extend((name, s) for s in _moe_shards(p))
                continue
            fused = name.rsplit(".", 2)[-2]
            shards = [s for f, s in STACKED_PARAMS.values() if f == fused]
            if shards:
                keys.extend((name, s) for s in shards)
            else:
                keys.append((name, None))
        return keys
