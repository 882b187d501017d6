"""Tiny EAGLE-1 and EAGLE-3 head checkpoints in their published layouts (config.json and safetensors, as
vLLM and SGLang load them), and tiny Llama targets built offline by transformers: shared by the EAGLE
tests and ``benchmarks/spec_eagle.py``.

Besides random heads, two kinds of known behaviour: an *identity target* whose layers add nothing, so
its greedy next token is a fixed permutation ``perm`` of the current one (its LM head's row for
``perm(x)`` is ``x``'s embedding), and heads built for it: an EAGLE-1 head that reproduces it exactly
(``fc`` passes the embedding through, the layer adds nothing, the target's LM head does the rest), and
an EAGLE-3 head whose first draft is right (its LM head's row for ``perm(perm(x))`` is ``x``'s embedding).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

TARGET: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                              rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
                              pad_token_id=None, tie_word_embeddings=False)


def build_target(path: str, seed: int = 0, identity: bool = False, **fields: Any) -> transformers.PreTrainedModel:
    """A tiny random Llama saved at ``path`` (float32); ``identity``: its layers add nothing and its greedy
    next token is :func:`perm` of the current one."""
    config = transformers.LlamaConfig(**{**TARGET, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        if identity:
            embed = torch.nn.functional.normalize(torch.randn_like(model.model.embed_tokens.weight), dim=-1)
            model.model.embed_tokens.weight.copy_(embed)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.model.norm.weight.fill_(1.0)
            model.lm_head.weight.copy_(embed[inverse(perm(config.vocab_size))])  # row perm(x) is x's embedding
    model.save_pretrained(path, safe_serialization=True)
    return model


def perm(vocab: int) -> torch.Tensor:
    """The identity target's next token of each token: a fixed permutation of the vocabulary."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))


def inverse(p: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(p)
    out[p] = torch.arange(len(p))
    return out


def _layer_config(target: Any, **extra: Any) -> dict[str, Any]:
    """config.json fields of a head layer shaped like ``target`` (a transformers config, or a kvforge
    ``ModelConfig``)."""
    rope = getattr(target, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return {"model_type": "llama", "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
            "num_attention_heads": target.num_attention_heads, "num_key_value_heads": target.num_key_value_heads,
            "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": theta or getattr(target, "rope_theta", 10000.0),
            "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
            "tie_word_embeddings": False, "torch_dtype": "float32", **extra}  # (extra may name another dtype)


def _layer_tensors(prefix: str, c: Any, qkv_in: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size

    def rand(*shape: int) -> torch.Tensor:  # scaled by fan-in: a large random head's activations stay finite
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
    return {f"{prefix}self_attn.q_proj.weight": rand(c.num_attention_heads * hd, qkv_in),
            f"{prefix}self_attn.k_proj.weight": rand(c.num_key_value_heads * hd, qkv_in),
            f"{prefix}self_attn.v_proj.weight": rand(c.num_key_value_heads * hd, qkv_in),
            f"{prefix}self_attn.o_proj.weight": rand(h, c.num_attention_heads * hd),
            f"{prefix}mlp.gate_proj.weight": rand(inter, h), f"{prefix}mlp.up_proj.weight": rand(inter, h),
            f"{prefix}mlp.down_proj.weight": rand(h, inter),
            f"{prefix}post_attention_layernorm.weight": 1 + rand(h)}


def write_eagle3_head(path: str, target: Any, *, draft_vocab: int = 96, seed: int = 0,
                      aux_layer_ids: list[int] | None = None, own_embedding: bool = False,
                      first_draft_right: bool = False, target_model: Any = None,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head for a target of config ``target``: ``midlayer.*``, ``fc`` (3 x hidden -> hidden),
    ``norm``, ``lm_head`` over ``draft_vocab`` tokens (a random subset of the target's, sorted) with
    ``d2t`` / ``t2d``. ``first_draft_right`` (an identity ``target_model``): its first draft is the
    target's greedy continuation. Returns the tensors written."""
    gen = torch.Generator().manual_seed(seed)
    h, vocab = target.hidden_size, target.vocab_size
    keep = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values  # the draft vocabulary
    if first_draft_right:  # every target token in it: the first draft is always representable
        keep = torch.arange(vocab)
        draft_vocab = vocab
    t = _layer_tensors("midlayer.", target, 2 * h, gen)
    t.update({"midlayer.input_layernorm.weight": 1 + torch.randn(h, generator=gen) * 0.1,
              "midlayer.hidden_norm.weight": 1 + torch.randn(h, generator=gen) * 0.1,
              "fc.weight": torch.randn(h, 3 * h, generator=gen) * (3 * h) ** -0.5,
              "norm.weight": 1 + torch.randn(h, generator=gen) * 0.1,
              "lm_head.weight": torch.randn(draft_vocab, h, generator=gen) * h ** -0.5,
              "d2t": keep - torch.arange(draft_vocab), "t2d": torch.isin(torch.arange(vocab), keep)})
    if own_embedding:
        t["embed_tokens.weight"] = torch.randn(vocab, h, generator=gen) * 0.1
    if first_draft_right:
        embed = target_model.model.embed_tokens.weight.detach()
        t["midlayer.self_attn.o_proj.weight"].zero_()
        t["midlayer.mlp.down_proj.weight"].zero_()
        t["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, 2 * h)], dim=1)  # the first captured state
        t["norm.weight"] = torch.ones(h)
        p = perm(vocab)
        t["lm_head.weight"] = embed[inverse(p)[inverse(p)]].clone()  # row perm(perm(x)) is x's embedding
    extra: dict[str, Any] = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                             "draft_vocab_size": draft_vocab, "target_hidden_size": h}
    if aux_layer_ids is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    t = {k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()}
    _save(path, _layer_config(target, torch_dtype=str(dtype).removeprefix("torch."), **extra), t)
    return t


def write_eagle1_head(path: str, target: Any, *, seed: int = 0, num_layers: int = 1, fc_bias: bool = False,
                      reproduce: bool = False) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head: ``fc`` ([embed; hidden] -> hidden), ``layers.N.*`` (layer 0 without
    ``input_layernorm``), no LM head. ``reproduce`` (for an identity target): its drafts are the target's
    greedy continuation."""
    gen = torch.Generator().manual_seed(seed)
    h = target.hidden_size
    t: dict[str, torch.Tensor] = {"fc.weight": torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5}
    if fc_bias:
        t["fc.bias"] = torch.randn(h, generator=gen) * 0.1
    for i in range(num_layers):
        t.update(_layer_tensors(f"layers.{i}.", target, h, gen))
        if i:
            t[f"layers.{i}.input_layernorm.weight"] = 1 + torch.randn(h, generator=gen) * 0.1
    if reproduce:
        t["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # the embedding passes through
        t.pop("fc.bias", None)
        for i in range(num_layers):
            t[f"layers.{i}.self_attn.o_proj.weight"].zero_()
            t[f"layers.{i}.mlp.down_proj.weight"].zero_()
    _save(path, _layer_config(target, architectures=["LlamaForCausalLM"], num_hidden_layers=num_layers,
                              bias=fc_bias and not reproduce), t)
    return t


def _save(path: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
