"""The image processor a vision-language checkpoint brings, or transformers' default for it."""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable


def checkpoint_image_processor(model_dir: str | None, default: Callable[[], Any]) -> Any:
    """The checkpoint's own image processor (``preprocessor_config.json`` in ``model_dir``), else
    ``default()`` (a checkpoint without one, or a model that is not a directory)."""
    if model_dir is not None and os.path.exists(os.path.join(model_dir, "preprocessor_config.json")):
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    return default()


def image_processor_class(model: str, name: str) -> Any:
    """transformers' PIL image processor ``<name>Pil`` of ``models/<model>`` (transformers >= 5.20: it needs
    no torchvision), else ``<name>`` (older transformers, e.g. 5.17 on the GPU machine)."""
    try:
        return getattr(importlib.import_module(f"transformers.models.{model}.image_processing_pil_{model}"),
                       f"{name}Pil")
    except (ImportError, AttributeError):
        return getattr(importlib.import_module("transformers"), name)
