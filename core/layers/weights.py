"""Loading one checkpoint tensor into one parameter."""
from __future__ import annotations

from typing import Any

import torch


def check_shape(what: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """``ValueError`` unless ``loaded`` (a checkpoint tensor, or ``what`` part of it) has the shape
    the layer expects of it."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A replicated parameter: the whole tensor, same shape."""
    check_shape("the tensor", loaded, param.shape)
    param.data.copy_(loaded)


def load_full(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    """Load ``loaded``, the whole unsharded tensor (for a fused parameter: its parts concatenated as
    on one rank), through the parameter's own loader. Dummy weights are drawn this way, so a model
    split over ranks holds exactly the slices of the unsplit model's weights."""
    getattr(param, "weight_loader", default_weight_loader)(param, loaded, None)


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The shape of the parameter on one rank (before splitting)."""
    return tuple(getattr(param, "full_shape", param.shape))
