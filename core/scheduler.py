"""The scheduler contract: which requests run in the next step, and how many tokens each.

One token budget per step (``max_num_batched_tokens``) covers prompt chunks, decode tokens and
draft tokens alike; there are no separate prefill and decode phases. A step's result for a request
is a list of tokens (more than one when it verified drafts: docs/speculative.md). The base class keeps the queues and does
the bookkeeping shared by every policy (``add``, ``abort``, ``update``); a policy implements
``schedule``.

The base class is the one owner of a request's life: only it applies tokens, decides token-level
stops, writes a finished status and frees a finished request's blocks. Everyone else asks it:
``update`` answers with a :class:`~kvforge.step_result.StepResult`; the engine ends requests with
``stop`` (a stop string, a terminated grammar), ``fail_requests`` and ``abort``; beam search drives its
beams with ``add_driven``, ``fork`` and ``append_tokens``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Iterable, Iterator, Protocol

from kvforge.errors import RequestFailure
from kvforge.kv_cache import KVCacheManager
from kvforge.multimodal.spans import chunk_limit
from kvforge.request import Request, RequestStatus
from kvforge.step_result import Failed, Finished, NewTokens, StepResult


@dataclass
class SchedulerOutput:
    """One step's batch, in the order the runner lays it out."""

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # NOTE: the runner runs the swaps before any other cache write of the step (see kvforge.rank.swap)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, CPU block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, device block)
    preempted: list[Request] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)  # ended since the last step
    # speculative decoding: the drafts this step verifies, per request (counted in num_scheduled_tokens)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    """What one forward produced: the new tokens of each request whose step completed its tokens
    (one, or the accepted drafts and one more when it verified drafts), and their log-probabilities
    (one entry per token) where the request asked for them."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request -> (position of the first entry, one entry per prompt token predicted in this step)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    num_preemptions_swap: int = 0  # of those, by swapping blocks to the CPU pool (the rest recompute)
    num_swapped: int = 0  # requests whose blocks wait in the CPU pool now
    waiting_by_priority: dict[int, int] = field(default_factory=dict)  # Request.priority -> waiting count


class RequestQueue(Protocol):
    """What the base class and ``fcfs`` call on ``Scheduler.waiting``: a ``deque``, or a policy's own
    container (``priority``'s sorted queue)."""

    def append(self, req: Request, /) -> None: ...
    def appendleft(self, req: Request, /) -> None: ...
    def extendleft(self, reqs: Iterable[Request], /) -> None: ...
    def popleft(self) -> Request: ...
    def remove(self, req: Request, /) -> None: ...
    def __getitem__(self, i: int, /) -> Request: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class Scheduler(ABC):
    """Queues requests, builds each step's batch within the token and sequence budgets."""

    name: str = ""

    def __init__(self, *, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_loras: int | None = None, **options: Any):
        """``max_loras`` (given only with LoRA on): the most distinct adapters the running requests may
        use, so that every step's adapters fit the device slots (:meth:`lora_fits`)."""
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: RequestQueue = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()
        self._driven: set[str] = set()  # requests whose tokens their caller appends (beam search)

    def lora_fits(self, req: Request) -> bool:
        """Whether ``req`` may join the running requests without making their distinct LoRA adapters
        more than ``max_loras`` (``req.lora_request`` / ``req.lora_int_id``; 0 is the base model).
        A policy calls it before it admits a request (or swaps one back in)."""
        lora = req.lora_int_id
        if not lora or self.max_loras is None:
            return True
        active = {r.lora_int_id for r in self.running} - {0}
        return lora in active or len(active) < self.max_loras

    # -- queue management (shared) ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.fork_of is None:  # a fork waits for its sample 0 to finish the prompt
            self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """End the given requests now and free their blocks; unknown ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        stop_reason: int | str | None = None) -> list[Request]:
        """End requests with ``status`` (abort, or a stop string found by the output processor)."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            self._leave_queues(req)
            req.drop_placeholders()  # the tokens of its step in flight will never be applied
            req.clear_drafts()
            req.status = status
            req.stop_reason = stop_reason
            self._finish(req)
            aborted.append(req)
        return aborted

    def fail_requests(self, request_ids: Iterable[str], failure: RequestFailure) -> list[Failed]:
        """End requests that failed on their own (see ``kvforge.errors``): status ``FINISHED_ERROR``,
        ``Request.error`` set, blocks freed. Unknown or finished ids are ignored."""
        failed = []
        for req in self.finish_requests(request_ids, RequestStatus.FINISHED_ERROR):
            req.error = failure
            failed.append(Failed(req, failure))
        return failed

    def stop(self, req: Request, stop_reason: str | None = None, *,
             num_output_tokens: int | None = None) -> Finished:
        """End ``req`` with status ``FINISHED_STOPPED`` at a stop the engine found: a stop string in its
        text (``stop_reason``: the string), or a structured-output grammar that terminated.
        ``num_output_tokens``: keep only that many output tokens (a stop string completed by an earlier
        token of the step). A request that already ended in this step for another reason is restated
        as stopped: the stop string wins."""
        if not req.finished:
            self.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED, stop_reason)
        else:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_reason
        if num_output_tokens is not None:
            del req.output_token_ids[num_output_tokens:]
        return Finished(req, req.status, req.stop_reason)

    def _finish(self, req: Request) -> None:
        self.kv_cache.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)
        self._driven.discard(req.request_id)

    def preempt(self, req: Request) -> None:
        """Free the request's blocks and put it back at the head of the queue (recompute later)."""
        self.kv_cache.free(req.request_id)
        req.num_computed_tokens = 0
        req.clear_drafts()
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def advance(self, output: SchedulerOutput) -> None:
        """The step was launched: count its tokens as computed, and give every request that samples
        in it a placeholder for the token, so the next step can be scheduled before the token is
        known (async scheduling; the engine calls this after it has applied the previous step).

        A request whose placeholder is its last token (``max_tokens``) has nothing left to compute:
        it is marked fully computed so that no later step schedules it before it finishes. Drafts
        count as computed too; :meth:`update` takes back the rejected ones. A driven request gets no
        placeholder: its caller appends its next token (:meth:`append_tokens`).
        """
        driven = self._driven
        for req in output.scheduled:
            if req.finished:
                continue
            req.num_computed_tokens += output.num_scheduled_tokens[req.request_id]
            if req.num_computed_tokens < req.num_tokens or req.request_id in driven:
                continue  # a prompt chunk that does not reach the end, or a driven request
            req.append_placeholder()
            if len(req.output_token_ids) >= req.max_tokens:
                req.num_computed_tokens = req.num_tokens

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> StepResult:
        """Apply a finished step's tokens (replacing the placeholders :meth:`advance` gave), each in
        turn up to the first stop condition; returns what it did: the new tokens of every request
        that took some, and the requests that finished. Rejected drafts are taken back from
        ``num_computed_tokens`` and the blocks that only they used are freed. Finished requests leave
        the queues and free their blocks here. A request preempted after its step was launched still
        takes its tokens; a driven request takes none (its caller appends them).
        """
        sampled = runner_output.sampled_token_ids
        result = StepResult()
        new_tokens, driven = result.new_tokens, self._driven
        for req in output.scheduled:
            if req.finished:  # aborted while the step ran
                continue
            rid = req.request_id
            tokens = sampled.get(rid)
            if tokens is None or rid in driven:
                continue
            drafts = output.draft_token_ids.get(rid)
            if drafts and req.status != RequestStatus.PREEMPTED:  # (preemption already reset it to 0)
                req.num_computed_tokens -= len(drafts) - (len(tokens) - 1)
            kept = self._take_tokens(req, tokens)
            new_tokens.append(NewTokens(req, tokens if kept == len(tokens) else tokens[:kept]))
            if req.forks:
                self._start_forks(req, sampled, result)
            if req.finished:
                self._leave_queues(req)
                self._finish(req)
                result.finished.append(Finished(req, req.status, req.stop_reason))
            elif drafts and req.status == RequestStatus.RUNNING:
                self.kv_cache.free_tail(rid, req.num_tokens)
        return result

    def _take_tokens(self, req: Request, tokens: list[int]) -> int:
        """Append one step's tokens in order, the first ones replacing placeholders, and stop at the
        first stop condition: the tokens after it are dropped. Returns how many were kept."""
        output = req.output_token_ids
        for i, token in enumerate(tokens):
            if req.num_placeholders:
                output[-req.num_placeholders] = token
                req.num_placeholders -= 1
            else:
                output.append(token)
            if self._check_stop(req):
                req.drop_placeholders()
                return i + 1
        return len(tokens)

    @staticmethod
    def _check_stop(req: Request) -> bool:
        """After a token was appended: set the finished status if a stop condition holds, in order: the
        model's EOS token unless ``ignore_eos`` (``stop_reason`` None), a token in ``stop_token_ids``
        (``stop_reason`` that token), ``max_tokens`` output tokens (``"length"``)."""
        last = req.output_token_ids[-1]
        params = req.sampling_params
        if not params.ignore_eos and last in params._eos_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif params.stop_token_ids and last in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, last
        elif len(req.output_token_ids) >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    def _leave_queues(self, req: Request) -> None:
        """Take a request that just finished out of whichever queue holds it."""
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass

    def _join_as_fork(self, parent: Request, child: Request) -> None:
        """``child`` shares the running ``parent``'s blocks (copy-on-write) and runs from where it is."""
        self.kv_cache.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def _start_forks(self, req: Request, sampled: dict[str, list[int]], result: StepResult) -> None:
        """Sample 0 finished the prompt: its forks share its blocks and start with their own token."""
        for child in req.forks:
            if child.finished:
                continue
            self._join_as_fork(req, child)
            tokens = sampled[child.request_id]
            child.output_token_ids.extend(tokens)
            result.new_tokens.append(NewTokens(child, tokens))
            if self._check_stop(child):
                self.running.remove(child)
                self._finish(child)
                result.finished.append(Finished(child, child.status, child.stop_reason))
        req.forks = []

    # -- driven requests: their caller chooses the tokens (beam search) --------------------------
    def add_driven(self, request: Request) -> None:
        """Queue a request whose tokens its caller chooses: each step it runs computes its newest
        token's K/V and log-probabilities (``ModelRunnerOutput.logprobs``), the sampled token is not
        applied, and nothing is scheduled for it until the caller appends the next token with
        :meth:`append_tokens`. The engine never overlaps its steps or gives it drafts (:attr:`driven_ids`)."""
        self.add(request)
        self._driven.add(request.request_id)

    @property
    def driven_ids(self) -> AbstractSet[str]:
        """The unfinished driven requests' ids: their tokens come from their caller, not the sampler
        (read only; empty without beam search)."""
        return self._driven

    def fork(self, parent: Request, child: Request) -> None:
        """Start ``child``, a new request whose tokens begin with all of the running ``parent``'s, as
        a copy of it: it takes the parent's blocks by reference (copy-on-write), its computed tokens,
        and a place in ``running``. The child of a driven parent is driven."""
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already in use")
        self._join_as_fork(parent, child)
        self.requests[child.request_id] = child
        if parent.request_id in self._driven:
            self._driven.add(child.request_id)

    def append_tokens(self, req: Request, tokens: list[int]) -> Finished | None:
        """A driven request's caller chose its next tokens: append them, up to the first stop condition
        (which ends the request and frees its blocks). Returns the end, if one was reached."""
        self._take_tokens(req, tokens)
        if not req.finished:
            return None
        self._leave_queues(req)
        self._finish(req)
        return Finished(req, req.status, req.stop_reason)

    # -- helpers for policies ----------------------------------------------------------------------
    @staticmethod
    def tokens_wanted(req: Request) -> int:
        """Tokens ``req`` would run in the next step: what it has left to compute, plus its drafts
        when that is just its last token (a decode step). None while the request is ``held``."""
        if req.held:
            return 0
        left = req.num_tokens - req.num_computed_tokens
        return left + len(req.draft_token_ids) if left == 1 else left

    @staticmethod
    def fit_chunk(req: Request, num_new: int, start: int | None = None) -> int:
        """``num_new`` tokens of ``req`` from position ``start`` (its next one by default), cut so that a
        prompt chunk never ends inside an item whose rows attend both ways (``kvforge.multimodal.spans``:
        Gemma 3's images); 0 when it must wait for a step with room for the whole item. Every policy
        applies it to the chunks it schedules."""
        if not req.mm_features or num_new <= 0:
            return num_new
        return chunk_limit(req.mm_features, req.num_computed_tokens if start is None else start, num_new)

    @staticmethod
    def record_drafts(out: SchedulerOutput, req: Request, num_new: int) -> None:
        """``req`` was scheduled for ``num_new`` tokens: note the drafts among them (the budget may
        have cut some; those are dropped)."""
        extra = num_new - (req.num_tokens - req.num_computed_tokens)
        if extra > 0:
            out.draft_token_ids[req.request_id] = req.draft_token_ids[:extra]

    def take_finished_ids(self) -> set[str]:
        ids, self._finished_ids = self._finished_ids, set()
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        waiting = list(self.waiting)  # one copy: get_stats may run on another thread than the engine
        by_priority = Counter(r.priority for r in waiting)
        return SchedulerStats(len(self.running), len(waiting), self.num_preemptions,
                              waiting_by_priority=dict(sorted(by_priority.items())))

    # -- policy ----------------------------------------------------------------------------------
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose the next step's requests and token counts, allocating their KV slots."""
