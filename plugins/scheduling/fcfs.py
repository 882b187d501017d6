"""``fcfs``: first come, first served continuous batching with chunked prefill.

Each step: running requests first, in arrival order (each takes what it still needs: one decode
token and its drafts, or the next prompt chunk), then waiting requests while the token budget, ``max_num_seqs``
and free blocks allow. When a running request cannot get a block, the newest running request is
preempted by recompute (its blocks freed, its tokens recomputed later, prefix cache permitting);
no new request is admitted in a step that preempted.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.request import Request, RequestStatus
from kvforge.scheduler import Scheduler, SchedulerOutput


@dataclass
class FCFSOptions:
    #: most prompt tokens one request may take from a step's budget (0: no cap beyond the budget)
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        v = self.long_prefill_token_threshold
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, "
                             f"got {self.long_prefill_token_threshold!r}")


class FCFSScheduler(Scheduler):
    name = "fcfs"
    Options = FCFSOptions

    def __init__(self, *, long_prefill_token_threshold: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.long_prefill_token_threshold = long_prefill_token_threshold

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(self.tokens_wanted(req), budget)
        if self.long_prefill_token_threshold and req.num_tokens - req.num_computed_tokens > 1:
            n = min(n, self.long_prefill_token_threshold)
        return self.fit_chunk(req, n)

    def pick_victim(self) -> Request:
        """The running request to preempt when blocks run out: the newest."""
        return self.running[-1]

    def may_admit(self, out: SchedulerOutput) -> bool:
        """Whether waiting requests may be admitted after the running ones: not in a step that preempted."""
        return not out.preempted

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self.take_finished_ids())
        budget = self.max_num_batched_tokens
        kv = self.kv_cache

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, budget)
            if num_new <= 0:
                i += 1
                continue
            while not kv.allocate_slots(req, num_new):
                left = req.num_tokens - req.num_computed_tokens
                if num_new > left:  # drafts never cost a preemption: drop them first
                    num_new = left
                    continue
                victim = self.pick_victim()
                self.running.remove(victim)
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(req)
                out.num_scheduled_tokens[req.request_id] = num_new
                self.record_drafts(out, req, num_new)
                budget -= num_new
                i += 1
                continue
            # req itself was preempted: the requests after it are gone too (they were newer)
            break

        if self.may_admit(out):
            not_ready = []  # requests that cannot start yet (grammar compiling, LoRA slots taken)
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if (req.grammar is not None and not req.grammar.usable) or not self.lora_fits(req):
                    not_ready.append(self.waiting.popleft())  # its grammar compiles, or its adapter waits for a slot
                    continue
                if len(self.running) + 1 + len(req.forks) > self.max_num_seqs:
                    break  # its n samples will all run once the prompt is done
                computed, num_cached = [], 0
                # NOTE: prompt logprobs need every prompt position computed, so no prefix-cache hit
                if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
                    computed, num_cached = kv.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_cached - req.num_computed_tokens, budget)
                if self.long_prefill_token_threshold:
                    num_new = min(num_new, self.long_prefill_token_threshold)
                num_new = self.fit_chunk(req, num_new, req.num_computed_tokens + num_cached)
                if num_new <= 0 or not kv.allocate_slots(req, num_new, computed):
                    break
                self.waiting.popleft()
                if req.status == RequestStatus.WAITING:
                    req.num_cached_tokens = num_cached
                req.num_computed_tokens += num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(req)
                out.num_scheduled_tokens[req.request_id] = num_new
                budget -= num_new
            self.waiting.extendleft(reversed(not_ready))

        out.blocks_to_copy = kv.take_copies()
        return out
