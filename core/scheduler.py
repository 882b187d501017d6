"""The scheduler contract: which requests run in the next step, and how many tokens each.

One token budget per step (``max_num_batched_tokens``) covers prompt chunks, decode tokens and
draft tokens alike; there are no separate prefill and decode phases. A step's result for a request
is a list of tokens (more than one when it verified drafts: docs/speculative.md). The base class keeps the queues and does
the bookkeeping shared by every policy (``add``, ``abort``, ``update``); a policy implements
``schedule``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvforge.errors import RequestFailure
from kvforge.kv_cache import KVCacheManager
from kvforge.request import Request, RequestStatus


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
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()

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

    def fail_requests(self, request_ids: Iterable[str], failure: RequestFailure) -> list[Request]:
        """End requests that failed on their own (see ``kvforge.errors``): status ``FINISHED_ERROR``,
        ``Request.error`` set, blocks freed. Unknown or finished ids are ignored."""
        failed = self.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        for req in failed:
            req.error = failure
        return failed

    def _finish(self, req: Request) -> None:
        self.kv_cache.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)

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
        count as computed too; :meth:`update` takes back the rejected ones.
        """
        for req in output.scheduled:
            if req.finished:
                continue
            req.num_computed_tokens += output.num_scheduled_tokens[req.request_id]
            if req.num_computed_tokens < req.num_tokens or req.external_tokens:
                continue  # a prompt chunk that does not reach the end, or beam search's own tokens
            req.append_placeholder()
            if len(req.output_token_ids) >= req.max_tokens:
                req.num_computed_tokens = req.num_tokens

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply a finished step's tokens (replacing the placeholders :meth:`advance` gave), each in
        turn up to the first stop condition; returns the requests that got tokens. Rejected drafts
        are taken back from ``num_computed_tokens`` and the blocks that only they used are freed.
        Finished requests leave the queues and free their blocks here. A request preempted after its
        step was launched still takes its tokens.
        """
        sampled = runner_output.sampled_token_ids
        updated = []
        for req in output.scheduled:
            if req.finished:  # aborted while the step ran
                continue
            tokens = sampled.get(req.request_id)
            if tokens is None or req.external_tokens:
                continue
            drafts = output.draft_token_ids.get(req.request_id)
            if drafts and req.status != RequestStatus.PREEMPTED:  # (preemption already reset it to 0)
                req.num_computed_tokens -= len(drafts) - (len(tokens) - 1)
            req.apply_tokens(tokens)
            updated.append(req)
            if req.forks:
                updated.extend(self._fork(req, sampled))
            if req.finished:
                self._leave_queues(req)
                self._finish(req)
            elif drafts and req.status == RequestStatus.RUNNING:
                self.kv_cache.free_tail(req.request_id, req.num_tokens)
        return updated

    def _leave_queues(self, req: Request) -> None:
        """Take a request that just finished out of whichever queue holds it."""
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass

    def _fork(self, req: Request, sampled: dict[str, int]) -> list[Request]:
        """Sample 0 finished the prompt: its forks share its blocks and start with their own token."""
        started = []
        for child in req.forks:
            if child.finished:
                continue
            self.kv_cache.fork(req.request_id, child.request_id)
            child.num_computed_tokens = req.num_computed_tokens
            child.num_cached_tokens = req.num_cached_tokens
            child.status = RequestStatus.RUNNING
            child.output_token_ids.extend(sampled[child.request_id])
            self.running.append(child)
            started.append(child)
            if child.check_stop():
                self.running.remove(child)
                self._finish(child)
        req.forks = []
        return started

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
