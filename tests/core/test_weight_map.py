"""Weight loading as data (kvforge.layers.weight_map): each family's map sends checkpoint names to the
right parameter and shard, and the one loader fills fused and expert parameters, routes KV-cache scales,
skips what the model does not hold and names what the checkpoint left out."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvforge.layers import MergedColumnParallelLinear, QKVParallelLinear
from kvforge.layers.moe import FusedMoE
from kvforge.layers.weight_map import WeightMap, load_weights
from kvforge.plugins.models.gpt_oss import GptOssForCausalLM
from kvforge.plugins.models.llama import LLAMA_WEIGHTS, LlamaForCausalLM
from kvforge.plugins.models.mixtral import MixtralForCausalLM
from kvforge.plugins.models.phi3 import Phi3ForCausalLM


def test_each_family_maps_its_checkpoint_names():
    layer = "model.layers.3"
    llama = LlamaForCausalLM.weight_map
    assert llama.target(f"{layer}.self_attn.k_proj.weight") == (f"{layer}.self_attn.qkv_proj.weight", "k")
    assert llama.target(f"{layer}.mlp.up_proj.bias") == (f"{layer}.mlp.gate_up_proj.bias", 1)
    assert llama.target(f"{layer}.self_attn.o_proj.weight") == (f"{layer}.self_attn.o_proj.weight", None)
    assert llama.target(f"{layer}.mlp.experts.7.down_proj.weight") == (f"{layer}.mlp.experts.w2", (7, "w2"))
    assert llama.target(f"{layer}.mlp.experts.0.gate_proj.bias") == (f"{layer}.mlp.experts.w13_bias", (0, "w1"))
    assert llama.packed_modules() == {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                      "gate_up_proj": ["gate_proj", "up_proj"]}
    # Mixtral: its own module and projection names
    mixtral = MixtralForCausalLM.weight_map
    assert mixtral.target(f"{layer}.block_sparse_moe.experts.2.w3.weight") == (f"{layer}.mlp.experts.w13", (2, "w3"))
    assert mixtral.target(f"{layer}.block_sparse_moe.gate.weight") == (f"{layer}.mlp.gate.weight", None)
    # gpt-oss: experts stacked in one tensor per projection
    gpt_oss = GptOssForCausalLM.weight_map
    assert gpt_oss.target(f"{layer}.mlp.experts.gate_up_proj") == (f"{layer}.mlp.experts.w13", (None, "w13_interleaved"))
    assert gpt_oss.target(f"{layer}.mlp.experts.down_proj_bias") == (f"{layer}.mlp.experts.w2_bias",
                                                                      (None, "w2_transposed"))
    # Phi-3: the checkpoint stores the fused modules, nothing is packed
    phi3 = Phi3ForCausalLM.weight_map
    assert phi3.target(f"{layer}.self_attn.qkv_proj.weight") == (f"{layer}.self_attn.qkv_proj.weight", None)
    assert phi3.packed_modules() == {}


class Block(nn.Module):
    """A fused QKV and gate/up layer and an MoE layer, named as a decoder layer's modules."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(8, 2, num_heads=2, num_kv_heads=1)
        self.gate_up_proj = MergedColumnParallelLinear(8, [4, 4])
        self.experts = FusedMoE(3, 2, hidden_size=8, intermediate_size=4)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block()])


class Scales:
    def __init__(self):
        self.got: dict[int, dict] = {}

    def set_kv_scales(self, layer, *, k_scale=None, v_scale=None):
        self.got[layer] = {"k_scale": k_scale, "v_scale": v_scale}


def checkpoint(drop: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """Block's checkpoint, HF-named per projection and per expert (less ``drop``)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (4, 8), "k_proj": (2, 8), "v_proj": (2, 8), "gate_proj": (4, 8), "up_proj": (4, 8)}
    tensors = [(f"layers.0.{m}.weight", torch.randn(s, generator=g)) for m, s in shapes.items()]
    for e in range(3):
        tensors += [(f"layers.0.experts.{e}.{m}.weight", torch.randn(s, generator=g))
                    for m, s in (("gate_proj", (4, 8)), ("up_proj", (4, 8)), ("down_proj", (8, 4)))]
    return [(n, w) for n, w in tensors if n != drop]


MAP = WeightMap(fused=LLAMA_WEIGHTS.fused, expert_projections=LLAMA_WEIGHTS.expert_projections,
                layers_prefix="layers.")


def test_load_weights_fills_fused_and_expert_parameters():
    model, tensors = Tiny(), dict(checkpoint())
    with torch.no_grad():
        load_weights(model, tensors.items(), MAP)
    block = model.layers[0]
    assert torch.equal(block.qkv_proj.weight, torch.cat([tensors[f"layers.0.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(block.gate_up_proj.weight[4:], tensors["layers.0.up_proj.weight"])
    assert torch.equal(block.experts.w13[2, :4], tensors["layers.0.experts.2.gate_proj.weight"])
    assert torch.equal(block.experts.w2[1], tensors["layers.0.experts.1.down_proj.weight"])


def test_load_weights_names_a_missing_shard_or_expert():
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): layers\.0\.qkv_proj\.weight\[v\]$"):
        load_weights(Tiny(), checkpoint(drop="layers.0.v_proj.weight"), MAP)
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): layers\.0\.experts\.w13\[\(1, 'w3'\)\]$"):
        load_weights(Tiny(), checkpoint(drop="layers.0.experts.1.up_proj.weight"), MAP)
    with pytest.raises(ValueError, match="'layers.0.bogus.weight' has no matching parameter in Tiny"):
        load_weights(Tiny(), [*checkpoint(), ("layers.0.bogus.weight", torch.ones(1))], MAP)


def test_a_fused_checkpoint_tensor_fills_every_shard_and_scales_go_to_the_sink():
    qkv = ("layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.0.v_proj.weight")
    tensors = checkpoint()
    fused = torch.cat([w for n, w in tensors if n in qkv])
    others = [("layers.0.qkv_proj.weight", fused), ("layers.0.self_attn.k_scale", torch.tensor(0.5)),
              ("layers.0.rotary_emb.inv_freq", torch.ones(1)), ("elsewhere.weight", torch.ones(1))]
    sink, model = Scales(), Tiny()
    with torch.no_grad():
        load_weights(model, [*(t for t in tensors if t[0] not in qkv), *others], MAP,
                     holds=lambda name: not name.startswith("elsewhere."), kv_scales=sink)
    assert torch.equal(model.layers[0].qkv_proj.weight, fused)
    assert sink.got[0]["k_scale"] == 0.5 and sink.got[0]["v_scale"] is None
    with pytest.raises(ValueError, match="KV-cache scale and Tiny takes none"):
        load_weights(Tiny(), [("layers.0.self_attn.kv_scale", torch.tensor(1.0))], MAP)
