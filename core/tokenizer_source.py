"""Which tokenizer goes with a model source."""
from __future__ import annotations

import logging
import os
from typing import Any

from kvforge.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def tokenizer_for(config: Any, source: Any, model_config: Any) -> Any | None:
    """The explicit ``tokenizer`` option, else the model's own; ``None`` if the model has none
    (random-weight presets whose vocabulary no shipped tokenizer matches: prompts are token ids)."""
    if config.tokenizer:
        if not os.path.exists(config.tokenizer):
            raise ValueError(f"tokenizer: {config.tokenizer!r} does not exist")
        return load_tokenizer(config.tokenizer, config.trust_remote_code)
    if source.kind == "gguf":
        return load_tokenizer(source.path)
    if source.path and os.path.isdir(source.path):
        if any(os.path.exists(os.path.join(source.path, f)) for f in _TOKENIZER_FILES):
            return load_tokenizer(source.path, config.trust_remote_code)
        return None
    if source.kind == "dummy":
        # The default model's tokenizer fits presets of its vocabulary (smollm2-135m, tiny).
        from kvforge.model_loader import default_model_path
        try:
            path = default_model_path()
        except ValueError:
            return None
        if model_config.vocab_size == 49152:
            return load_tokenizer(path)
    return None
