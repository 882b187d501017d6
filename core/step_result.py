"""What applying one step did to its requests: the typed answer of ``Scheduler.update``.

The scheduler is the one owner of a request's life: it applies a step's tokens, checks the stops a
token decides (EOS, ``stop_token_ids``, ``max_tokens``), ends requests and frees their blocks. Its
answers are the entries below; the output processor turns them into ``RequestOutput``s and writes no
request state. One entry per request, none per token: a step of 256 decodes makes 256 ``NewTokens``
and one list of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.errors import RequestFailure
from kvforge.request import Request, RequestStatus


@dataclass(slots=True)
class NewTokens:
    """A request took tokens in this step: ``token_ids`` were appended to its output, in order (one;
    or the accepted drafts and one more; a token-level stop cuts the rest). The list is the runner's
    own, not a copy: read it, never change it."""

    request: Request
    token_ids: list[int]

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class Finished:
    """A request ended normally: its blocks are back in the pool and it has left the queues."""

    request: Request
    status: RequestStatus  # FINISHED_STOPPED or FINISHED_LENGTH
    stop_reason: int | str | None = None  # the stop token or stop string; None for EOS and length

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def reason(self) -> str:
        """The OpenAI ``finish_reason``: ``"stop"`` or ``"length"``."""
        return self.status.value


@dataclass(slots=True)
class Failed:
    """A request failed on its own (``kvforge.errors``): status ``FINISHED_ERROR``, blocks freed."""

    request: Request
    error: RequestFailure

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class StepResult:
    """One step, applied. ``Scheduler.update`` fills ``new_tokens`` (in batch order, an ``n > 1``
    request's samples right after their first) and ``finished`` (the token-level stops). The engine
    adds the ends it asks the scheduler for while it completes the step: a grammar that terminated, a
    stop string (``Scheduler.stop_at_string``), and in ``failed`` the requests failed since the
    previous result (``Scheduler.fail_requests``: a launch error, a row with nothing to sample, a
    grammar that rejected a token)."""

    new_tokens: list[NewTokens] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
