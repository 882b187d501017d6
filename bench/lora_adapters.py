"""Random PEFT LoRA adapters of any model shape, written without ``peft`` (the GPU benchmark and GPU tests
use them; ``peft`` is not on the GPU machine)."""
from __future__ import annotations

import json
import os
from typing import Any

#: the projections every adapter targets (HF names)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(mc: Any) -> dict[str, tuple[str, int, int]]:
    """``{projection: (block, in_features, out_features)}`` of one decoder layer of ``mc`` (a ``ModelConfig``)."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    h, i = mc.hidden_size, mc.intermediate_size
    return {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i),
            "down_proj": ("mlp", i, h)}


def write_adapter(path: str, mc: Any, rank: int, alpha: int, seed: int, base_model: str) -> None:
    """A random PEFT LoRA directory for ``mc``: rank ``rank`` on every projection of every layer, bf16."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(PROJECTIONS),
              "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    layers = mc.num_hidden_layers
    tensors = {}
    for proj, (block, n_in, n_out) in projection_shapes(mc).items():
        # one draw per projection for all layers (hundreds of small ones are slow on a busy CPU); A keeps x's
        # scale (x A^T), B makes the delta a small fraction of the base output's
        a = (torch.randn(layers, rank, n_in, generator=gen) / n_in ** 0.5).bfloat16()  # [layers, r, in]
        b = (torch.randn(layers, n_out, rank, generator=gen) * (0.05 / rank ** 0.5)).bfloat16()  # [layers, out, r]
        for layer in range(layers):
            name = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            # clone: safetensors refuses tensors that share storage
            tensors[f"{name}.lora_A.weight"] = a[layer].clone()
            tensors[f"{name}.lora_B.weight"] = b[layer].clone()
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
