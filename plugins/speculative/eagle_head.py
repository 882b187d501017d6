"""EAGLE and EAGLE-3 draft heads: their checkpoints' config and weights, and their forward.

A head is a decoder layer (or a few, EAGLE-1) that reads the target's hidden states beside the
embedding of the next token, and never a second full model:

- **EAGLE-1** (SafeAILab/EAGLE, vLLM's ``llama_eagle.py``): ``fc`` maps ``[embed(token); hidden]``
  (2 x hidden) to hidden, then Llama decoder layers (the first without ``input_layernorm``), no final
  norm; logits from the target's LM head. ``hidden`` is the target's final normed state, later the
  head's own output. Tensors ``fc.weight`` (``fc.bias`` where trained with one), ``layers.N.*``.
- **EAGLE-3** (vLLM's ``llama_eagle3.py``, SGLang's ``llama_eagle3.py``): ``fc`` maps the concatenation
  of three target layers' states (3 x target hidden) to hidden once, for the target's rows; then one
  layer ``midlayer.*`` whose attention reads ``[input_layernorm(embed(token)); hidden_norm(hidden)]``
  (q/k/v 2 x hidden wide) with the hidden state as its residual, a final ``norm`` and an ``lm_head``
  over a draft vocabulary of ``draft_vocab_size`` tokens; ``d2t[i]`` is draft id i's offset to its
  target id (``t2d``, the inverse mask, is only read for its shape). Later draft steps feed the head's
  own pre-norm output back. ``norm_before_residual`` (config) takes the residual after ``hidden_norm``.
  Which target layers: the config's ``eagle_aux_hidden_state_layer_ids``, else vLLM's default
  (2, L // 2, L - 3) of a target of L layers.

Both take the target's embeddings unless the checkpoint has ``embed_tokens.weight``. The speculators
layout (``transformer_layer_config`` in config.json, the layer as ``layers.0.*``) loads too.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.layers import ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, VocabParallelEmbedding
from kvforge.layers.vocab import vocab_parallel_logits
from kvforge.layers.weight_map import WeightMap, load_weights
from kvforge.model.config import ModelConfig, hf_fields
from kvforge.plugins.models.llama import (
    LLAMA_WEIGHTS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    RotaryEmbedding,
)

#: checkpoint names -> the head's: the EAGLE-3 layer is ``layers.0`` here, q/k/v and gate/up fused
HEAD_WEIGHTS = WeightMap(fused=LLAMA_WEIGHTS.fused, renames=(("midlayer.", "layers.0."),), layers_prefix="layers.")
#: tensors that are no parameter of the head (read apart, or not at all)
MAPPING_TENSORS = ("d2t", "t2d")


@dataclass(frozen=True)
class EagleHeadConfig:
    """What a head's config.json says."""

    version: int  # 1 (EAGLE) or 3 (EAGLE-3)
    layer: ModelConfig  # its decoder layer's shapes, RoPE and norms (vocab_size: the target's vocabulary)
    num_layers: int
    target_hidden_size: int  # the width of each target state it reads
    draft_vocab_size: int  # EAGLE-3: its LM head's rows (layer.vocab_size without a draft vocabulary)
    aux_layer_ids: tuple[int, ...] | None  # EAGLE-3: the target layers it reads, if the config names them
    norm_before_residual: bool = False
    fc_bias: bool = False  # EAGLE-1

    def target_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layer ids it reads (``kvforge.model.hidden_capture`` ids): EAGLE-1 the final
        normed states; EAGLE-3 three intermediate ones (``ValueError`` when the default does not fit)."""
        L = num_target_layers
        if self.version == 1:
            return (L,)
        ids = self.aux_layer_ids or (2, L // 2, L - 3)
        if len(ids) != 3 or not all(0 <= i <= L for i in ids):
            raise ValueError(f"speculative_config: model: eagle_aux_hidden_state_layer_ids {list(ids)} must be three "
                             f"target layer ids in 0..{L} (the target has {L} layers; set them in the head's config.json)")
        return tuple(ids)


def read_head_config(path: str, version: int) -> EagleHeadConfig:
    """The head config at ``path`` (a directory with config.json); ``ValueError`` naming what is wrong."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"speculative_config: model: {path!r} is no EAGLE head checkpoint (no config.json)")
    with open(file) as f:
        raw: dict[str, Any] = json.load(f)
    d = dict(raw)
    if isinstance(raw.get("transformer_layer_config"), dict):  # the speculators layout
        d = {**raw["transformer_layer_config"], **{k: v for k, v in raw.items() if k != "transformer_layer_config"}}
    arch = (d.get("architectures") or ["LlamaForCausalLMEagle3" if version == 3 else "EagleLlamaForCausalLM"])[0]
    try:
        layer = ModelConfig(**hf_fields({"model_type": "llama", **d}, arch))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"speculative_config: model: {file}: missing or bad field {exc}") from None
    num_layers = int(d.get("num_hidden_layers", 1))
    if version == 3 and num_layers != 1:
        raise ValueError(f"speculative_config: model: an EAGLE-3 head has one decoder layer, {file} says "
                         f"num_hidden_layers={num_layers}")
    ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return EagleHeadConfig(version=version, layer=layer, num_layers=num_layers,
                           target_hidden_size=int(d.get("target_hidden_size") or layer.hidden_size),
                           draft_vocab_size=int(d.get("draft_vocab_size") or layer.vocab_size),
                           aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
                           norm_before_residual=bool(d.get("norm_before_residual", False)),
                           fc_bias=bool(d.get("bias", False)))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over ``[input_layernorm(embeds); hidden_norm(hidden)]``, the
    hidden state as the residual, then Llama's MLP."""

    def __init__(self, config: ModelConfig, attn: AttentionBackend, norm_before_residual: bool):
        super().__init__()
        h = config.hidden_size
        self.self_attn = LlamaAttention(config, attn, 0)
        # q/k/v read the embedding and the hidden state side by side
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, config.head_dim, config.num_attention_heads,
                                                    config.num_key_value_heads, bias=config.attention_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, rope: Any,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden: [T, hidden] -> (the MLP's output, the residual stream before it is added)."""
        normed = self.hidden_norm(hidden)
        # NOTE: a fresh tensor: the fused norm below adds into the residual in place
        residual = normed.clone() if self.norm_before_residual else hidden.clone()
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2 * hidden]
        out = self.self_attn(positions, x, rope, kv_cache, meta)
        out, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(out), residual


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head on its own attention backend (one KV cache per layer). ``embed`` and,
    for EAGLE-1, ``target_logits`` are the target's unless the head has its own (:meth:`share`)."""

    draft_to_target: torch.Tensor  # [draft vocabulary] int64 target ids (EAGLE-3; a buffer)

    def __init__(self, hc: EagleHeadConfig, attn: AttentionBackend, own_embedding: bool):
        super().__init__()
        c, h = hc.layer, hc.layer.hidden_size
        self.version = hc.version
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, h) if own_embedding else None
        self.embed: Callable[[torch.Tensor], torch.Tensor] | None = self.embed_tokens
        self.target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rotary_emb = RotaryEmbedding(c)
        if hc.version == 3:
            self.fc = ColumnParallelLinear(3 * hc.target_hidden_size, h)
            self.layers = nn.ModuleList([Eagle3Layer(c, attn, hc.norm_before_residual)])
            self.norm = RMSNorm(h, c.rms_norm_eps)
            self.lm_head = ParallelLMHead(hc.draft_vocab_size, h)
            # draft id -> target id (arange + the checkpoint's d2t offsets)
            self.register_buffer("draft_to_target", torch.arange(hc.draft_vocab_size), persistent=False)
        else:
            self.fc = ColumnParallelLinear(2 * h, h, bias=hc.fc_bias)
            self.layers = nn.ModuleList(LlamaDecoderLayer(c, attn, i) for i in range(hc.num_layers))
            self.layers[0].input_layernorm = nn.Identity()  # (EAGLE-1's first layer has none)

    def share(self, embed: Callable[[torch.Tensor], torch.Tensor] | None,
              target_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The target's embedding (unless the head has its own) and LM head (EAGLE-1's logits)."""
        if self.embed_tokens is None:
            self.embed = embed
        self.target_logits = target_logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata, from_target: bool) -> torch.Tensor:
        """input_ids, positions: [T]; hidden: [T, 3 * target hidden] (EAGLE-3, ``from_target``: the
        target's captured states) or [T, hidden] (the head's own output, or EAGLE-1's target state)
        -> the head's pre-norm output [T, hidden], which the next draft step reads back."""
        if self.embed is None:
            raise RuntimeError("EAGLE head: no embedding (share() was not called)")
        embeds = self.embed(input_ids)  # [T, hidden]
        rope = self.rotary_emb.bind(positions, embeds, meta)
        if self.version == 3:
            if from_target:
                hidden = self.fc(hidden)  # [T, hidden]
            out, residual = self.layers[0](positions, embeds, hidden, rope, kv_caches[0], meta)
            return out + residual
        x: torch.Tensor = self.fc(torch.cat([embeds, hidden], dim=-1))  # [T, hidden]
        res: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, res = layer(positions, x, res, rope, kv_caches[i], meta)
        return x if res is None else x + res

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits over the head's vocabulary (EAGLE-3: the draft vocabulary, mapped
        to target ids by :attr:`draft_to_target`; EAGLE-1: the target's, through its LM head)."""
        if self.version == 3:
            return vocab_parallel_logits(self.norm(prenorm), self.lm_head)
        if self.target_logits is None:
            raise RuntimeError("EAGLE head: no LM head (share() was not called)")
        return self.target_logits(prenorm).float()

    @torch.no_grad()
    def load(self, weights: Mapping[str, torch.Tensor], target_vocab: int) -> None:
        """Fill the head from its checkpoint's tensors (``ValueError`` on unknown, missing or misshapen ones)."""
        d2t = weights.get("d2t")
        if self.version == 3 and d2t is not None:
            mapped = torch.arange(len(d2t)) + d2t.long()
            if d2t.shape != self.draft_to_target.shape or mapped.min() < 0 or mapped.max() >= target_vocab:
                raise ValueError(f"EAGLE head: d2t must hold {len(self.draft_to_target)} offsets to target ids below "
                                 f"{target_vocab}, got shape {tuple(d2t.shape)}")
            self.draft_to_target.copy_(mapped)
        t2d = weights.get("t2d")
        if t2d is not None and t2d.shape != (target_vocab,):
            raise ValueError(f"EAGLE head: t2d must have one entry per target token ({target_vocab}), got "
                             f"{tuple(t2d.shape)}")
        own = ((name, w) for name, w in weights.items() if name not in MAPPING_TENSORS
               and not (self.embed_tokens is None and name == "embed_tokens.weight")
               and not (self.version == 1 and name == "layers.0.input_layernorm.weight"))
        load_weights(self, own, HEAD_WEIGHTS)


def checkpoint_tensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the head's names (a ``model.`` prefix dropped)."""
    return {name.removeprefix("model."): w for name, w in weights.items()}
