"""Reading a PEFT LoRA adapter: ``adapter_config.json`` and its tensors, checked before use.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` (or ``adapter_model.bin``) with one
pair per adapted module::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out_features, r]

PEFT computes ``y = W x + (B A x) * scaling`` with ``scaling = lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``). Everything this reader cannot honour is refused by name (DoRA, trained
biases, ``modules_to_save``, per-module rank/alpha patterns, embedding or LM-head adapters) rather
than silently dropped.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.errors import is_device_error

#: the projections an adapter may target (HF names; kvforge fuses q/k/v and gate/up)
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."
_CONFIG = "adapter_config.json"
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class AdapterConfig:
    """What kvforge reads of ``adapter_config.json``."""

    path: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # names, or PEFT's regular expression

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _fail(field: str, message: str) -> ValueError:
    return ValueError(f"lora_request.lora_path: {field}: {message}")


def read_adapter_config(path: str, max_lora_rank: int) -> AdapterConfig:
    """Parse and check a PEFT adapter's config; ``ValueError`` naming the field and the limit."""
    cfg_path = os.path.join(path, _CONFIG)
    # NOTE: one message whether the path is missing, not a directory or a directory of something else,
    # so that the error tells a client nothing about which paths exist on the server
    if not (os.path.isfile(cfg_path) and any(os.path.isfile(os.path.join(path, w)) for w in _WEIGHTS)):
        raise ValueError(f"lora_request.lora_path: {path!r} is not a LoRA adapter directory (a PEFT adapter "
                         f"saved with save_pretrained: {_CONFIG} and {' or '.join(_WEIGHTS)})")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, nested too deep
        raise _fail(_CONFIG, f"cannot be read as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, dict):
        raise _fail(_CONFIG, "must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _fail("peft_type", f"only LORA adapters are served, got {raw.get('peft_type')!r}")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail("r", f"a positive integer is required, got {rank!r}")
    if rank > max_lora_rank:
        raise _fail("r", f"the adapter's rank {rank} exceeds max_lora_rank={max_lora_rank} (--max-lora-rank)")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail("lora_alpha", f"a number is required, got {alpha!r}")
    for key, refused in (("use_dora", "DoRA adapters are not supported"),
                         ("fan_in_fan_out", "transposed (Conv1D) weights are not supported")):
        if raw.get(key):
            raise _fail(key, refused)
    if raw.get("bias", "none") != "none":
        raise _fail("bias", f"trained biases are not supported (bias={raw['bias']!r})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if raw.get(key):
            raise _fail(key, f"not supported (got {raw[key]!r}); kvforge serves plain per-projection adapters")
    targets = raw.get("target_modules") or []
    if not isinstance(targets, str):
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise _fail("target_modules", f"a list of module names or a regular expression is required, "
                                          f"got {targets!r}")
        targets = tuple(targets)
        bad = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_MODULES)
        if bad:
            raise _fail("target_modules", f"{bad} cannot be adapted; supported: {list(SUPPORTED_MODULES)}")
    return AdapterConfig(path, rank, float(alpha), bool(raw.get("use_rslora", False)), targets)


def load_adapter_tensors(path: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors by checkpoint name (on the CPU). ``ValueError`` naming ``lora_path`` for a
    file that cannot be read as tensors (truncated, corrupt, a pickle of anything but tensors: refused by
    ``weights_only``, never run); only a device-level error (``is_device_error``) passes through."""
    st = os.path.join(path, _WEIGHTS[0])
    name = _WEIGHTS[0] if os.path.isfile(st) else _WEIGHTS[1]
    try:
        if name == _WEIGHTS[0]:
            from safetensors.torch import load_file

            tensors = load_file(st)
        else:
            with warnings.catch_warnings():  # an old pickle protocol is refused below, not warned about
                warnings.simplefilter("ignore")
                tensors = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
    except Exception as exc:
        if is_device_error(exc):
            raise
        raise _fail(name, f"cannot be read as LoRA weights: {_reason(exc)}") from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise _fail(name, "must hold a mapping of tensor names to tensors")
    return tensors


def _reason(exc: BaseException) -> str:
    """A short reason for a file that failed to load (torch's unpickling advice is not for clients)."""
    if isinstance(exc, pickle.UnpicklingError):
        return "it holds Python objects other than tensors (refused without running them)"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def adapter_modules(tensors: dict[str, Any], cfg: AdapterConfig, num_layers: int
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module name: (A [r, in], B [out, r] * scaling)}`` keyed as the base checkpoint names modules
    (``model.layers.3.self_attn.q_proj``); B carries PEFT's scaling, in float32."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        key = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
        for leaf in ("lora_A", "lora_B"):
            suffix = f".{leaf}.weight"
            if key.endswith(suffix):
                pairs.setdefault(key[:-len(suffix)], {})[leaf] = t
                break
        else:
            raise _fail(os.path.basename(name), f"tensor {name!r} is not a LoRA A/B weight of a supported "
                                                f"projection ({list(SUPPORTED_MODULES)})")
    out = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise _fail(module, f"has only {sorted(ab)}; both lora_A and lora_B are required")
        a, b = ab["lora_A"], ab["lora_B"]
        parts = module.split(".")
        if parts[-1] not in SUPPORTED_MODULES or len(parts) < 4 or parts[:2] != ["model", "layers"]:
            raise _fail(module, f"cannot be adapted; supported: {list(SUPPORTED_MODULES)} of model.layers.N")
        if not parts[2].isdigit() or int(parts[2]) >= num_layers:
            raise _fail(module, f"layer {parts[2]} does not exist (the model has {num_layers})")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _fail(module, f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not form a rank-r pair")
        if a.shape[0] > cfg.rank:
            raise _fail(module, f"rank {a.shape[0]} exceeds the config's r={cfg.rank}")
        out[module] = (a.float(), b.float() * cfg.scaling)
    if not out:
        raise _fail("adapter_model", "holds no LoRA weights")
    return out
