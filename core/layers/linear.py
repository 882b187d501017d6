"""Column- and row-parallel linear layers (fused Q/K/V and gate/up included).

A column-parallel layer splits its weight's output rows over the tensor-parallel ranks: each rank
computes its slice of the outputs, with no communication. A row-parallel layer splits the input
columns: each rank computes a partial product of the whole output, summed over the ranks (one
all-reduce). Attention and MLP pair them (QKV and gate/up column-parallel, o_proj and down_proj
row-parallel), so a layer costs one all-reduce per block. A fused layer is several checkpoint
tensors (parts), each split on its own; ``weight_loader(param, tensor, shard_id)`` copies this
rank's rows of one part, or with ``shard_id=None`` of the whole fused tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvforge import parallel_state, quantization
from kvforge.layers.weights import check_shape


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor inside a column-parallel weight: ``full`` rows in the checkpoint, of
    which this rank keeps ``count`` from ``start``."""

    shard_id: Any
    full: int
    start: int
    count: int


def _param(shape: tuple[int, ...], full_shape: tuple[int, ...], loader: Any) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.full_shape = full_shape
    p.weight_loader = loader
    return p


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b``, each rank keeping its rows of every part of W (and b)."""

    def __init__(self, input_size: int, output_size: int | None = None, bias: bool = False, *,
                 parts: list[Part] | None = None):
        super().__init__()
        self.tp = parallel_state.current()
        if parts is None:
            assert output_size is not None
            parts = [Part(None, output_size, *parallel_state.split(output_size, self.tp.size, self.tp.rank))]
        self.parts = parts
        self.input_size = input_size
        self.output_size = sum(p.count for p in parts)  # on this rank
        full = sum(p.full for p in parts)
        self.weight = _param((self.output_size, input_size), (full, input_size), self.weight_loader)
        self.bias = _param((self.output_size,), (full,), self.weight_loader) if bias else None
        quantization.attach(self)  # sets quant_method (None: the model dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None and len(self.parts) > 1:  # the whole fused tensor: each part in turn
            check_shape("the fused tensor", loaded, param.full_shape)
            offset = 0
            for part in self.parts:
                self._load_part(param, loaded.narrow(0, offset, part.full), part)
                offset += part.full
            return
        matches = [p for p in self.parts if p.shard_id == shard_id or len(self.parts) == 1]
        if not matches:
            raise ValueError(f"checkpoint shard {shard_id!r} is not a part of this layer "
                             f"({[p.shard_id for p in self.parts]})")
        self._load_part(param, loaded, matches[0])

    def _load_part(self, param: nn.Parameter, loaded: torch.Tensor, part: Part) -> None:
        check_shape("the tensor" if part.shard_id is None else f"part {part.shard_id!r}", loaded, (part.full, *param.shape[1:]))
        offset = sum(p.count for p in self.parts[:self.parts.index(part)])
        param.data.narrow(0, offset, part.count).copy_(loaded.narrow(0, part.start, part.count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return F.linear(x, self.weight, self.bias)
        y = self.quant_method.apply(self, x)
        return y if self.bias is None else y + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several outputs of one input fused in one weight (gate and up: shard ids 0, 1, ...), each split
    as evenly as possible over the ranks."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        tp = parallel_state.current()
        super().__init__(input_size, bias=bias, parts=[
            Part(i, n, *parallel_state.split(n, tp.size, tp.rank)) for i, n in enumerate(output_sizes)])


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused (shard ids "q", "k", "v"), split by attention head as
    :func:`kvforge.parallel_state.head_shard` says; ``shard`` is this rank's heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = parallel_state.current()
        s = self.shard = parallel_state.head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
        kv = num_kv_heads * head_dim
        super().__init__(hidden_size, bias=bias, parts=[
            Part("q", num_heads * head_dim, s.q_start * head_dim, s.num_heads * head_dim),
            Part("k", kv, s.kv_start * head_dim, s.num_kv_heads * head_dim),
            Part("v", kv, s.kv_start * head_dim, s.num_kv_heads * head_dim)])


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split over the ranks (``x`` holds this rank's
    columns, the output of a column-parallel layer); the partial products are summed over the
    ranks, then the bias (replicated) is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 input_part: tuple[int, int] | None = None):
        """``input_part``: (first column, columns) this rank keeps; default: an even split."""
        super().__init__()
        self.tp = parallel_state.current()
        self.start, count = input_part or parallel_state.split(input_size, self.tp.size, self.tp.rank)
        self.weight = _param((output_size, count), (output_size, input_size), self.weight_loader)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        quantization.attach(self)  # sets quant_method (None: the model dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        check_shape("the tensor", loaded, param.full_shape)
        param.data.copy_(loaded.narrow(1, self.start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.tp.all_reduce(self.quant_method.apply(self, x))
        elif self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        else:
            y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)
