"""``fp8`` for mixture-of-experts models: FP8 e4m3 experts, and block-scaled dense layers.

Three sources of experts (``Fp8MoEMethod.mode``):
- ``on_load``: a bf16/fp16/fp32 checkpoint, each expert's rows quantized once loaded, a float32 scale
  per output channel (``max|row| / 448``), as the dense layers are;
- ``block``: Qwen3 / DeepSeek's checkpoints (``"weight_block_size": [128, 128]``): e4m3
  ``experts.N.gate_proj.weight`` ``[I, H]`` with ``weight_scale_inv`` ``[ceil(I / 128), ceil(H / 128)]``,
  the multiplier of each 128x128 block (the name is historic: ``w = q * weight_scale_inv``);
- ``tensor``: one ``weight_scale`` per expert projection (vLLM / AutoFP8 checkpoints); the gate and
  up scales of an expert stay separate.

All three become e4m3 ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` with scales ``[E, rows, K groups]`` whose
groups are (BN, BK): (1, K) per channel, (128, 128) per block, (I, H) per tensor. Weight-only: the
activations stay in the model dtype (the kernels dequantize each weight tile in registers; no FP8
GEMM, unlike the dense ``fp8`` layers). Under tensor parallelism a rank keeps its slice of I, whole
blocks (refused otherwise).

Dense layers of a block checkpoint (attention, shared experts) load their e4m3 weights and block scales
and are dequantized once to the model dtype (:class:`Fp8BlockLinearMethod`): they are a few percent of
an MoE model's bytes; an FP8 block GEMM is not built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.weights import ShardId, check_shape, set_loader
from kvforge.model.quantization import LinearMethod
from kvforge.plugins.quantization.linear_layer import keep_when_random, linear_layer
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

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MODES = ("on_load", "block", "tensor")


def expand_scales(q: torch.Tensor, scale: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """``q [E, N, K]`` e4m3 times its scales ``[E, ceil(N / BN), ceil(K / BK)]`` -> float32 ``[E, N, K]``."""
    (bn, bk), (n, k) = groups, q.shape[1:]
    full = scale.float().repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bk, dim=2)[:, :, :k]
    return q.float() * full


class _TensorScale:
    """A per-tensor scale per expert projection: ``[E, 2, 1]`` (gate, up) or ``[E, 1, 1]`` (down), the same
    on every rank."""

    def __init__(self, layer: nn.Module, gate_up: bool):
        self.moe, self.gate_up = moe_layer(layer), gate_up
        shape = (self.moe.num_experts, 2 if gate_up else 1, 1)
        self.param = set_loader(nn.Parameter(torch.ones(shape), requires_grad=False), self.load)

    def checkpoint_shards(self, param: nn.Parameter) -> list[ShardId]:
        parts = ("w1", "w3") if self.gate_up else ("w2",)
        return [(e, part) for e in range(self.moe.num_experts) for part in parts]

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:
            check_shape("the tensor", loaded, tuple(param.shape))
            param.data.copy_(loaded)
            return
        if not isinstance(shard_id, tuple) or shard_id[0] is None:
            raise ValueError(f"a per-tensor expert scale takes (expert, projection) shards, got {shard_id!r}")
        expert, part = shard_id
        if loaded.numel() != 1:
            raise ValueError(f"expert {expert}'s {part} weight_scale has shape {tuple(loaded.shape)}; "
                             "a per-tensor scale is one value")
        param.data[expert, 1 if part == "w3" else 0] = loaded.float().reshape(1)


class Fp8MoEMethod(QuantizedMoEMethod):
    """A layer's experts in e4m3 with float32 scales (see the module docstring for ``mode``)."""

    def __init__(self, mode: str, block: tuple[int, int] = (128, 128)):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"fp8 MoE mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode, self.block = mode, block
        self.ops: KernelOperands | None = None

    def create_weights(self, layer: nn.Module) -> None:
        moe = moe_layer(layer)
        h, n = moe.hidden_size, moe.count
        if self.mode == "on_load":
            return  # the model-dtype w13 / w2 load as they are, quantized once in
        bn, bk = self.block
        w13, w2 = ExpertTensor(layer, True, 1, (h,), FP8), ExpertTensor(layer, False, 1, (), FP8)
        if self.mode == "block":
            check_split(layer, bn, "weight_block_size")
            check_split(layer, bk, "weight_block_size")
            s13 = ExpertTensor(layer, True, bn, (-(-h // bk),), torch.float32)
            s2 = ExpertTensor(layer, False, bk, (), torch.float32, rows=-(-h // bn))
            scales = dict(w13_weight_scale_inv=s13.param, w2_weight_scale_inv=s2.param)
            self.groups = ((bn, bk), (bn, bk), s13.rank_i)
        else:
            scales = dict(w13_weight_scale=_TensorScale(layer, True).param,
                          w2_weight_scale=_TensorScale(layer, False).param)
            self.groups = ((n, h), (h, n), 1)
        replace_experts(layer, w13=w13.param, w2=w2.param, **scales)
        for scale in scales.values():
            scale.data.fill_(1.0)  # dummy (random) weights: unit scales
            keep_when_random(scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        moe = moe_layer(layer)
        if self.mode == "on_load":
            tensors = {}
            for name in ("w13", "w2"):
                w = layer.get_parameter(name).data.float()
                # scale: [E, rows, 1], one per output channel of each expert
                scale = (w.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=1e-12)
                tensors[name] = nn.Parameter((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), requires_grad=False)
                tensors[f"{name}_weight_scale"] = nn.Parameter(scale, requires_grad=False)
            replace_experts(layer, **tensors)  # the full-precision experts are freed
            h, n = moe.hidden_size, moe.count
            self.groups = ((1, h), (1, n), n)
        suffix = "_weight_scale_inv" if self.mode == "block" else "_weight_scale"
        (g13, g2, s_up), p = self.groups, layer.get_parameter
        self.ops = KernelOperands("fp8", p("w13"), p("w13" + suffix), p("w2"), p("w2" + suffix), g13, g2, s_up)

    def dequantize(self, layer: nn.Module) -> DequantizedExperts:
        ops = self._operands()
        n = ops.w13.shape[1] // 2
        gate = expand_scales(ops.w13[:, :n], ops.s13[:, :ops.s_up], ops.groups13)
        up = expand_scales(ops.w13[:, n:], ops.s13[:, ops.s_up:], ops.groups13)
        return DequantizedExperts(torch.cat([gate, up], dim=1), expand_scales(ops.w2, ops.s2, ops.groups2))

    def triton_apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor | None:
        return triton_experts(layer, self._operands(), x, topk_weights, topk_ids)

    def _operands(self) -> KernelOperands:
        if self.ops is None:
            raise RuntimeError("fp8: the experts ran before their weights were loaded (process_weights_after_loading)")
        return self.ops


class Fp8BlockLinearMethod(LinearMethod):
    """A dense layer of a block-FP8 checkpoint: e4m3 ``weight [out, in]`` and ``weight_scale_inv
    [out / BN, in / BK]``, dequantized once loaded to the model dtype."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def create_weights(self, layer: nn.Module) -> None:
        linear, (bn, bk) = linear_layer(layer), self.block
        layer.weight = linear.make_param((("out", 1), ("in", 1)), FP8)
        try:
            scale = layer.weight_scale_inv = linear.make_param((("out", bn), ("in", bk)), torch.float32)
        except ValueError as exc:
            raise ValueError(f"quantization_config field 'weight_block_size' {list(self.block)}: {exc}") from None
        scale.data.fill_(1.0)
        keep_when_random(scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        linear = linear_layer(layer)
        q, scale = layer.get_parameter("weight").data, layer.get_parameter("weight_scale_inv").data
        w = expand_scales(q[None], scale[None], self.block)[0].to(linear.params_dtype)
        del layer.weight_scale_inv
        layer.weight = nn.Parameter(w, requires_grad=False)  # [out, in] in the model dtype

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.get_parameter("weight"))
