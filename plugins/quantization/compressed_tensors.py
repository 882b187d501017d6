"""``compressed-tensors``: checkpoints written by the ``compressed-tensors`` library (llm-compressor's
format, ``"quant_method": "compressed-tensors"``), for the schemes kvforge has kernels for:

- FP8 W8A8, ``float-quantized``: ``weight`` float8_e4m3 ``[N, K]``, ``weight_scale`` per channel
  ``[N, 1]`` or per tensor, activations per token (dynamic) or with a static per-tensor
  ``input_scale``; served by the ``fp8`` layer method.
- INT4 W4A16, ``pack-quantized``: ``weight_packed`` int32 ``[N, K / 8]`` (eight consecutive inputs per
  int32, signed values stored plus 8), ``weight_scale [N, K / G]`` (G = 32, 64, 128, or one group per
  channel), ``weight_zero_point`` int32 ``[N / 8, K / G]`` when asymmetric (eight outputs per int32,
  plus 8), ``weight_shape [2]``; converted once loaded to the W4A16 kernel layout (``int4.py``).

Each layer takes the scheme of the ``config_groups`` entry whose ``targets`` match it (``Linear``,
an exact module name, or ``re:<regex>``), unless ``ignore`` names it; anything else is refused
naming the scheme.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import nn

from kvforge.layers.linear import ColumnParallelLinear, LinearBase
from kvforge.layers.weights import ShardId, WeightLoader
from kvforge.model.quantization import LinearMethod, QuantizationMethod
from kvforge.plugins.quantization.fp8 import Fp8LinearMethod
from kvforge.plugins.quantization.int4 import Int4LinearMethod, check_group_size, group_dim, unpack_cols, unpack_rows
from kvforge.plugins.quantization.linear_layer import keep_when_random, linear_layer

SUPPORTED = ("FP8 W8A8 (float-quantized: 8-bit float weights, per-channel or per-tensor, with dynamic per-token "
             "or static per-tensor 8-bit float activations) and INT4 W4A16 (pack-quantized: 4-bit int weights, "
             "group 32/64/128 or per channel, no activation quantization)")


def _matches(target: str, name: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


class PackedInt4Linear(Int4LinearMethod):
    def __init__(self, group_size: int, symmetric: bool):
        super().__init__(group_size)
        self.symmetric = symmetric

    def create_weights(self, layer: nn.Module) -> None:
        linear, g = linear_layer(layer), group_dim(self.group_size)
        layer.weight_packed = linear.make_param((("out", 1), ("in", 8)), torch.int32)
        layer.weight_scale = linear.make_param((("out", 1), g))
        if not self.symmetric:
            layer.weight_zero_point = linear.make_param((("out", 8), g), torch.int32)
        shape = layer.weight_shape = linear.make_param((2,), torch.int64, loader=self._shape_loader(linear))
        keep_when_random(shape)

    @staticmethod
    def _shape_loader(layer: LinearBase) -> WeightLoader:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            """Checks the unpacked shape the checkpoint states (nothing to keep)."""
            rows = layer.part_rows(shard_id) if isinstance(layer, ColumnParallelLinear) else layer.output_size
            if loaded.tolist() != [rows, layer.input_size]:
                raise ValueError(f"weight_shape is {loaded.tolist()}, expected {[rows, layer.input_size]}")
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_cols(layer.get_parameter("weight_packed").data).t()  # [K, N], unsigned (signed + 8)
        scales = layer.get_parameter("weight_scale").data.float().t()
        if self.symmetric:
            zeros = torch.full_like(scales, 8.0)
        else:
            zeros = unpack_rows(layer.get_parameter("weight_zero_point").data).float().t()
        self.finish(layer, q, scales, zeros)


class CompressedTensorsQuantization(QuantizationMethod):
    name = "compressed-tensors"
    checkpoint_formats = ("compressed-tensors",)
    quantizes_on_load = False

    def __init__(self, *, engine_config=None, model_config=None):
        super().__init__(engine_config=engine_config, model_config=model_config)
        qc = self.checkpoint_config or {}
        self.format = qc.get("format")
        self.ignore = list(qc.get("ignore") or [])
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise ValueError("quantization_config field 'config_groups' must name at least one scheme")
        self.schemes = [(name, s, self._layer_method_factory(name, s)) for name, s in groups.items()]
        sparsity = qc.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise ValueError(f"quantization_config field 'sparsity_config' has format {sparsity['format']!r}: "
                             "sparse compressed-tensors checkpoints are not supported; supported: dense")

    def _layer_method_factory(self, group: str, scheme: dict[str, Any]) -> Callable[[], LinearMethod]:
        """Check one scheme; returns a function making its layer method."""
        w = scheme.get("weights") or {}
        a = scheme.get("input_activations")
        fmt = scheme.get("format") or self.format
        where = f"quantization_config config_groups.{group}"
        if w.get("type") == "float" and w.get("num_bits") == 8 and fmt in ("float-quantized", "naive-quantized", None) and a \
                and a.get("type") == "float" and a.get("num_bits") == 8 and w.get("strategy") in ("channel", "tensor"):
            dynamic = bool(a.get("dynamic"))
            if (a.get("strategy"), dynamic) not in (("token", True), ("tensor", False)):
                raise ValueError(f"{where}.input_activations: strategy {a.get('strategy')!r} with dynamic={dynamic} "
                                 "is not supported; supported: dynamic per-token or static per-tensor")
            return lambda: Fp8LinearMethod(checkpoint=True, static=not dynamic)
        if w.get("type") == "int" and w.get("num_bits") == 4 and fmt == "pack-quantized" and not a:
            if w.get("actorder") not in (None, "static", "weight"):
                raise ValueError(f"{where}.weights.actorder is {w['actorder']!r}: act-order groups (g_idx) "
                                 "are not supported")
            if w.get("strategy") == "channel":
                group_size = -1
            elif w.get("strategy") == "group":
                group_size = int(w.get("group_size") or 0)
                check_group_size(f"{where}.weights.group_size", group_size)
            else:
                raise ValueError(f"{where}.weights.strategy is {w.get('strategy')!r}; supported: group, channel")
            symmetric = bool(w.get("symmetric", True))
            return lambda: PackedInt4Linear(group_size, symmetric)
        raise ValueError(f"{where} (format {fmt!r}, weights {w.get('type')}{w.get('num_bits')} "
                         f"{w.get('strategy')}, input_activations {a}) is not supported; supported: {SUPPORTED}")

    def linear_method(self, layer: nn.Module, names: list[str]) -> LinearMethod | None:
        chosen = set()
        for n in names:
            if any(_matches(t, n) for t in self.ignore):
                chosen.add(None)
                continue
            # a module's own name or a regex wins over the class name "Linear" (as compressed-tensors matches)
            named = [g for g, s, _ in self.schemes if any(t != "Linear" and _matches(t, n) for t in s.get("targets") or ())]
            hits = named or [g for g, s, _ in self.schemes if "Linear" in (s.get("targets") or ())]
            chosen.add(hits[0] if hits else None)
        if len(chosen) > 1:
            raise ValueError(f"compressed-tensors checkpoint: the fused modules {names} have different schemes "
                             f"({sorted(map(str, chosen))}); they must be quantized alike")
        group = chosen.pop()
        if group is None:
            return None
        return next(make for g, _, make in self.schemes if g == group)()
