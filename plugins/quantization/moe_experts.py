"""What the quantized mixture-of-experts methods share (``fp8_moe``, ``mxfp4``, the dummy plugin's):
a loader for an expert tensor that keeps this rank's slice, and the apply step.

An expert tensor is stored with the experts first and its intermediate (I) dimension where
``FusedMoE`` keeps it: a gate/up tensor ``[E, 2 * ceil(I_rank / f), ...]`` (gate part, then up part)
and a down tensor ``[E, H, ceil(I_rank / f), ...]``, ``f`` elements of I per stored element (1 for a
weight, 128 for a block scale, 32 for an MXFP4 scale). Under tensor parallelism each rank keeps the
same slice of every expert's I as the bf16 experts do, so a scale stays with its block; a slice that
would cut a block is refused when the layer is built.

``apply`` runs the Triton kernels of ``kvforge.kernels.moe_quant`` (tiles dequantized in the kernel)
where triton runs, else the reference: the experts dequantized once to float32 (kept: the CPU path is
for correctness, not memory) through ``kvforge.layers.fused_moe.fused_experts_ref``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvforge.layers.fused_moe import fused_experts_ref
from kvforge.layers.weights import ShardId, check_shape, full_shape, set_loader
from kvforge.model.quantization import MoEMethod


def moe_layer(layer: nn.Module):
    """``layer`` as the ``kvforge.layers.moe.FusedMoE`` the built-in methods are attached to."""
    from kvforge.layers.moe import FusedMoE

    if not isinstance(layer, FusedMoE):
        raise TypeError(f"a quantized MoE method is attached to a FusedMoE layer, got {type(layer).__name__}")
    return layer


def check_split(layer: nn.Module, factor: int, field: str) -> None:
    """``ValueError`` naming ``field`` when this rank's slice of I would cut a group of ``factor``."""
    moe = moe_layer(layer)
    if moe.tp.size > 1 and moe.count % factor:
        raise ValueError(f"quantization_config field {field!r}: the experts' intermediate size "
                         f"{moe.intermediate_size} split over {moe.tp.size} ranks ({moe.count} each) cuts its "
                         f"groups of {factor}; use fewer ranks")


class ExpertTensor:
    """One quantized expert tensor of a layer and its loader (shard ids as ``FusedMoE.weight_loader``'s;
    ``(None, "w13_interleaved_rows")``: a stacked [E, 2I, ...] tensor, gate and up in even / odd rows,
    ``(None, "w2_stacked")``: a stacked [E, H, I, ...] one)."""

    def __init__(self, layer: nn.Module, gate_up: bool, factor: int, tail: tuple[int, ...], dtype: torch.dtype,
                 rows: int | None = None):
        """``rows``: a down tensor's second dimension (default H; fewer for block scales)."""
        self.moe, self.gate_up, self.factor = moe_layer(layer), gate_up, factor
        moe = self.moe
        self.full_i, self.rank_i = -(-moe.intermediate_size // factor), -(-moe.count // factor)
        self.first = moe.start // factor
        e, h = moe.num_experts, rows if rows is not None else moe.hidden_size
        shape = (e, 2 * self.rank_i, *tail) if gate_up else (e, h, self.rank_i, *tail)
        full = (e, 2 * self.full_i, *tail) if gate_up else (e, h, self.full_i, *tail)
        self.param = set_loader(nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False), self.load, full)

    def checkpoint_shards(self, param: nn.Parameter) -> list[ShardId]:
        parts = ("w1", "w3") if self.gate_up else ("w2",)
        return [(e, part) for e in range(self.moe.num_experts) for part in parts]

    def _rows(self) -> slice:
        return slice(self.first, self.first + self.rank_i)

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        full, rows, n = full_shape(param), self._rows(), self.rank_i
        if shard_id is None:  # [E, 2I', ...] gate then up / [E, H, I', ...], as one rank holds it unsplit
            check_shape("the tensor", loaded, full)
            if self.gate_up:
                gate, up = loaded[:, :self.full_i], loaded[:, self.full_i:]
                param.data.copy_(torch.cat([gate[:, rows], up[:, rows]], dim=1))
            else:
                param.data.copy_(loaded[:, :, rows])
            return
        if not isinstance(shard_id, tuple):
            raise ValueError(f"MoE shard {shard_id!r} is not (expert, projection)")
        expert, part = shard_id
        if expert is None:
            if part == "w13_interleaved_rows" and self.gate_up:
                self.load(param, torch.cat([loaded[:, 0::2], loaded[:, 1::2]], dim=1), None)
            elif part == "w2_stacked" and not self.gate_up:
                self.load(param, loaded, None)
            else:
                raise ValueError(f"stacked MoE tensor kind {part!r} does not fit this tensor")
            return
        if not 0 <= expert < self.moe.num_experts:
            raise ValueError(f"expert {expert} is out of range (the layer has {self.moe.num_experts})")
        if part in ("w1", "w3") and self.gate_up:
            check_shape(f"expert {expert}'s {part}", loaded, (self.full_i, *full[2:]))
            dest = slice(0, n) if part == "w1" else slice(n, 2 * n)
            param.data[expert, dest].copy_(loaded[rows])
        elif part == "w2" and not self.gate_up:
            check_shape(f"expert {expert}'s w2", loaded, full[1:])
            param.data[expert].copy_(loaded[:, rows])
        else:
            raise ValueError(f"MoE shard {part!r} does not fit this {'gate/up' if self.gate_up else 'down'} tensor")


@dataclass
class DequantizedExperts:
    """The CPU reference's operands: the experts in float32, made once."""

    w13: torch.Tensor  # [E, 2 * I_rank, H] float32
    w2: torch.Tensor  # [E, H, I_rank] float32


class QuantizedMoEMethod(MoEMethod):
    """A format's experts: subclasses make their tensors (``create_weights``), dequantize them
    (``dequantize``) and hand the Triton kernels their operands (``triton_apply``)."""

    def __init__(self) -> None:
        self.reference: DequantizedExperts | None = None

    def dequantize(self, layer: nn.Module) -> DequantizedExperts:
        raise NotImplementedError

    def triton_apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor | None:
        """The kernels' result, or None where the format has none (the reference runs)."""
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        from kvforge.kernels import runs_on

        moe = moe_layer(layer)
        if runs_on(x):
            y = self.triton_apply(layer, x, topk_weights, topk_ids)
            if y is not None:
                return y
        ref = self.reference or self.dequantize(layer)
        if x.device.type == "cpu":
            self.reference = ref
        b13 = moe.w13_bias.float() if moe.w13_bias is not None else None
        b2 = moe.w2_bias.float() if moe.w2_bias is not None and moe.tp.rank == 0 else None
        y = fused_experts_ref(x.float(), ref.w13, ref.w2, topk_weights, topk_ids, activation=moe.activation,
                              w13_bias=b13, w2_bias=b2, swiglu_alpha=moe.swiglu_alpha,
                              swiglu_limit=moe.swiglu_limit)
        return y.to(x.dtype)


def replace_experts(layer: nn.Module, **tensors: nn.Parameter) -> None:
    """Drop the layer's model-dtype ``w13`` / ``w2`` and register the format's tensors in their place
    (a name the format does not reuse is left None: ``FusedMoE`` compares parameters with it)."""
    for name in ("w13", "w2"):
        if name in layer._parameters:
            del layer._parameters[name]
        if name not in tensors:
            setattr(layer, name, None)
    for name, param in tensors.items():
        setattr(layer, name, param)


@dataclass
class KernelOperands:
    """What ``kvforge.kernels.moe_quant.quantized_experts`` reads of one layer (see its docstring)."""

    fmt: str  # "fp8" | "mxfp4"
    w13: torch.Tensor  # [E, 2 * I_rank, H] e4m3, or [E, 2 * I_rank, H / 2] uint8
    s13: torch.Tensor  # [E, scale rows, K groups] float32 (fp8) or uint8 e8m0 (mxfp4)
    w2: torch.Tensor  # [E, H, I_rank] e4m3, or [E, H, I_rank / 2] uint8
    s2: torch.Tensor
    groups13: tuple[int, int] = (1, 32)  # (BN, BK) of the fp8 scales
    groups2: tuple[int, int] = (1, 32)
    s_up: int = 0  # the first scale row of the up half of s13


def triton_experts(layer: nn.Module, ops: KernelOperands, x: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """The quantized experts' outputs summed per token, [T, H], by the Triton kernels (graph-safe, as
    ``kvforge.layers.fused_moe.fused_experts``)."""
    from kvforge.kernels import moe_quant
    from kvforge.layers.fused_moe import ACTIVATIONS, align_pairs, pick_tiles

    moe = moe_layer(layer)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = pick_tiles(num_pairs, moe.num_experts)
    blocks = align_pairs(topk_ids, moe.num_experts, tiles.block_m)
    w2_bias = moe.w2_bias if moe.tp.rank == 0 else None
    per_pair = moe_quant.quantized_experts(
        x.contiguous(), ops.w13, ops.s13, ops.w2, ops.s2, topk_weights, blocks, tiles, fmt=ops.fmt, inter=moe.count,
        groups13=ops.groups13, groups2=ops.groups2, s_up=ops.s_up, activation=ACTIVATIONS[moe.activation],
        w13_bias=moe.w13_bias, w2_bias=w2_bias, swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit)
    return per_pair if top_k == 1 else per_pair.view(num_tokens, top_k, -1).sum(dim=1)
