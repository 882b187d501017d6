"""A request's checks before it reaches the scheduler: the prompt's tokens and the sampling
parameters against the model, the engine's limits and the registered plugins. Each failure is a
``ValueError`` naming the field (an OpenAI-style 400 over HTTP)."""
from __future__ import annotations

from typing import Any, Iterable

from kvforge.config import EngineConfig
from kvforge.sampling_params import SamplingParams


def tokenize_prompt(tokenizer: Any, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a string, a list of token ids, or a dict holding either."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids: expected a list of integers")
            return text, list(ids)
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids")
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")


def check_request(ids: list[int], params: SamplingParams, *, config: EngineConfig, vocab_size: int,
                  max_model_len: int, tokenizer: Any, logits_processors: Iterable[str],
                  plugin_manager: Any = None) -> None:
    """The prompt's ids and the sampling parameters, against the model and the engine's limits."""
    if not ids:
        raise ValueError("prompt: must not be empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size}), got one out of range")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt: {len(ids)} tokens is longer than max_model_len={max_model_len} "
                         f"allows (at most {max_model_len - 1}, leaving room for one output token)")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v is not None and v > config.max_logprobs:
            raise ValueError(f"{name}: {v} is more than max_logprobs={config.max_logprobs}")
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        token_ids = getattr(params, name)
        if token_ids and max(token_ids) >= vocab_size:
            raise ValueError(f"{name}: token ids must be < the vocabulary size {vocab_size}")
    registered = list(logits_processors)
    for name in params.logits_processors or []:
        if name not in registered:
            raise ValueError(f"logits_processors: unknown logits processor {name!r}; valid names: "
                             f"{', '.join(registered) or '(none)'}")
    if params.extra_args:
        check_extra_args(params, field="extra_args", strict=False, plugin_manager=plugin_manager)
    if (params.bad_words or params.structured_outputs) and tokenizer is None:
        field = "bad_words" if params.bad_words else "structured_outputs"
        raise ValueError(f"{field}: needs a tokenizer, and this model has none")
    limit = min(config.max_n, config.max_num_seqs)
    if params.n > limit:
        raise ValueError(f"n: {params.n} is more than the limit of {limit} "
                         f"(max_n={config.max_n}, max_num_seqs={config.max_num_seqs})")


def check_extra_args(params: SamplingParams, *, field: str, strict: bool = True, plugin_manager: Any = None) -> None:
    """``params.extra_args`` against the ``request_options`` of the logits processors the request enables
    (``kvforge.sampler.LogitsProcessor``): each key a processor's options declare is checked on its own,
    then the processor's keys together; a bad value is a ``ValueError`` naming ``field.key``. With
    ``strict`` (over HTTP: no field is silently ignored), a key no enabled processor declares is one too.
    ``plugin_manager``: the engine's (default: the process's)."""
    import dataclasses

    from kvforge.plugin_manager import get_plugin_manager

    args = params.extra_args or {}
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise ValueError(f"{field}: must be a dict with string keys")
    pm = plugin_manager or get_plugin_manager()
    claimed: set[str] = set()
    for name in params.logits_processors or []:
        options = getattr(pm.get("logits_processor", name), "request_options", None)
        if options is None:
            continue
        keys = {f.name for f in dataclasses.fields(options)}
        claimed |= keys
        mine = {k: v for k, v in args.items() if k in keys}
        for key, value in mine.items():
            _build(options, {key: value}, f"{field}.{key}", name)
        _build(options, mine, field, name)
    if strict:
        unknown = sorted(set(args) - claimed)
        if unknown:
            enabled = ", ".join(params.logits_processors or []) or "none"
            raise ValueError(f"{field}.{unknown[0]}: no logits processor this request enables takes it (enabled: "
                             f"{enabled}; each one's arguments are listed by `kvforge plugins`)")


def _build(options: type, kwargs: dict, where: str, name: str) -> None:
    try:
        options(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc} (logits processor {name!r})") from None


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word's token ids, with and without a leading space (as vLLM does)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words: {word!r} tokenizes to no tokens, so it cannot be blocked")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
