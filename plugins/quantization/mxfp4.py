"""``mxfp4``: gpt-oss's published checkpoints, whose experts are MXFP4 (``"quant_method": "mxfp4"``) and
whose other layers (attention, router, embeddings) are bf16 and load as such.

The checkpoint layout, as transformers' ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``) reads it:
- ``experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H / 32, 16]``: each output row's H inputs in groups of
  32, two e2m1 values a byte (input ``2j`` in the low nibble, ``2j + 1`` in the high one); the rows
  interleave gate (even) and up (odd), as the bf16 ``gate_up_proj`` columns do;
- ``experts.gate_up_proj_scales`` uint8 ``[E, 2I, H / 32]``: e8m0, a group's scale is ``2^(s - 127)``;
- ``experts.down_proj_blocks`` ``[E, H, I / 32, 16]`` and ``down_proj_scales`` ``[E, H, I / 32]``;
- the biases ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]`` in bf16.

kvforge keeps these bytes (4.25 bits a weight) with the gate rows before the up rows, as ``FusedMoE``'s
``w13``; under tensor parallelism a rank keeps its slice of I, whole groups of 32 (refused otherwise).
The Triton kernels decode the nibbles and scales of each tile in registers; the CPU reference
dequantizes the experts once to float32 (:func:`dequantize_mxfp4`).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.model.quantization import LinearMethod, MoEMethod, QuantizationMethod
from kvforge.plugins.quantization.linear_layer import keep_when_random
from kvforge.plugins.quantization.moe_experts import (
    DequantizedExperts,
    ExpertTensor,
    KernelOperands,
    QuantizedMoEMethod,
    check_split,
    moe_layer,
    replace_experts,
    triton_experts,
)

GROUP = 32  # values per e8m0 scale
#: e2m1 code -> value (bit 3 the sign), as the OCP MX specification and transformers' FP4_VALUES list them
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the e8m0 scale of dummy (random) weights: 2^-7, so that random e2m1 codes stay below 0.05
DUMMY_SCALE = 120


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., K / 32, 16]`` uint8 and ``scales [..., K / 32]`` uint8 -> ``[..., K]`` float32."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit "
                         f"[..., K / {GROUP}, {GROUP // 2}] and [..., K / {GROUP}]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    # values: [..., K / 32, 32], the low nibble first
    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2)


class Mxfp4MoEMethod(QuantizedMoEMethod):
    """A layer's experts as MXFP4 bytes and e8m0 scales (weight-only: activations in the model dtype)."""

    def create_weights(self, layer: nn.Module) -> None:
        moe = moe_layer(layer)
        for field, size in (("hidden_size", moe.hidden_size), ("intermediate_size", moe.intermediate_size)):
            if size % GROUP:
                raise ValueError(f"mxfp4: the model's {field} {size} is not a multiple of {GROUP}")
        check_split(layer, GROUP, "quant_method")
        groups = moe.hidden_size // GROUP
        tensors = dict(w13_blocks=ExpertTensor(layer, True, 1, (groups, GROUP // 2), torch.uint8),
                       w13_scales=ExpertTensor(layer, True, 1, (groups,), torch.uint8),
                       w2_blocks=ExpertTensor(layer, False, GROUP, (GROUP // 2,), torch.uint8),
                       w2_scales=ExpertTensor(layer, False, GROUP, (), torch.uint8))
        replace_experts(layer, **{name: t.param for name, t in tensors.items()})
        for name in ("w13_scales", "w2_scales"):
            scale = layer.get_parameter(name)
            scale.data.fill_(DUMMY_SCALE)
            keep_when_random(scale)

    def dequantize(self, layer: nn.Module) -> DequantizedExperts:
        p = layer.get_parameter
        return DequantizedExperts(dequantize_mxfp4(p("w13_blocks"), p("w13_scales")),
                                  dequantize_mxfp4(p("w2_blocks"), p("w2_scales")))

    def triton_apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor | None:
        p = layer.get_parameter
        ops = KernelOperands("mxfp4", p("w13_blocks"), p("w13_scales"), p("w2_blocks"), p("w2_scales"),
                             s_up=moe_layer(layer).count)
        return triton_experts(layer, ops, x, topk_weights, topk_ids)


class Mxfp4Quantization(QuantizationMethod):
    """Loads ``"quant_method": "mxfp4"`` checkpoints: MXFP4 experts, every linear layer in the model dtype."""

    name = "mxfp4"
    checkpoint_formats = ("mxfp4",)
    quantizes_on_load = False

    def linear_method(self, layer: nn.Module, names: list[str]) -> LinearMethod | None:
        return None  # gpt-oss's attention and router are bf16 in its MXFP4 checkpoints

    def moe_method(self, layer: nn.Module) -> MoEMethod | None:
        return Mxfp4MoEMethod()
