"""The model floor: the model contract (:mod:`kvforge.model.interface`), the general model config and which
family's model class reads one (:mod:`kvforge.model.families`), the weight loader, the tokenizer source and
the quantization contract. Parallel layers (RoPE and weight maps among them) are in :mod:`kvforge.layers`,
LoRA in :mod:`kvforge.lora` (docs/architecture.md).

``from kvforge.model import CausalLM, ModelCapabilities, ...`` (the contract) is a public path; the names
load on use so that importing the config does not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvforge.model.interface import *  # noqa: F403


#: this floor's modules: the import system asks for them as attributes before importing them
_MODULES = frozenset({"interface", "config", "families", "loader", "tokenizer_source", "quantization"})


def __getattr__(name: str):
    if name not in _MODULES and not name.startswith("__"):
        interface = importlib.import_module("kvforge.model.interface")
        if hasattr(interface, name):
            return getattr(interface, name)
    raise AttributeError(f"module 'kvforge.model' has no attribute {name!r}")
