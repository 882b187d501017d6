"""The engine's state for one request: its tokens, progress and status.

The scheduler's base class (``kvforge.scheduler``) owns a request's life: it applies tokens, decides
token-level stops and writes a finished status; everyone else reads (docs/plugins.md says what a
scheduler policy may set)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvforge.errors import RequestFailure
from kvforge.multimodal.inputs import block_extra_keys
from kvforge.sampling_params import SamplingParams

#: stands in ``output_token_ids`` for a token an in-flight step is sampling (async scheduling)
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV blocks freed
    SWAPPED = "swapped"  # preempted by swapping: its KV blocks in the CPU pool, num_computed_tokens kept
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed on its own (see kvforge.errors); ``Request.error`` says why

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    NOTE: ``num_computed_tokens`` counts tokens whose K/V are in the cache; the tokens still to run
    are ``all_token_ids[num_computed_tokens:]`` (the whole prompt at first, one token per decode step,
    everything again after a preemption by recompute). Under speculative decoding a decode step also
    runs ``draft_token_ids``, which are never part of the request's tokens (see docs/speculative.md).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    max_tokens: int = 16  # resolved by the engine from sampling_params and max_model_len
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    cache_salt: str | None = None  # extra key of the prefix-cache hashes (isolates tenants)
    lora_request: Any = None  # kvforge.LoRARequest: the adapter the request runs under (None: the base model)
    bad_words_token_ids: list[list[int]] | None = None  # tokenized SamplingParams.bad_words
    grammar: Any = None  # structured-output state (kvforge.engine.structured_output.GrammarState)
    # n > 1: sample 0 computes the prompt once; when its prefill completes, these samples take its
    # blocks by reference (copy-on-write) and draw their first tokens from the same logits.
    forks: list["Request"] = field(default_factory=list)
    fork_of: "Request | None" = None
    # async scheduling: how many tokens a launched step samples for this request that the host has
    # not seen yet; each is PLACEHOLDER at the end of output_token_ids (the runner reads them from the device)
    num_placeholders: int = 0
    # pipeline parallelism: a launched step of this request is still going through the stages, and
    # no later step may include the request until it is applied (the engine sets and clears it)
    held: bool = False
    # speculative decoding: the tokens a drafter proposed for the next step to verify (never hashed,
    # never counted in num_tokens); the scheduler may cut them to fit its budget
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # [len(draft_token_ids), vocab] device tensor q of the drafts, or None (one-hot)
    error: RequestFailure | None = None  # set with status FINISHED_ERROR
    # multimodal: the prompt's items (kvforge.multimodal.inputs.MultiModalFeature), by offset; () for text
    mm_features: tuple = ()

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def cache_key(self) -> Any:
        """The extra key of the request's prefix-cache hashes: its adapter and its salt (None: neither),
        so that blocks computed under one adapter (or tenant) never serve another."""
        lora = self.lora_int_id
        if not lora:
            return self.cache_salt
        return (lora, self.cache_salt)

    def block_key(self, start: int, end: int) -> Any:
        """The extra key of the prefix-cache hash of the block holding positions [start, end):
        :attr:`cache_key`, and the content hashes of the items whose placeholders fall in it (the same
        image hits the cache, another behind the same placeholder tokens does not)."""
        if not self.mm_features:
            return self.cache_key
        items = block_extra_keys(self.mm_features, start, end)
        return self.cache_key if items is None else (self.cache_key, items)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_placeholder(self) -> None:
        """A launched step will sample this request's next token (see :data:`PLACEHOLDER`)."""
        assert self.num_placeholders == 0, "one step in flight at most"
        self.output_token_ids.append(PLACEHOLDER)
        self.num_placeholders = 1

    def clear_drafts(self) -> None:
        self.draft_token_ids, self.draft_probs = [], None

    def drop_placeholders(self) -> None:
        """The step in flight will never be applied (the request ended)."""
        if self.num_placeholders:
            del self.output_token_ids[-self.num_placeholders:]
            self.num_placeholders = 0
