"""Which model class (family) reads a model's config, found through the model registry.

A ``config.json`` goes to the class registered under the architecture it names (``architectures[0]``);
one that names none, or names one nobody registered, goes by its ``model_type`` to the class whose
:class:`~kvforge.model.interface.ModelFamily` declares it; a GGUF file goes by ``general.architecture`` to
the class that declares that. Core reads the general fields (``kvforge.model.config.hf_fields`` /
``gguf_fields``) and the class's hook (``config_from_hf`` / ``config_from_gguf``) makes the family's config
of them; a class without one gets ``config_class(**fields)``. The named presets are the families' too.

Looking a family up by model type or GGUF architecture imports the registered model classes (their
tables are class attributes); a broken third-party one is skipped here, and fails when selected.
"""
from __future__ import annotations

import logging

from kvforge.model.config import (
    ConfigFields,
    GGUFArchitecture,
    GGUFMetadata,
    HFConfig,
    ModelConfig,
    gguf_fields,
    hf_fields,
)
from kvforge.model.interface import config_class_of, family_of

logger = logging.getLogger(__name__)


def registered() -> list[tuple[str, type]]:
    """(architecture, class) of every registered model class that imports, by architecture name."""
    from kvforge.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    classes = []
    for name in pm.names("model"):
        try:
            classes.append((name, pm.get("model", name)))
        except ImportError as exc:
            logger.debug("model %r is skipped in the family lookup: %s", name, exc)
    return classes


def by_model_type(model_type: str) -> tuple[str, type] | None:
    """(architecture, class) of the family that loads ``model_type`` (``ModelFamily.model_types``)."""
    for name, cls in registered():
        if family_of(cls).model_types.get(model_type) == name:
            return name, cls
    return None


def by_gguf_architecture(arch: str) -> tuple[str, type, GGUFArchitecture]:
    """(architecture, class, layout) of the family that reads GGUF ``general.architecture`` ``arch``;
    ``ValueError`` listing the architectures the registered families read."""
    known = []
    for name, cls in registered():
        family = family_of(cls)
        for gguf_arch, layout in family.gguf_architectures.items():
            if family.model_types.get(layout.model_type) == name:
                if gguf_arch == arch:
                    return name, cls, layout
                known.append(gguf_arch)
    raise ValueError(f"GGUF general.architecture is {arch!r}; supported: {', '.join(known)}")


def config_from_hf(hf: HFConfig) -> ModelConfig:
    """The config of a ``config.json`` (see the module docstring); ``ValueError`` when no registered
    family reads it and it names no architecture, or when its family refuses its model type."""
    from kvforge.plugin_manager import get_plugin_manager

    model_type = hf.get("model_type")
    named = (hf.get("architectures") or [None])[0]
    if isinstance(named, str) and named in get_plugin_manager().names("model"):
        return _built(get_plugin_manager().get("model", named), "config_from_hf", hf_fields(hf, named), hf)
    for _, cls in registered():
        reason = family_of(cls).refused_model_types.get(str(model_type))
        if reason is not None:
            raise ValueError(f"config.json field 'model_type' is {model_type!r}: {reason}")
    found = by_model_type(model_type) if isinstance(model_type, str) else None
    if found is not None:
        architecture, cls = found
        return _built(cls, "config_from_hf", hf_fields(hf, named if isinstance(named, str) else architecture), hf)
    if isinstance(named, str):  # nobody registers it: the general fields (building the model will say so)
        return ModelConfig(**hf_fields(hf, named))
    types = sorted({t for _, cls in registered() for t in family_of(cls).model_types})
    raise ValueError(f"config.json field 'model_type' is {model_type!r} and it names no 'architectures'; "
                     f"model types of the registered models: {', '.join(types)}")


def config_from_gguf(meta: GGUFMetadata) -> ModelConfig:
    """The config of a GGUF file, from the family that declares its ``general.architecture``."""
    architecture, cls, layout = by_gguf_architecture(meta.architecture)
    return _built(cls, "config_from_gguf", gguf_fields(meta, layout, architecture), meta)


def _built(cls: type, hook_name: str, fields: ConfigFields, source: HFConfig | GGUFMetadata) -> ModelConfig:
    """``cls.<hook_name>(fields, source)``, or ``config_class(**fields)`` for a class without the hook."""
    hook = getattr(cls, hook_name, None)
    config = hook(fields, source) if callable(hook) else config_class_of(cls)(**fields)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"{cls.__name__}.{hook_name} returned a {type(config).__name__}, not a ModelConfig")
    return config


def presets() -> dict[str, ModelConfig]:
    """Preset name -> config, of every registered family (the first class to declare a name keeps it)."""
    found: dict[str, ModelConfig] = {}
    for name, cls in registered():
        for preset, config in family_of(cls).presets.items():
            if config.architecture == name:
                found.setdefault(preset, config)
    return found
