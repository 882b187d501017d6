"""The typed messages between a front end (``EngineProcessClient``) and its engine core process.

Each message is a frozen, slotted dataclass; a receiver dispatches on its type (``type(msg)``), never on a
string. A call into the engine is a message of its own type with an ``apply(engine)``: the set of calls
is the set of those types, so there is no method name to look up. They cross a Unix socket pickled.

Front end -> core: :class:`AddRequest`, :class:`AbortRequest`, :class:`Call` (of an :data:`EngineCall`),
:class:`Stop`. Core -> front end: :class:`Ready` or :class:`StartFailed` once, then :class:`Admitted` or
:class:`Refused` for every ``AddRequest`` (before any of its outputs), :class:`StepOutputs` once per step
(with the step's KV events, if any), :class:`CallReply`, :class:`Beat` when the loop has sent nothing else
for a while, :class:`Dead`.

Step outputs cross as :class:`OutputDelta`s, not ``RequestOutput``s: a streamed ``RequestOutput`` carries
its whole prompt (text, token ids, prompt log-probabilities) in every delta, which was most of what a
step pickled (11% of the engine core's time at 32 req/s). A delta carries them only when the front end
has not got them yet (:class:`PromptSent` keeps that on the core's side) and the front end puts them back
(:class:`PromptCache`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from kvforge.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from kvforge.engine.client import EngineClient
    from kvforge.engine.stats import EngineStats
    from kvforge.errors import RequestFailure
    from kvforge.kv_events import EventBatch
    from kvforge.lora.request import LoRARequest
    from kvforge.sampling_params import SamplingParams, StructuredOutputsParams

#: a prompt as the engine takes it: text, token ids, or a dict with ``prompt`` / ``prompt_token_ids``
PromptInput = Union[str, list[int], dict]


# -- front end -> core --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


# the calls: each names what it runs on the engine (an ``EngineClient``), and nothing else can be called
@dataclass(frozen=True, slots=True)
class GetStats:
    def apply(self, engine: EngineClient) -> EngineStats:
        return engine.get_stats()


@dataclass(frozen=True, slots=True)
class CheckStructuredOutputs:
    constraint: StructuredOutputsParams

    def apply(self, engine: EngineClient) -> None:
        engine.check_structured_outputs(self.constraint)


@dataclass(frozen=True, slots=True)
class AddLora:
    lora_request: LoRARequest

    def apply(self, engine: EngineClient) -> bool:
        return engine.add_lora(self.lora_request)


@dataclass(frozen=True, slots=True)
class RemoveLora:
    lora_int_id: int

    def apply(self, engine: EngineClient) -> bool:
        return engine.remove_lora(self.lora_int_id)


@dataclass(frozen=True, slots=True)
class ListLoras:
    def apply(self, engine: EngineClient) -> list[LoRARequest]:
        return engine.list_loras()


EngineCall = Union[GetStats, CheckStructuredOutputs, AddLora, RemoveLora, ListLoras]
#: every call type, for the receiver's check (a message of another type is refused, not run)
ENGINE_CALLS = (GetStats, CheckStructuredOutputs, AddLora, RemoveLora, ListLoras)


@dataclass(frozen=True, slots=True)
class Call:
    call_id: int
    call: EngineCall


# -- core -> front end --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    max_model_len: int
    vocab_size: int
    modalities: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StartFailed:
    error: BaseException


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request passed validation and is queued: its outputs follow."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The request failed validation or admission (a ``ValueError`` names the field), or failed later."""

    request_id: str
    error: BaseException


@dataclass(slots=True)
class OutputDelta:
    """A ``RequestOutput`` delta without its prompt unless the front end has not had it (``prompt_sent``
    False), and without prompt log-probabilities unless they grew."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None
    error: RequestFailure | None
    prompt_sent: bool
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True, slots=True)
class StepOutputs:
    deltas: list[OutputDelta]
    refused: list[Refused] = field(default_factory=list)
    kv_events: EventBatch | None = None  # the step's KV events (``enable_kv_events``), for the front end's log


@dataclass(frozen=True, slots=True)
class CallReply:
    call_id: int
    ok: bool
    value: object  # the call's result, or (not ok) the exception it raised

    @property
    def error(self) -> BaseException:
        """The exception a failed call raised."""
        value = self.value
        return value if isinstance(value, BaseException) else RuntimeError(f"the engine call failed: {value!r}")


@dataclass(frozen=True, slots=True)
class Beat:
    pass


@dataclass(frozen=True, slots=True)
class Dead:
    message: str


# -- the prompt, sent once --------------------------------------------------------------------------
class PromptSent:
    """The core's record of what each request's front end already has: its prompt, and how many prompt
    log-probability entries. Used on the engine loop's thread only."""

    def __init__(self) -> None:
        self._logprobs: dict[str, int] = {}  # request id -> prompt log-probability entries sent

    def delta(self, out: RequestOutput) -> OutputDelta:
        known = self._logprobs.get(out.request_id)
        plp = out.prompt_logprobs
        grew = plp is not None and (known is None or len(plp) != known)
        delta = OutputDelta(out.request_id, out.outputs, out.finished, out.num_cached_tokens, out.metrics, out.error,
                            prompt_sent=known is not None)
        if known is None:
            delta.prompt, delta.prompt_token_ids = out.prompt, out.prompt_token_ids
        if grew:
            delta.prompt_logprobs = plp
        if out.finished:
            self._logprobs.pop(out.request_id, None)
        else:
            self._logprobs[out.request_id] = len(plp) if plp is not None else 0
        return delta

    def forget(self, request_id: str) -> None:
        """The request ended without a finished output (aborted)."""
        self._logprobs.pop(request_id, None)


class PromptCache:
    """The front end's side of :class:`PromptSent`: puts each delta's prompt back. Used on the reader
    thread only."""

    def __init__(self) -> None:
        self._prompts: dict[str, list] = {}  # request id -> [prompt, prompt_token_ids, prompt_logprobs]

    def output(self, delta: OutputDelta) -> RequestOutput:
        if not delta.prompt_sent:
            known = self._prompts[delta.request_id] = [delta.prompt, delta.prompt_token_ids, None]
        else:
            known = self._prompts.get(delta.request_id) or [None, [], None]
        if delta.prompt_logprobs is not None:
            known[2] = delta.prompt_logprobs
        if delta.finished:
            self._prompts.pop(delta.request_id, None)
        return RequestOutput(delta.request_id, known[0], known[1], delta.outputs, delta.finished,
                             delta.num_cached_tokens, delta.metrics, known[2], delta.error)

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
