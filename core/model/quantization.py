"""Quantization methods: how a model's linear layers store their weights and multiply by them
(docs/quantization.md).

A method plugs into the layers (``kvforge.layers``), never into a model file. The engine builds one
:class:`QuantizationMethod` (``EngineConfig.quantization``, or the method that loads the checkpoint's
``quantization_config``: :func:`resolve`) and builds the model inside :func:`building`. Linear layers
built there hold their full-precision ``weight`` on the meta device (no memory) until
:func:`attach_all`, which the loader calls once the model is built and every layer's name is known,
gives each layer its :class:`LinearMethod`. The contract, in the order it is used:

1. ``QuantizationMethod.linear_method(layer, names)``: the layer's method, or None (the layer stays in
   the model dtype); ``names`` are the checkpoint modules the layer holds (``q_proj``, ``k_proj`` and
   ``v_proj`` for a fused QKV layer), so that a format's ignore list and per-layer schemes apply.
2. ``LinearMethod.create_weights(layer)``: the layer's parameters, each with a ``weight_loader`` that
   keeps this rank's slice (``layer.make_param``); the default makes the full-precision weight.
3. The checkpoint is loaded through those loaders (``model.load_weights``, or seeded dummy weights).
4. ``process_weights_after_loading(layer)``: once per layer, after every tensor is in: quantize on
   load, repack for a kernel, free what is no longer needed.
5. ``apply(layer, x)``: ``x @ W^T`` for this rank's part (the layer adds the bias and the all-reduce).

Embeddings and the LM head stay in the model dtype.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterator, Protocol, cast, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class QuantizableLayer(Protocol):
    """What a linear layer that takes a quantization method has (``kvforge.layers.linear.LinearBase``; a
    third-party layer also sets ``quantizable = True``)."""

    quant_method: LinearMethod | None

    def materialize_weight(self) -> None: ...


class LinearMethod(ABC):
    """How one linear layer holds and applies its weight."""

    def create_weights(self, layer: nn.Module) -> None:
        """Make the layer's parameters; the default makes the full-precision ``weight``."""
        if not isinstance(layer, QuantizableLayer):
            raise TypeError(f"{type(layer).__name__} is not a quantizable linear layer (no materialize_weight)")
        layer.materialize_weight()

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027  (optional)
        """Called once, after the whole checkpoint is loaded; the default changes nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x [tokens, in] @ W^T`` -> ``[tokens, out]`` in ``x``'s dtype, without the bias."""


class QuantizationMethod(ABC):
    """One engine's quantization: built once per rank as ``cls(engine_config=..., model_config=...,
    **options)`` (``options`` from the config file's ``[plugins.<name>]`` table). A method for a
    pre-quantized format reads ``model_config.quantization_config`` (config.json's) and raises a
    ``ValueError`` naming the field for what it cannot load."""

    #: the name ``EngineConfig.quantization`` selects (also set by the registry)
    name: ClassVar[str] = ""
    #: ``quantization_config.quant_method`` values of the checkpoints it loads (empty: it quantizes an
    #: unquantized checkpoint on load only)
    checkpoint_formats: ClassVar[tuple[str, ...]] = ()
    #: whether it quantizes an unquantized checkpoint on load
    quantizes_on_load: ClassVar[bool] = True

    def __init__(self, *, engine_config: Any = None, model_config: Any = None, **options: Any):
        self.engine_config, self.model_config = engine_config, model_config

    @property
    def checkpoint_config(self) -> dict[str, Any] | None:
        """The checkpoint's ``quantization_config`` (None: an unquantized checkpoint)."""
        return getattr(self.model_config, "quantization_config", None)

    @abstractmethod
    def linear_method(self, layer: nn.Module, names: list[str]) -> LinearMethod | None:
        """The method for one linear layer holding the checkpoint modules ``names`` (None: leave it in
        the model dtype)."""

    def moe_method(self, layer: nn.Module) -> MoEMethod | None:
        """The method for one mixture-of-experts layer (``kvforge.layers.moe.FusedMoE``), asked while the
        layer is built (None: leave its experts in the model dtype). Default: a ``ValueError``, so a
        method that knows nothing of experts never leaves them silently unquantized."""
        raise ValueError(f"quantization {self.name!r} does not support mixture-of-experts layers "
                         "(docs/quantization.md#mixture-of-experts); serve this model unquantized")


class MoEMethod(ABC):
    """How one quantization format stores and applies a ``FusedMoE`` layer's experts."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace the layer's ``w13`` / ``w2`` (model dtype) with the format's parameters."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027  (optional)
        """Convert the loaded tensors once (repack, fold scales)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' output [T, H] for x [T, H] routed as given (before the tensor-parallel sum)."""


def registered(pm: Any) -> dict[str, type]:
    """The registered methods that import (one that fails cannot load a checkpoint either)."""
    classes = {}
    for name in pm.names("quantization_method"):
        try:
            classes[name] = pm.get("quantization_method", name)
        except (ImportError, ValueError):
            continue
    return classes


def resolve(registry: dict[str, type], requested: str | None, model_config: Any) -> str | None:
    """The method to build: ``requested`` (``EngineConfig.quantization``), or for a checkpoint with a
    ``quantization_config`` the registered method that loads its ``quant_method``. ``ValueError``
    naming the field when they disagree or nothing loads it."""
    qc = getattr(model_config, "quantization_config", None)
    if qc is None:
        if requested is not None and not registry[requested].quantizes_on_load:
            raise ValueError(f"quantization={requested!r} loads pre-quantized checkpoints only, and this "
                             "checkpoint's config.json has no quantization_config")
        return requested
    fmt = qc.get("quant_method")
    loaders = sorted(n for n, cls in registry.items() if fmt in cls.checkpoint_formats)
    if requested is not None:
        if requested not in loaders:
            raise ValueError(f"quantization={requested!r} cannot load this checkpoint: its config.json "
                             f"quantization_config has quant_method {fmt!r}"
                             + (f", loaded by {', '.join(loaders)}" if loaders else ""))
        return requested
    if not loaders:
        formats = sorted({f for cls in registry.values() for f in cls.checkpoint_formats})
        raise ValueError(f"config.json field 'quantization_config' has quant_method {fmt!r}, which no "
                         f"registered quantization method loads; supported: {', '.join(formats)}")
    if len(loaders) > 1 and fmt not in loaders:  # a plugin's and a built-in's: which one is not ours to guess
        raise ValueError(f"quant_method {fmt!r} is loaded by several quantization methods ({', '.join(loaders)}); "
                         "name one with quantization=")
    return fmt if fmt in loaders else loaders[0]


def ignored(names: list[str], patterns: list[str] | None, field: str, *, exact: bool = False) -> bool:
    """Whether a checkpoint keeps a layer (holding modules ``names``) unquantized: every name contains
    one of ``patterns`` (vLLM's rule for AWQ's ``modules_to_not_convert``), or with ``exact`` equals one
    (vLLM's rule for fp8's ``ignored_layers``); a fused layer half ignored is a ``ValueError`` naming
    ``field``."""
    hits = [any(p == n if exact else p in n for p in patterns or ()) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(f"quantization_config field {field!r} ignores part of a fused layer: "
                         f"{[n for n, h in zip(names, hits) if h]} but not the rest of {names}")
    return all(hits)


_current: QuantizationMethod | None = None


def current() -> QuantizationMethod | None:
    """The quantization of the model being built (None outside :func:`building`)."""
    return _current


@contextlib.contextmanager
def building(method: QuantizationMethod | None) -> Iterator[QuantizationMethod | None]:
    """Linear layers constructed inside defer their weights to :func:`attach_all` with ``method``."""
    global _current
    old, _current = _current, method
    try:
        yield method
    finally:
        _current = old


def checkpoint_names(model: nn.Module, module_name: str) -> list[str]:
    """The checkpoint modules a layer of ``model`` holds: one, or for a fused layer each part listed in
    the model class's ``packed_modules_mapping`` (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``)."""
    parent, _, leaf = module_name.rpartition(".")
    packed = getattr(model, "packed_modules_mapping", {}).get(leaf)
    if not packed:
        return [module_name]
    return [f"{parent}.{p}" if parent else p for p in packed]


def attach_all(model: nn.Module, method: QuantizationMethod | None) -> None:
    """Give every linear layer of a freshly built ``model`` its method (from ``method``) and let it
    create its weights, on the current default device; a layer without one gets its full-precision
    weight. A method whose ``create_weights`` made parameters of its own leaves the meta placeholder
    ``weight`` behind: it is dropped. A method given a model without such layers is a ``ValueError``
    (it would change nothing)."""
    layers = 0
    for name, module in model.named_modules():
        if not getattr(module, "quantizable", False):
            continue
        linear = cast(QuantizableLayer, module)  # ``quantizable = True`` promises it (LinearBase does)
        if linear.quant_method is not None:
            continue
        layers += 1
        lm = method.linear_method(module, checkpoint_names(model, name)) if method is not None else None
        linear.quant_method = lm
        if lm is None:
            linear.materialize_weight()
            continue
        lm.create_weights(module)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_meta:
            del module.weight
    if method is not None and layers == 0:
        raise ValueError(f"quantization {method.name!r}: the model {type(model).__name__} has no kvforge.layers "
                         "linear layers to quantize")


def process_after_loading(model: nn.Module) -> None:
    """Run every quantized layer's ``process_weights_after_loading`` (the checkpoint is in)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
