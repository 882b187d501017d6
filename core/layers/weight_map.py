"""Weight loading as data: where each checkpoint tensor of a model goes.

A model class declares a :class:`WeightMap` (which checkpoint modules its fused layers hold and as which
shard, how its checkpoints name experts, what to rename or skip) and :func:`load_weights` reads it: each
tensor goes to its parameter's own loader (``kvforge.layers.weights``) with its shard id, the FP8 KV-cache
scales to the attention backend, and whatever the checkpoint left unfilled is named in a ``ValueError``.
A family that names its tensors differently changes the data, not the loading code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol, runtime_checkable

import torch
from torch import nn

from kvforge.layers.weights import ShardId, loader_of

#: FP8 KV-cache scales, the name after ``model.layers.N.`` -> keywords of ``set_kv_scales`` (compressed-tensors;
#: older checkpoints use the K/V projections' output_scale; AutoFP8 one scale for both)
KV_SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "self_attn.k_scale": ("k_scale",), "self_attn.v_scale": ("v_scale",),
    "self_attn.k_proj.output_scale": ("k_scale",), "self_attn.v_proj.output_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
}
#: checkpoint tensors that hold nothing to load (RoPE buffers, recomputed)
ROPE_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
#: one expert's projection of an MoE layer: "model.layers.3.mlp.experts.7.gate_proj.weight", or a quantized
#: checkpoint's scale of it ("...gate_proj.weight_scale_inv": the FusedMoE parameter ``w13_weight_scale_inv``)
EXPERT_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\."
                         r"(?P<leaf>weight|bias|weight_scale|weight_scale_inv)$")


class KVScaleSink(Protocol):
    """Where a checkpoint's FP8 KV-cache scales go (``kvforge.attention.AttentionBackend``)."""

    def set_kv_scales(self, layer: int, *, k_scale: float | torch.Tensor | None = None,
                      v_scale: float | torch.Tensor | None = None) -> None: ...


@runtime_checkable
class ShardedLayer(Protocol):
    """A layer whose loader fills one parameter from many checkpoint tensors (an MoE layer's experts)."""

    def checkpoint_shards(self, param: nn.Parameter) -> list[ShardId]: ...


@dataclass(frozen=True)
class WeightMap:
    """Where a model's checkpoint tensors go; see the module docstring."""

    #: checkpoint module -> (the fused module holding it, its shard id there): ``{"q_proj": ("qkv_proj",
    #: "q"), ...}``; a checkpoint that stores the fused module itself loads it whole (shard None)
    fused: Mapping[str, tuple[str, ShardId]] = field(default_factory=dict)
    #: (checkpoint text, model text) replaced in every name before it is matched (``.block_sparse_moe.``
    #: -> ``.mlp.``)
    renames: tuple[tuple[str, str], ...] = ()
    #: an MoE checkpoint's per-expert projection -> the FusedMoE shard: "w1" (gate), "w3" (up), "w2" (down)
    expert_projections: Mapping[str, str] = field(default_factory=dict)
    #: a stacked expert tensor (the leaf after ``.experts.``) -> (FusedMoE parameter, how its loader reads it)
    stacked_experts: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: name suffixes of checkpoint tensors to skip
    ignored_suffixes: tuple[str, ...] = ROPE_BUFFERS
    #: the prefix of a decoder layer's tensors (``<prefix><N>.``), where KV-cache scales are looked for
    layers_prefix: str = "model.layers."
    kv_scales: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(KV_SCALE_NAMES))

    def packed_modules(self) -> dict[str, list[str]]:
        """Fused module -> the checkpoint modules it holds (what quantization formats name)."""
        packed: dict[str, list[str]] = {}
        for module, (fused, _) in self.fused.items():
            packed.setdefault(fused, []).append(module)
        return packed

    def target(self, name: str) -> tuple[str, ShardId]:
        """(parameter name, shard id) that the checkpoint tensor ``name`` loads into: a fused layer's part,
        an expert's projection or a stacked expert tensor of an MoE layer, else the same name (shard None)."""
        for old, new in self.renames:
            name = name.replace(old, new)
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in self.stacked_experts:
            param, kind = self.stacked_experts[leaf]
            return f"{prefix}.{param}", (None, kind)
        expert = EXPERT_NAME.match(name)
        if expert is not None and expert["proj"] in self.expert_projections:
            shard = self.expert_projections[expert["proj"]]
            param = f"{expert['experts']}.{'w13' if shard in ('w1', 'w3') else 'w2'}"
            leaf = expert["leaf"]
            return param + ("" if leaf == "weight" else f"_{leaf}"), (int(expert["e"]), shard)
        parent, _, module = prefix.rpartition(".")
        if module in self.fused:
            fused, shard = self.fused[module]
            return f"{parent}.{fused}.{leaf}", shard
        return name, None

    def kv_scale(self, name: str) -> tuple[int, tuple[str, ...]] | None:
        """(layer, ``set_kv_scales`` keywords) if ``name`` is an FP8 KV-cache scale, else None."""
        if not name.startswith(self.layers_prefix):
            return None
        layer, _, rest = name[len(self.layers_prefix):].partition(".")
        keywords = self.kv_scales.get(rest)
        return None if keywords is None or not layer.isdigit() else (int(layer), keywords)

    def shards_of(self, param_name: str, param: nn.Parameter) -> list[ShardId]:
        """The shard ids a checkpoint fills ``param`` from, one tensor each: an MoE layer's (expert,
        projection) pairs, a fused layer's parts, else [None] (one tensor)."""
        owner = getattr(loader_of(param), "__self__", None)
        if isinstance(owner, ShardedLayer):
            return owner.checkpoint_shards(param)
        module = param_name.rsplit(".", 2)[-2] if param_name.count(".") >= 1 else ""
        shards = [shard for fused, shard in self.fused.values() if fused == module]
        return shards or [None]

    def filled(self, param_name: str, shard: ShardId, param: nn.Parameter) -> list[tuple[str, ShardId]]:
        """The (parameter, shard) keys one load fills: a whole fused tensor (shard None) or a stacked
        expert tensor ((None, kind)) fills all of the parameter's shards."""
        if shard is None or (isinstance(shard, tuple) and shard[0] is None):
            return [(param_name, s) for s in self.shards_of(param_name, param)]
        return [(param_name, shard)]


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], weight_map: WeightMap, *,
                 holds: Callable[[str], bool] = lambda name: True, kv_scales: KVScaleSink | None = None) -> None:
    """Copy HF-named checkpoint tensors into ``model``'s parameters as ``weight_map`` says, each through
    its parameter's loader (which keeps this rank's part). ``holds(name)``: whether the model holds that
    tensor at all (False: skipped, e.g. another pipeline stage's layers or a tied LM head); ``kv_scales``
    receives the FP8 KV-cache scales. ``ValueError`` on an unknown name, a shape mismatch, or parameters
    (or shards of them) left unfilled."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, ShardId]] = set()
    for name, w in weights:
        if name.endswith(weight_map.ignored_suffixes) or not holds(name):
            continue
        scale = weight_map.kv_scale(name)
        if scale is not None:
            if kv_scales is None:
                raise ValueError(f"checkpoint weight {name!r} is a KV-cache scale and {type(model).__name__} "
                                 "takes none")
            layer, keywords = scale
            kv_scales.set_kv_scales(layer, **{k: w for k in keywords})
            continue
        param_name, shard = weight_map.target(name)
        param = params.get(param_name)
        if param is None and name.endswith(".bias") and not w.any():
            continue  # an all-zero bias some quantizers save (AutoGPTQ's QuantLinear) adds nothing
        if param is None:
            raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(model).__name__}")
        try:  # each layer copies its own part (of its own shard, under tensor parallelism)
            loader_of(param)(param, w, shard)
        except ValueError as exc:
            raise ValueError(f"checkpoint weight {name!r}: {exc}") from None
        loaded.update(weight_map.filled(param_name, shard, param))
    missing = [f"{n}[{s}]" if s is not None else n
               for n, p in params.items() for s in weight_map.shards_of(n, p) if (n, s) not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {', '.join(missing[:20])}"
                         + (" ..." if len(missing) > 20 else ""))
