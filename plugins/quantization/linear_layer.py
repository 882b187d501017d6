"""The layer a built-in linear quantization method works on, typed.

``LinearMethod``'s hooks take an ``nn.Module`` (the contract, ``kvforge.model.quantization``); the built-in
methods are only ever attached to kvforge's linear layers (``kvforge.layers.linear.LinearBase``), whose
``make_param``, ``weight_loader`` and sizes they use. The tensors a method creates are parameters of the
layer, so that checkpoints load into them; the method reads them back with ``nn.Module.get_parameter``
while loading, and keeps typed handles of what its forward uses.
"""
from __future__ import annotations

from torch import nn

from kvforge.layers.linear import LinearBase


def linear_layer(layer: nn.Module) -> LinearBase:
    """``layer`` as the kvforge linear layer it is; ``TypeError`` for any other module."""
    if not isinstance(layer, LinearBase):
        raise TypeError(f"a linear quantization method was given a {type(layer).__name__}, not a kvforge linear "
                        "layer (kvforge.layers.linear)")
    return layer


def keep_when_random(param: nn.Parameter) -> None:
    """Dummy (random) weights leave ``param`` as the method set it: it holds what it must (GPTQ's sequential
    ``g_idx``). ``kvforge.model.loader`` reads the mark, an attribute of the parameter."""
    setattr(param, "random_fill", False)  # noqa: B010 - a mark on a tensor, not a declared attribute
