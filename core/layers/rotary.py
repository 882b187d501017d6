"""Rotary position embeddings: the scaling variants and the cos/sin cache they fill.

A config's ``rope_scaling`` dict (Hugging Face's, ``rope_type`` plus its parameters; None: plain RoPE)
selects a variant from :data:`ROPE_VARIANTS`, each computing the inverse frequencies as transformers'
``modeling_rope_utils`` does, so that logits match it to float noise:

- ``default``: ``theta ** (-2i / dim)``;
- ``linear``: divided by ``factor`` (position interpolation; Gemma 3's global layers);
- ``llama3``: Llama 3.1's smooth blend of scaled low and unscaled high frequencies;
- ``yarn``: YaRN's ramp between interpolation and extrapolation, with an attention factor (gpt-oss);
- ``longrope``: short and long factors per frequency, with an attention factor; the long ones from
  ``original_max_position_embeddings`` on (Phi-3, Phi-4);
- ``freq_factors``: a GGUF file's ``rope_freqs`` tensor, one divisor per frequency (llama.cpp's form of
  Llama 3.1's scaling).

``dynamic`` (NTK scaling recomputed per sequence length) is refused by name. :class:`RotaryCache` holds
the float32 tables a model's layers share; applying them (neox style, the fused kernel where it runs)
is the model's (``kvforge.plugins.models.llama.RotaryEmbedding``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from kvforge.attention import AttentionMetadata
from kvforge.model.config import ModelConfig

#: HF's rope scaling dict: "rope_type" and the variant's parameters (JSON values from config.json)
RopeScaling = dict[str, Any]


def rotary_dim(config: ModelConfig) -> int:
    """How many leading dims of each head RoPE rotates (all but with ``partial_rotary_factor``)."""
    return int(config.head_dim * config.partial_rotary_factor)


def rope_type(config: ModelConfig) -> str:
    """The config's variant: ``rope_scaling["rope_type"]``, "default" without scaling."""
    return str(config.rope_scaling["rope_type"]) if config.rope_scaling else "default"


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim // 2]


def _default(config: ModelConfig, rs: RopeScaling, long: bool) -> torch.Tensor:
    return 1.0 / (config.rope_theta ** _exponents(rotary_dim(config)))


def _linear(config: ModelConfig, rs: RopeScaling, long: bool) -> torch.Tensor:
    return _default(config, rs, long) / float(rs["factor"])


def _freq_factors(config: ModelConfig, rs: RopeScaling, long: bool) -> torch.Tensor:
    """llama.cpp divides each frequency by the file's ``rope_freqs`` value."""
    return _default(config, rs, long) / torch.tensor(rs["factors"], dtype=torch.float32)


def _llama3(config: ModelConfig, rs: RopeScaling, long: bool) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters``."""
    inv_freq = _default(config, rs, long)
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs.get("original_max_position_embeddings", config.max_position_embeddings))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_factor(config: ModelConfig, rs: RopeScaling) -> float:
    original = rs.get("original_max_position_embeddings", config.max_position_embeddings)
    return float(rs.get("factor") or config.max_position_embeddings / original)


def _yarn(config: ModelConfig, rs: RopeScaling, long: bool) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters``."""
    dim, base, factor = rotary_dim(config), config.rope_theta, _yarn_factor(config, rs)
    old_ctx = float(rs.get("original_max_position_embeddings") or config.max_position_embeddings)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs.get("beta_fast") or 32), correction_dim(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = (high + 0.001 if low == high else high) - low
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / span, 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope(config: ModelConfig, rs: RopeScaling, long: bool) -> torch.Tensor:
    """transformers' ``_compute_longrope_parameters``: the short or the long factors."""
    factors = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * config.rope_theta ** _exponents(rotary_dim(config)))


#: rope_type -> inverse frequencies [rotary_dim // 2] float32 of (config, its rope_scaling, long factors)
ROPE_VARIANTS: dict[str, Callable[[ModelConfig, RopeScaling, bool], torch.Tensor]] = {
    "default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope,
    "freq_factors": _freq_factors,
}


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32 of the config's variant; ``long``: LongRoPE's long
    factors. ``ValueError`` naming a variant kvforge does not compute."""
    variant = ROPE_VARIANTS.get(rope_type(config))
    if variant is None:
        raise ValueError(f"model config field 'rope_scaling' has rope_type {rope_type(config)!r}; supported: "
                         f"{', '.join(ROPE_VARIANTS)}")
    return variant(config, config.rope_scaling or {}, long)


def longrope_original(config: ModelConfig) -> int:
    """The context LongRoPE's short factors cover (its long ones take over past it)."""
    rs = config.rope_scaling or {}
    return int(rs.get("original_max_position_embeddings")
               or config.hf_config.get("original_max_position_embeddings") or config.max_position_embeddings)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (YaRN, LongRoPE), else 1."""
    rs = config.rope_scaling
    if not rs:
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if rs["rope_type"] == "yarn":
        factor = _yarn_factor(config, rs)
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")

        def get(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        return get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
    if rs["rope_type"] == "longrope":
        original = longrope_original(config)
        factor = float(rs.get("factor") or config.max_position_embeddings / original)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


class RotaryCache(nn.Module):
    """The float32 cos/sin cache of a config's RoPE, ``[max_position_embeddings, rotary_dim]`` each, times
    the variant's attention factor, indexed by absolute position. LongRoPE keeps a second (long-factor)
    table after the first: :meth:`rows` sends a token whose sequence is longer than
    ``original_max_position_embeddings`` after this step there, as transformers switches factors on
    the sequence length."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim, self.rot_dim = config.head_dim, rotary_dim(config)
        self.max_pos = config.max_position_embeddings
        longrope = rope_type(config) == "longrope"
        self.original_max = longrope_original(config) if longrope else None
        factor = rope_attention_factor(config)
        tables = [self._table(rope_inv_freq(config, long=long), factor) for long in ((False, True) if longrope else (False,))]
        self.register_buffer("cos", torch.cat([c for c, _ in tables]), persistent=False)
        self.register_buffer("sin", torch.cat([s for _, s in tables]), persistent=False)

    def _table(self, inv_freq: torch.Tensor, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(self.max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rot_dim]
        return emb.cos() * factor, emb.sin() * factor

    def rows(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The cache rows of this forward's tokens, [T] int64: their positions, or for LongRoPE past the
        switch the long table's rows."""
        if self.original_max is None:
            return positions
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        seq_len = torch.repeat_interleave(meta.seq_lens, q_lens, output_size=positions.shape[0])
        return positions + (seq_len > self.original_max).to(positions.dtype) * self.max_pos
