"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names and meanings)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

#: below this temperature sampling is greedy (dividing logits by it would overflow to inf / NaN)
SAMPLING_EPS = 1e-5
#: above this every token is equally likely anyway; far above it float32 logits / temperature underflow
MAX_TEMPERATURE = 1e4
#: repetition_penalty divides or multiplies float32 logits: outside this range they over- or underflow
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
#: seeds torch's generators accept; ``seed + i`` of sample ``i`` (``n > 1``) must fit too
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
#: size limits of list fields (docs/reliability.md); each is far above real use
MAX_STOP, MAX_STOP_CHARS = 64, 1024
MAX_TOKEN_LIST = 8192  # stop_token_ids, allowed_token_ids, logit_bias entries
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 1024, 1024


def _number(v) -> bool:
    """A finite int or float (NaN and infinities are refused everywhere)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, dict or string), ``regex``, ``choice`` (a list
    of strings, the output is one of them) or ``json_object=True`` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [n for n, v in (("json", self.json), ("regex", self.regex), ("choice", self.choice),
                                ("json_object", self.json_object or None)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of json, regex, choice, json_object; got {given}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")

    def key(self) -> tuple:
        import json as _json
        schema = self.json if isinstance(self.json, str) or self.json is None else _json.dumps(self.json, sort_keys=True)
        return (schema, self.regex, tuple(self.choice) if self.choice else None, self.json_object)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    temperature: 0 means greedy; otherwise logits are divided by it. In [0, 1e4]; below
        ``SAMPLING_EPS`` (1e-5) it is greedy (and set to 0).
    top_p: nucleus sampling mass in (0, 1]; 1 disables.
    top_k: keep the k most likely tokens; 0 (or -1) disables.
    min_p: drop tokens whose probability is below ``min_p`` times the top one; in [0, 1].
    seed: per-request random seed; the same seed gives the same sample whatever else is batched.
        In [-2**63, 2**64 - 1]; with ``n > 1`` sample ``i`` uses ``seed + i``, which must fit too.
    max_tokens: the most tokens to generate (>= 1); ``None`` means up to the context length.
    stop_token_ids: token ids that end generation (the token is kept in the output ids).
    ignore_eos: keep generating past the model's end-of-sequence token.
    n: number of samples to generate for the prompt (each an entry of ``RequestOutput.outputs``).
    stop: strings that end generation when they appear in the text (matched across token
        boundaries); the text is cut before the stop string unless ``include_stop_str_in_output``.
    logprobs: return the sampled token's log-probability and the top-``logprobs`` alternatives at
        each step (0: only the sampled token's); log-softmax of the model's raw logits.
    prompt_logprobs: the same for every prompt token after the first.
    skip_special_tokens: leave special tokens out of the text.
    spaces_between_special_tokens: put spaces around special tokens in the text (slow tokenizers).
    presence_penalty: subtract this from the logit of every token already generated, in [-2, 2].
    frequency_penalty: subtract this times the token's count so far, in [-2, 2].
    repetition_penalty: divide positive (multiply negative) logits of tokens in the prompt or output
        by this (in [1e-3, 1e3]; 1 disables).
    logit_bias: token id -> value added to its logit, values in [-100, 100].
    min_tokens: generate at least this many tokens before EOS or ``stop_token_ids`` may end it.
    allowed_token_ids: sample only among these tokens.
    bad_words: words never to generate (their token sequences are blocked at their last token).
    structured_outputs: constrain the output to a JSON schema, a regex, a list of choices or any JSON.
    logits_processors: names of registered logits processors to apply to this request.
    extra_args: free-form arguments for logits processors and other plugins (by name).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: "StructuredOutputsParams | None" = None
    logits_processors: list[str] | None = None
    extra_args: dict | None = None
    # Filled by the engine: the model's end-of-sequence ids (unless ignore_eos).
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = _token_list("stop_token_ids", self.stop_token_ids, allow_empty=True)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None:
            if not _int(self.seed):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1] (with n={self.n}, seed + {self.n - 1} too), "
                                 f"got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            if len(self.stop) > MAX_STOP or max(map(len, self.stop), default=0) > MAX_STOP_CHARS:
                raise ValueError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters, got "
                                 f"{len(self.stop)} of up to {max(map(len, self.stop))}")
            self.stop = list(self.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _number(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError, OverflowError):
                raise ValueError("logit_bias must map token ids to numbers") from None
            if len(bias) > MAX_TOKEN_LIST:
                raise ValueError(f"logit_bias: at most {MAX_TOKEN_LIST} entries, got {len(bias)}")
            if any(not -100.0 <= v <= 100.0 for v in bias.values()) or any(k < 0 for k in bias):
                raise ValueError("logit_bias values must be in [-100, 100] and keys non-negative token ids")
            self.logit_bias = bias
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_list("allowed_token_ids", self.allowed_token_ids, allow_empty=False)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError("bad_words must be a list of non-empty strings")
            if len(self.bad_words) > MAX_BAD_WORDS or max(map(len, self.bad_words), default=0) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words: at most {MAX_BAD_WORDS} words of at most {MAX_BAD_WORD_CHARS} "
                                 f"characters, got {len(self.bad_words)}")
            self.bad_words = list(self.bad_words)
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.logits_processors is not None:
            if not all(isinstance(n, str) for n in self.logits_processors):
                raise ValueError("logits_processors must be a list of names")
            self.logits_processors = list(self.logits_processors)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self) -> "SamplingParams":
        import copy
        return copy.deepcopy(self)


def _token_list(name: str, ids, *, allow_empty: bool) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{name} must be a list of non-negative token ids")
    if not ids and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    if len(ids) > MAX_TOKEN_LIST:
        raise ValueError(f"{name}: at most {MAX_TOKEN_LIST} token ids, got {len(ids)}")
    return list(ids)
