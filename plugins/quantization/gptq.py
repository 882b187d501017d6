"""``gptq``: INT4 weight-only GPTQ checkpoints (``"quant_method": "gptq"``, ``desc_act`` false),
converted once loaded to the W4A16 kernel layout (``int4.py``).

Per linear layer, ``K`` inputs, ``N`` outputs, group size ``G`` (-1: one group): ``qweight`` int32
``[K / 8, N]``, eight consecutive inputs per int32 (already the kernel's order); ``qzeros`` int32
``[K / G, N / 8]``, eight consecutive outputs per int32, each stored minus one
(``checkpoint_format`` ``gptq``; ``gptq_v2`` stores them as they are); ``scales [K / G, N]``;
``g_idx [K]``, each input's group, which without act-order is ``k // G`` (checked).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.linear import LinearBase
from kvforge.layers.weights import ShardId, WeightLoader
from kvforge.model.quantization import LinearMethod, QuantizationMethod
from kvforge.plugins.quantization.int4 import Int4LinearMethod, check_group_size, group_dim, unpack_cols, unpack_rows
from kvforge.plugins.quantization.linear_layer import keep_when_random, linear_layer


class GptqLinear(Int4LinearMethod):
    def __init__(self, group_size: int, zero_offset: int):
        super().__init__(group_size)
        self.zero_offset = zero_offset

    def create_weights(self, layer: nn.Module) -> None:
        linear, g = linear_layer(layer), group_dim(self.group_size)
        layer.qweight = linear.make_param((("in", 8), ("out", 1)), torch.int32)
        layer.qzeros = linear.make_param((g, ("out", 8)), torch.int32)
        layer.scales = linear.make_param((g, ("out", 1)))
        g_idx = layer.g_idx = linear.make_param((("in", 1),), torch.int32, loader=self._g_idx_loader(linear))
        g_idx.data.copy_(self._groups(linear, g_idx))
        keep_when_random(g_idx)  # dummy weights keep the sequential groups

    def _g_idx_loader(self, layer: LinearBase) -> WeightLoader:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            """Each part of a fused layer has a g_idx of its own: every one must be sequential."""
            layer.weight_loader(param, loaded, shard_id)
            if not torch.equal(param.data, self._groups(layer, layer.get_parameter("g_idx"))):
                raise ValueError("g_idx is not sequential (inputs reordered by act-order); only desc_act=false "
                                 "GPTQ checkpoints are supported")
        return load

    def _groups(self, layer: LinearBase, g_idx: torch.Tensor) -> torch.Tensor:
        """Each of this rank's inputs' group without act-order (a row-parallel rank starts at ``start``)."""
        k = torch.arange(g_idx.shape[0], dtype=torch.int32, device=g_idx.device)
        if self.group_size == -1:
            return torch.zeros_like(k)
        return (k + getattr(layer, "start", 0)) // self.group_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        linear, g_idx = linear_layer(layer), layer.get_parameter("g_idx")
        if not torch.equal(g_idx.data, self._groups(linear, g_idx)):
            raise ValueError(f"GPTQ checkpoint: g_idx of {type(layer).__name__} ({linear.output_size} outputs) "
                             "is not sequential (inputs reordered by act-order); only desc_act=false checkpoints "
                             "are supported")
        zeros = unpack_cols(layer.get_parameter("qzeros").data).float() + self.zero_offset
        self.finish(layer, unpack_rows(layer.get_parameter("qweight").data), layer.get_parameter("scales").data.float(),
                    zeros)


class GptqQuantization(QuantizationMethod):
    """Loads GPTQ checkpoints (4 bits, ``desc_act`` false, group size 32, 64, 128 or -1)."""

    name = "gptq"
    checkpoint_formats = ("gptq",)
    quantizes_on_load = False

    def __init__(self, *, engine_config=None, model_config=None):
        super().__init__(engine_config=engine_config, model_config=model_config)
        qc = self.checkpoint_config or {}
        if qc.get("bits", 4) != 4:
            raise ValueError(f"quantization_config field 'bits' is {qc.get('bits')}; GPTQ checkpoints load "
                             "with 4 bits only")
        if qc.get("desc_act"):
            raise ValueError("quantization_config field 'desc_act' is true: act-order GPTQ checkpoints are "
                             "not supported; supported: desc_act false")
        if qc.get("lm_head"):
            raise ValueError("quantization_config field 'lm_head' is true: a quantized LM head is not supported")
        if qc.get("dynamic"):
            raise ValueError("quantization_config field 'dynamic' (per-module overrides) is not supported")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config field 'checkpoint_format' is {fmt!r}; supported: gptq, gptq_v2")
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.group_size = int(qc.get("group_size", 128))
        check_group_size("quantization_config field 'group_size'", self.group_size)
        blocks = qc.get("modules_in_block_to_quantize")  # [[names...], ...]: the rest stays unquantized
        self.only = None if not blocks else [m for group in blocks for m in group]

    def linear_method(self, layer: nn.Module, names: list[str]) -> LinearMethod | None:
        if self.only is not None:
            listed = [any(n.endswith("." + m) for m in self.only) for n in names]
            if any(listed) != all(listed):
                raise ValueError(f"quantization_config field 'modules_in_block_to_quantize' quantizes part of "
                                 f"the fused layer {names}")
            if not all(listed):
                return None
        return GptqLinear(self.group_size, self.zero_offset)
