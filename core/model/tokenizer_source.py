"""Which tokenizer goes with a model source.

A GGUF file's tokenizer and chat template come from its ``tokenizer.*`` metadata; a file without
``tokenizer.chat_template`` (one converted from a pretrained, not instruction-tuned, checkpoint) gets its
family's published template from :data:`GGUF_FALLBACK_CHAT_TEMPLATES`, and ``--chat-template`` overrides both.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from kvforge.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")

#: Gemma 3's turn format, as google/gemma-3-*-it's tokenizer_config.json writes it (text parts only): BOS,
#: a system message folded into the first user turn, ``assistant`` spelled ``model``.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = (messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'][0]['text']) + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
#: model_type -> the chat template of a GGUF file of that family that carries none
GGUF_FALLBACK_CHAT_TEMPLATES: dict[str, str] = {"gemma3_text": GEMMA3_CHAT_TEMPLATE}


def tokenizer_for(config: Any, source: Any, model_config: Any) -> Any | None:
    """The explicit ``tokenizer`` option, else the model's own; ``None`` if the model has none
    (random-weight presets whose vocabulary no shipped tokenizer matches: prompts are token ids)."""
    if config.tokenizer:
        if not os.path.exists(config.tokenizer):
            raise ValueError(f"tokenizer: {config.tokenizer!r} does not exist")
        return load_tokenizer(config.tokenizer, config.trust_remote_code)
    if source.kind == "gguf":
        return _with_fallback_chat_template(load_tokenizer(source.path), model_config.model_type)
    if source.path and os.path.isdir(source.path):
        if any(os.path.exists(os.path.join(source.path, f)) for f in _TOKENIZER_FILES):
            return load_tokenizer(source.path, config.trust_remote_code)
        return None
    if source.kind == "dummy":
        # The default model's tokenizer fits presets of its vocabulary (smollm2-135m, tiny).
        from kvforge.model.loader import default_model_path
        try:
            path = default_model_path()
        except ValueError:
            return None
        if model_config.vocab_size == 49152:
            return load_tokenizer(path)
    return None


def _with_fallback_chat_template(tokenizer: Any, model_type: str) -> Any:
    """``tokenizer``, given :data:`GGUF_FALLBACK_CHAT_TEMPLATES`'s template for ``model_type`` when the file had none."""
    fallback = GGUF_FALLBACK_CHAT_TEMPLATES.get(model_type)
    if fallback is not None and not tokenizer.chat_template:
        logger.info("the GGUF file has no tokenizer.chat_template; using the built-in %s template "
                    "(--chat-template overrides it)", model_type)
        tokenizer.chat_template = fallback
    return tokenizer
