"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    temperature: 0 means greedy; otherwise logits are divided by it. Must be >= 0.
    top_p: nucleus sampling mass in (0, 1]; 1 disables.
    top_k: keep the k most likely tokens; 0 (or -1) disables.
    min_p: drop tokens whose probability is below ``min_p`` times the top one; in [0, 1].
    seed: per-request random seed; the same seed gives the same sample whatever else is batched.
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
    # Filled by the engine: the model's end-of-sequence ids (unless ignore_eos).
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (
                not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            self.stop = list(self.stop)
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
