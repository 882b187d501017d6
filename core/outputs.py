"""What ``LLM.generate`` and the engine return (shaped like vLLM's ``RequestOutput``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.errors import RequestFailure


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence. In a streaming delta, ``text`` and ``token_ids`` hold only what is new."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, "Logprob"]] | None = None  # per generated token, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first entry None
    # why the request failed (its outputs then finish with "error"); None for every other ending
    error: RequestFailure | None = None
