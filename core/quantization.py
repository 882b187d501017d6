"""Quantization methods: how a model's linear layers store their weights and multiply by them
(docs/quantization.md).

A method plugs into the layers (``kvforge.layers``), never into a model file. The engine builds one
:class:`QuantizationMethod` (``EngineConfig.quantization``, a name registered through the
``register_quantization_methods`` hook) and builds the model inside :func:`building`; each linear
layer then asks it for a :class:`LinearMethod` and keeps it. The contract, in the order it is used:

1. ``create_weights(layer)``: the layer has made its full-precision ``weight`` (and ``bias``), each
   with a ``weight_loader`` that knows this rank's slice; a method for a pre-quantized format replaces
   or adds parameters of its own, each with a loader.
2. The checkpoint is loaded through those loaders (``model.load_weights``, or seeded dummy weights).
3. ``process_weights_after_loading(layer)``: once per layer, after every tensor is in: quantize on
   load, repack for a kernel, free what is no longer needed.
4. ``apply(layer, x)``: ``x @ W^T`` for this rank's part (the layer adds the bias and the all-reduce).

Embeddings and the LM head stay in the model dtype.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterator

import torch
from torch import nn


class LinearMethod(ABC):
    """How one linear layer holds and applies its weight."""

    def create_weights(self, layer: nn.Module) -> None:  # noqa: B027  (optional: the default keeps them)
        """Called once the layer has made its full-precision parameters; the default keeps them."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027  (optional)
        """Called once, after the whole checkpoint is loaded; the default changes nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x [tokens, in] @ W^T`` -> ``[tokens, out]`` in ``x``'s dtype, without the bias."""


class QuantizationMethod(ABC):
    """One engine's quantization: built once per rank as ``cls(engine_config=..., model_config=...,
    **options)`` (``options`` from the config file's ``[plugins.<name>]`` table)."""

    #: the name ``EngineConfig.quantization`` selects (also set by the registry)
    name: ClassVar[str] = ""
    #: weight dtypes of the checkpoints it quantizes on load (empty: a pre-quantized format only)
    supported_act_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)

    def __init__(self, *, engine_config: Any = None, model_config: Any = None, **options: Any):
        self.engine_config, self.model_config = engine_config, model_config

    @abstractmethod
    def linear_method(self, layer: nn.Module) -> LinearMethod | None:
        """The method for one linear layer (None: leave it in the model dtype)."""


_current: QuantizationMethod | None = None


def current() -> QuantizationMethod | None:
    """The quantization of the model being built (None outside :func:`building`)."""
    return _current


@contextlib.contextmanager
def building(method: QuantizationMethod | None) -> Iterator[QuantizationMethod | None]:
    """Linear layers constructed inside use ``method``."""
    global _current
    old, _current = _current, method
    try:
        yield method
    finally:
        _current = old


def attach(layer: nn.Module) -> LinearMethod | None:
    """Give a freshly built linear layer its method (from :func:`current`) and let it create weights."""
    method = _current.linear_method(layer) if _current is not None else None
    layer.quant_method = method
    if method is not None:
        method.create_weights(layer)
    return method


def process_after_loading(model: nn.Module) -> None:
    """Run every quantized layer's ``process_weights_after_loading`` (the checkpoint is in)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
