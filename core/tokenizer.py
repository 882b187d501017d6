"""Tokenizer loading (HF directory, GGUF metadata, explicit path) and incremental detokenization."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)


def cache_dir() -> str:
    """kvforge's on-disk cache (``KVFORGE_CACHE_DIR``, default ``~/.cache/kvforge``)."""
    return os.environ.get("KVFORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvforge")


@lru_cache(maxsize=8)
def _load(path: str, gguf_file: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    if gguf_file is None:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # Building a tokenizer from GGUF metadata takes seconds; keep the converted one on disk,
    # keyed by the file's identity, so the next start takes a fraction of a second.
    full = os.path.join(path, gguf_file)
    st = os.stat(full)
    key = hashlib.sha256(f"{os.path.realpath(full)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    saved = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.exists(os.path.join(saved, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(saved)
        except Exception as exc:  # a damaged cache entry is rebuilt
            logger.warning("ignoring damaged tokenizer cache %s: %r", saved, exc)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    tmp = f"{saved}.tmp{os.getpid()}"
    try:
        tok.save_pretrained(tmp)
        shutil.rmtree(saved, ignore_errors=True)  # a damaged entry is replaced
        os.replace(tmp, saved)
    except OSError as exc:
        logger.warning("could not cache the GGUF tokenizer in %s: %r", saved, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer from a model directory, a tokenizer directory or a ``.gguf`` file."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer: GGUF file {path!r} does not exist")
        return _load(os.path.dirname(os.path.abspath(path)), os.path.basename(path), trust_remote_code)
    return _load(path, None, trust_remote_code)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a character.

    Decodes a small window of ids: text is released only once it no longer ends in an incomplete
    UTF-8 sequence (U+FFFD), and a few tokens of context before the window keep tokenizers that
    merge leading spaces correct.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: release held-back text, even an incomplete character."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        delta = self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
