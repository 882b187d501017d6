"""``awq``: INT4 weight-only checkpoints in AutoAWQ's GEMM layout (``"quant_method": "awq"``,
``"version": "gemm"``), converted once loaded to the W4A16 kernel layout (``int4.py``).

Per linear layer, ``K`` inputs, ``N`` outputs, group size ``G``: ``qweight`` int32 ``[K, N / 8]`` and
``qzeros`` int32 ``[K / G, N / 8]``, eight outputs per int32 in the order 0, 2, 4, 6, 1, 3, 5, 7
(nibble ``i`` holds output ``8c + AWQ_ORDER[i]``), and ``scales [K / G, N]`` (fp16), with
``w = (q - zero) * scale``.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.model.quantization import LinearMethod, QuantizationMethod, ignored
from kvforge.plugins.quantization.int4 import AWQ_ORDER, Int4LinearMethod, check_group_size, group_dim, unpack_cols
from kvforge.plugins.quantization.linear_layer import linear_layer


class AwqLinear(Int4LinearMethod):
    def create_weights(self, layer: nn.Module) -> None:
        linear, g = linear_layer(layer), group_dim(self.group_size)
        layer.qweight = linear.make_param((("in", 1), ("out", 8)), torch.int32)
        layer.qzeros = linear.make_param((g, ("out", 8)), torch.int32)
        layer.scales = linear.make_param((g, ("out", 1)))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_cols(layer.get_parameter("qweight").data, AWQ_ORDER)
        zeros = unpack_cols(layer.get_parameter("qzeros").data, AWQ_ORDER).float()
        self.finish(layer, q, layer.get_parameter("scales").data.float(), zeros)


class AwqQuantization(QuantizationMethod):
    """Loads AWQ checkpoints (4 bits, zero points, GEMM layout, group size 32, 64 or 128)."""

    name = "awq"
    checkpoint_formats = ("awq",)
    quantizes_on_load = False

    def __init__(self, *, engine_config=None, model_config=None):
        super().__init__(engine_config=engine_config, model_config=model_config)
        qc = self.checkpoint_config or {}
        if qc.get("bits", qc.get("w_bit", 4)) != 4:
            raise ValueError(f"quantization_config field 'bits' is {qc.get('bits', qc.get('w_bit'))}; AWQ "
                             "checkpoints load with 4 bits only")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config field 'version' is {version!r}; supported: gemm (AWQ's "
                             "GEMV, Marlin and ExLlama layouts are not)")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config field 'zero_point' is false; AWQ checkpoints load with "
                             "zero points only")
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        check_group_size("quantization_config field 'group_size'", self.group_size)
        self.skip = qc.get("modules_to_not_convert")

    def linear_method(self, layer: nn.Module, names: list[str]) -> LinearMethod | None:
        if ignored(names, self.skip, "modules_to_not_convert"):
            return None
        return AwqLinear(self.group_size)
