"""Loading one checkpoint tensor into one parameter.

A parameter that a layer splits or fuses carries what its loader needs as attributes: ``weight_loader``
(copies this rank's part of a checkpoint tensor), ``full_shape`` (its shape on one rank, unsplit). The
helpers here set and read them, so that layers and quantization methods agree on the names; which
parameter and shard each checkpoint tensor goes to is :mod:`kvforge.layers.weight_map`'s.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Union

import torch

#: which part of a parameter one checkpoint tensor fills: ``"q"`` / ``"k"`` / ``"v"`` of a fused QKV
#: projection, ``0`` / ``1`` of gate/up, ``(expert, "w1" | "w3" | "w2")`` of an MoE layer, ``(None, kind)``
#: for a stacked expert tensor (:class:`kvforge.layers.moe.FusedMoE`), None for the whole parameter
ShardId = Union[str, int, tuple[Optional[int], str], None]
#: the parameter attributes loaders read (set on torch Parameters, which have no slots for them)
LOADER_ATTR, FULL_SHAPE_ATTR = "weight_loader", "full_shape"


class WeightLoader(Protocol):
    """``loader(param, loaded, shard_id)``: copy this rank's part of the checkpoint tensor ``loaded``
    into ``param``; ``ValueError`` naming the shape when it does not fit."""

    def __call__(self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None, /) -> None: ...


def check_shape(what: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """``ValueError`` unless ``loaded`` (a checkpoint tensor, or ``what`` part of it) has the shape
    the layer expects of it."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None, /) -> None:
    """A replicated parameter: the whole tensor, same shape."""
    check_shape("the tensor", loaded, tuple(param.shape))
    param.data.copy_(loaded)


def set_loader(param: torch.nn.Parameter, loader: WeightLoader,
               full: tuple[int, ...] | None = None) -> torch.nn.Parameter:
    """Give ``param`` its ``weight_loader`` and, for a split parameter, its unsplit shape ``full``."""
    setattr(param, LOADER_ATTR, loader)
    if full is not None:
        setattr(param, FULL_SHAPE_ATTR, tuple(full))
    return param


def loader_of(param: torch.nn.Parameter) -> WeightLoader:
    """The parameter's ``weight_loader``, or :func:`default_weight_loader` for a plain one."""
    return getattr(param, LOADER_ATTR, None) or default_weight_loader


def load_full(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    """Load ``loaded``, the whole unsharded tensor (for a fused parameter: its parts concatenated as
    on one rank), through the parameter's own loader. Dummy weights are drawn this way, so a model
    split over ranks holds exactly the slices of the unsplit model's weights."""
    loader_of(param)(param, loaded, None)


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The shape of the parameter on one rank (before splitting)."""
    return tuple(getattr(param, FULL_SHAPE_ATTR, param.shape))
