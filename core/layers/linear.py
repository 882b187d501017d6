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
from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.weights import ShardId, WeightLoader, check_shape, full_shape, set_loader
from kvforge.model import quantization
from kvforge.rank import parallel_state


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor inside a column-parallel weight: ``full`` rows in the checkpoint, of
    which this rank keeps ``count`` from ``start``."""

    shard_id: ShardId
    full: int
    start: int
    count: int


#: one dimension of a parameter's checkpoint layout: ``("out", d)`` the output channels packed ``d``
#: to an element (``("out", 8)``: eight int4 values per int32), ``("in", d)`` the input channels per
#: ``d`` (a packing factor or a quantization group size), or a fixed size (never split)
Dim = Union[tuple[str, int], int]
WEIGHT_DIMS: tuple[Dim, ...] = (("out", 1), ("in", 1))
#: the parameter attribute holding its Dim specs
DIMS_ATTR = "dims"


def dims_of(param: nn.Parameter) -> tuple[Dim, ...]:
    """The :data:`Dim` specs ``param`` was made with (``LinearBase.make_param``)."""
    return getattr(param, DIMS_ATTR, WEIGHT_DIMS)


def _axis(param: nn.Parameter, kind: str) -> tuple[int | None, int]:
    """The index and divisor of ``param``'s ``kind`` ("out" or "in") dimension (None: it has none)."""
    for i, d in enumerate(dims_of(param)):
        if isinstance(d, tuple) and d[0] == kind:
            return i, d[1]
    return None, 1


class LinearBase(nn.Module):
    """What column- and row-parallel layers share: parameters laid out by :data:`Dim` specs, each
    with a loader that keeps this rank's slice, and a quantization method (``kvforge.model.quantization``).
    Built inside ``quantization.building(method)``, the full-precision weight waits on the meta
    device until ``quantization.attach_all`` gives the layer its method."""

    quantizable = True
    BIAS_DIMS: tuple[Dim, ...]
    input_size: int
    output_size: int  # on this rank

    def _sizes(self, kind: str, div: int) -> tuple[int, int]:
        """(this rank's, the checkpoint's) extent of a ``(kind, div)`` dimension."""
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's part of the checkpoint tensor ``loaded`` (or its part ``shard_id``) into ``param``."""
        raise NotImplementedError

    def make_param(self, dims: tuple[Dim, ...], dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None, loader: WeightLoader | None = None) -> nn.Parameter:
        """A parameter laid out by ``dims`` (each a :data:`Dim`), holding this rank's slice; its
        ``weight_loader`` (default: the layer's) copies that slice out of a checkpoint tensor."""
        local, full = [], []
        for d in dims:
            a, b = self._sizes(*d) if isinstance(d, tuple) else (d, d)
            local.append(a)
            full.append(b)
        p = nn.Parameter(torch.empty(local, dtype=dtype or self.params_dtype, device=device),
                         requires_grad=False)
        setattr(p, DIMS_ATTR, tuple(dims))
        return set_loader(p, loader or self.weight_loader, tuple(full))

    def _init_params(self, bias: bool) -> None:
        deferred = quantization.current() is not None  # attach_all materializes or replaces it
        self.quant_method = None
        self.params_dtype = torch.get_default_dtype()  # the model dtype
        self.weight = self.make_param(WEIGHT_DIMS, device="meta" if deferred else None)
        self.bias = self.make_param(self.BIAS_DIMS) if bias else None

    def materialize_weight(self) -> None:
        """Allocate the full-precision weight deferred to the meta device (on the default device)."""
        if self.weight.is_meta:
            self.weight = self.make_param(WEIGHT_DIMS)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if self.quant_method is None else self.quant_method.apply(self, x)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b``, each rank keeping its rows of every part of W (and b)."""

    BIAS_DIMS = (("out", 1),)

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
        self._init_params(bias)

    def _sizes(self, kind: str, div: int) -> tuple[int, int]:
        if kind == "in":
            if self.input_size % div:
                raise ValueError(f"input size {self.input_size} is not a multiple of {div}")
            return self.input_size // div, self.input_size // div
        for p in self.parts:
            if p.full % div or p.start % div or p.count % div:
                raise ValueError(f"output part {p.shard_id!r} ({p.full} rows, this rank's {p.start}:"
                                 f"{p.start + p.count}) does not split into whole groups of {div}")
        return self.output_size // div, sum(p.full for p in self.parts) // div

    def part_rows(self, shard_id: ShardId) -> int:
        """Rows of the checkpoint tensor ``shard_id`` (None: all the parts together)."""
        if shard_id is None:
            return sum(p.full for p in self.parts)
        return self._part(shard_id).full

    def _part(self, shard_id: ShardId) -> Part:
        matches = [p for p in self.parts if p.shard_id == shard_id or len(self.parts) == 1]
        if not matches:
            raise ValueError(f"checkpoint shard {shard_id!r} is not a part of this layer "
                             f"({[p.shard_id for p in self.parts]})")
        return matches[0]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        axis, div = _axis(param, "out")
        if axis is None:  # replicated over the outputs
            check_shape("the tensor", loaded, full_shape(param))
            param.data.copy_(loaded)
            return
        if shard_id is None and len(self.parts) > 1:  # the whole fused tensor: each part in turn
            check_shape("the fused tensor", loaded, full_shape(param))
            offset = 0
            for part in self.parts:
                self._load_part(param, loaded.narrow(axis, offset, part.full // div), part)
                offset += part.full // div
            return
        self._load_part(param, loaded, self._part(shard_id))

    def _load_part(self, param: nn.Parameter, loaded: torch.Tensor, part: Part) -> None:
        axis, div = _axis(param, "out")
        if axis is None:
            raise ValueError(f"part {part.shard_id!r}: the parameter has no output dimension to place it in")
        expected = list(full_shape(param))
        expected[axis] = part.full // div
        check_shape("the tensor" if part.shard_id is None else f"part {part.shard_id!r}", loaded, tuple(expected))
        offset = sum(p.count for p in self.parts[:self.parts.index(part)]) // div
        param.data.narrow(axis, offset, part.count // div).copy_(
            loaded.narrow(axis, part.start // div, part.count // div))

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
    :func:`kvforge.rank.parallel_state.head_shard` says; ``shard`` is this rank's heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = parallel_state.current()
        s = self.shard = parallel_state.head_shard(num_heads, num_kv_heads, tp.size, tp.rank)
        kv = num_kv_heads * head_dim
        super().__init__(hidden_size, bias=bias, parts=[
            Part("q", num_heads * head_dim, s.q_start * head_dim, s.num_heads * head_dim),
            Part("k", kv, s.kv_start * head_dim, s.num_kv_heads * head_dim),
            Part("v", kv, s.kv_start * head_dim, s.num_kv_heads * head_dim)])


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's input columns split over the ranks (``x`` holds this rank's
    columns, the output of a column-parallel layer); the partial products are summed over the
    ranks, then the bias (replicated) is added once."""

    BIAS_DIMS = (("out", 1),)

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 input_part: tuple[int, int] | None = None):
        """``input_part``: (first column, columns) this rank keeps; default: an even split."""
        super().__init__()
        self.tp = parallel_state.current()
        self.start, self.count = input_part or parallel_state.split(input_size, self.tp.size, self.tp.rank)
        self.input_size, self.output_size = input_size, output_size
        self._init_params(bias)

    def _sizes(self, kind: str, div: int) -> tuple[int, int]:
        if kind == "out":
            if self.output_size % div:
                raise ValueError(f"output size {self.output_size} is not a multiple of {div}")
            return self.output_size // div, self.output_size // div
        if self.input_size % div or self.start % div or self.count % div:
            raise ValueError(f"this rank's input columns {self.start}:{self.start + self.count} of "
                             f"{self.input_size} do not split into whole groups of {div}")
        return self.count // div, self.input_size // div

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        check_shape("the tensor", loaded, full_shape(param))
        axis, div = _axis(param, "in")
        if axis is None:  # replicated over the inputs (a bias, a per-channel scale)
            param.data.copy_(loaded)
        else:
            param.data.copy_(loaded.narrow(axis, self.start // div, param.shape[axis]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None and self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        staged = self.tp.staging((x.shape[0], self.output_size), x.dtype) if (
            self.quant_method is None and x.dim() == 2) else None
        if staged is not None:  # the partial product straight into the peer all-reduce's buffer
            y = self.tp.all_reduce(torch.mm(x, self.weight.t(), out=staged))
        else:
            y = self.tp.all_reduce(self._matmul(x))
        return y if self.bias is None else y.add_(self.bias)
