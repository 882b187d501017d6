"""``priority``: fcfs batching, with requests ordered by ``(priority, arrival_time)`` (lower first).

Each step is the fcfs step (``fcfs.py``) with these orders and two passes in front of it (the full
policy, with the reasons, is in docs/scheduling.md):

1. The waiting queue, the swapped queue and the running list are sorted by the key
   ``(effective priority, arrival_time)``; running requests take the budget in that order, waiting
   ones are admitted in that order, and fcfs preempts the running request with the largest key.
2. **Priority preemption** (vLLM's): while the best waiting or swapped request would not fit after
   the running requests' next chunks (blocks, token budget, ``max_num_seqs``; prefix-cache hits
   not counted), the running request with the largest key is preempted, if its effective priority
   is strictly lower (a larger number) than that request's.
3. Swapped requests come back (``swap_in``), best first, while they come before the best waiting
   request and fit. No waiting request is admitted while a swapped one that comes first waits.

``preemption_mode``: ``recompute`` frees the blocks (fcfs's way); ``swap`` moves them to the CPU
pool (status SWAPPED, ``num_computed_tokens`` kept), or recomputes when the pool lacks room.
NOTE: no request is swapped both ways in one step (``kvforge.rank.swap`` could not order the copies):
one swapped in and then preempted in the same step is recomputed, its swap-in cancelled, and one
swapped out waits for the next step to come back.

``aging_interval_s`` (off by default): effective priority = ``priority - floor(age /
aging_interval_s)``, the age counted from ``arrival_time`` (``time.monotonic``) also while running,
so a low-priority request overtakes, and is not preempted by, requests that arrive long after it.
"""
from __future__ import annotations

import dataclasses
import time
from bisect import insort
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from kvforge.plugins.scheduling.fcfs import FCFSOptions, FCFSScheduler
from kvforge.request import Request, RequestStatus
from kvforge.scheduler import SchedulerOutput, SchedulerStats


@dataclass
class PriorityOptions(FCFSOptions):
    #: how a preempted request gives up its blocks: "recompute" (free them) or "swap" (to the CPU pool)
    preemption_mode: str = "recompute"
    #: seconds of age that lower a request's effective priority number by 1 (None: no aging)
    aging_interval_s: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        v = self.aging_interval_s
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf")):
            raise ValueError(f"aging_interval_s must be a number of seconds > 0 or None, got {v!r}")


class _SortedQueue:
    """Requests kept in key order, with the deque methods the base scheduler and fcfs call."""

    def __init__(self, key: Callable[[Request], tuple]):
        self.key = key
        self.items: list[Request] = []

    def append(self, req: Request) -> None:
        insort(self.items, req, key=self.key)

    appendleft = append  # the base scheduler re-queues a preempted request "at the head": its place

    def extendleft(self, reqs: Iterable[Request]) -> None:
        for r in reqs:
            self.append(r)

    def popleft(self) -> Request:
        return self.items.pop(0)

    def remove(self, req: Request) -> None:
        self.items.remove(req)

    def resort(self) -> None:
        self.items = sorted(self.items, key=self.key)  # NOTE: a new list: stats() may read on another thread

    def __getitem__(self, i: int) -> Request:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self.items))


class PriorityScheduler(FCFSScheduler):
    name = "priority"
    Options = PriorityOptions
    #: the clock of ``Request.arrival_time`` (tests replace it)
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, *, preemption_mode: str = "recompute", aging_interval_s: float | None = None, **kwargs):
        super().__init__(**kwargs)
        self.preemption_mode = preemption_mode
        self.aging_interval_s = aging_interval_s
        self.now = self.clock()  # one time per step, so that keys do not move within it
        # the base class's waiting queue, kept in key order; ``sorted_waiting`` is the same object, typed
        self.waiting = self.sorted_waiting = _SortedQueue(self.key)
        self.swapped = _SortedQueue(self.key)
        self.num_preemptions_swap = 0
        self._swapped_blocks: dict[str, int] = {}  # swapped request -> its blocks in the CPU pool
        self._swap_out: dict[str, list[tuple[int, int]]] = {}  # this step's (device, cpu) copies
        self._swap_in: dict[str, list[tuple[int, int]]] = {}  # this step's (cpu, device) copies

    # -- order -----------------------------------------------------------------------------------
    def effective_priority(self, req: Request) -> int:
        if self.aging_interval_s is None:
            return req.priority
        return req.priority - int(max(0.0, self.now - req.arrival_time) // self.aging_interval_s)

    def key(self, req: Request) -> tuple[int, float]:
        return self.effective_priority(req), req.arrival_time

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.now = self.clock()
        self.sorted_waiting.resort()
        self.swapped.resort()
        self.running.sort(key=self.key)
        forced = self._preempt_for_head()
        self._resume_swapped()
        self.running.sort(key=self.key)
        out = super().schedule()
        out.preempted[:0] = forced
        out.blocks_to_swap_out = [p for pairs in self._swap_out.values() for p in pairs]
        out.blocks_to_swap_in = [p for pairs in self._swap_in.values() for p in pairs]
        self._swap_out, self._swap_in = {}, {}
        return out

    @staticmethod
    def _head(queue: _SortedQueue) -> Request | None:
        """The best request of ``queue`` that can be scheduled now (its grammar compiled)."""
        return next((r for r in queue.items if r.grammar is None or r.grammar.usable), None)

    def _blocks_for(self, req: Request, num_new: int) -> int:
        """Blocks the request holds once ``num_new`` more tokens have slots."""
        tokens = req.num_computed_tokens + num_new
        return max(self._swapped_blocks.get(req.request_id, 0), -(-tokens // self.kv_cache.block_size))

    def _fits(self, req: Request) -> bool:
        """Whether the queued ``req`` could run in this step after the running requests' next chunks
        (the fcfs running pass, without preemptions): an estimate that ignores prefix-cache hits."""
        if len(self.running) + 1 + len(req.forks) > self.max_num_seqs or not self.lora_fits(req):
            return False
        budget, blocks = self.max_num_batched_tokens, 0
        for r in self.running:
            n = self._chunk(r, budget)
            blocks += max(0, self._blocks_for(r, n) - len(self.kv_cache.block_table(r.request_id)))
            budget -= max(n, 0)
        if budget <= 0:
            return False
        return self._blocks_for(req, self._chunk(req, budget)) + blocks <= self.kv_cache.num_free_blocks

    def _preempt_for_head(self) -> list[Request]:
        """Preempt lower-priority running requests, lowest first, until the best queued one fits."""
        heads = [h for h in (self._head(self.sorted_waiting), self._head(self.swapped)) if h is not None]
        if not heads:
            return []
        head = min(heads, key=self.key)
        forced = []
        while (self.running and self.effective_priority(self.running[-1]) > self.effective_priority(head)
               and not self._fits(head)):
            victim = self.running.pop()
            self.preempt(victim)
            forced.append(victim)
        return forced

    def _resume_swapped(self) -> None:
        """Swap requests back in, best first, while they come before the best waiting request."""
        waiting_head = self._head(self.sorted_waiting)
        while self.swapped:
            req = self.swapped[0]
            if waiting_head is not None and self.key(waiting_head) < self.key(req):
                break
            # NOTE: a request swapped out in this step stays out: its blocks reach the pool only
            # when the runner copies them (kvforge.rank.swap)
            if req.request_id in self._swap_out or not self._fits(req):
                break
            pairs = self.kv_cache.swap_in(req.request_id)
            if pairs is None:
                break
            self.swapped.popleft()
            del self._swapped_blocks[req.request_id]
            self._swap_in[req.request_id] = pairs
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def may_admit(self, out: SchedulerOutput) -> bool:
        """fcfs's rule, and none while a swapped request that comes first waits for room."""
        swapped, waiting = self._head(self.swapped), self._head(self.sorted_waiting)
        return super().may_admit(out) and (swapped is None or waiting is None
                                           or self.key(waiting) < self.key(swapped))

    # -- preemption and the swapped queue --------------------------------------------------------
    def preempt(self, req: Request) -> None:
        """Swap the request's blocks out to the CPU pool (``swap`` mode, pool permitting), or free
        them to be recomputed (the base class)."""
        resumed_now = self._swap_in.pop(req.request_id, None) is not None
        pairs = None
        if self.preemption_mode == "swap" and not resumed_now:
            pairs = self.kv_cache.swap_out(req.request_id)
        if pairs is None:
            super().preempt(req)
            return
        self._swap_out[req.request_id] = pairs
        self._swapped_blocks[req.request_id] = len(pairs)
        req.clear_drafts()
        req.status = RequestStatus.SWAPPED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_swap += 1
        self.swapped.append(req)

    def _leave_queues(self, req: Request) -> None:
        if req.request_id in self._swapped_blocks:  # the base class frees its CPU blocks with its device ones
            self.swapped.remove(req)
            del self._swapped_blocks[req.request_id]
            self._swap_out.pop(req.request_id, None)  # preempted outside a step: its copies are moot
            return
        super()._leave_queues(req)

    def has_unfinished(self) -> bool:
        return bool(self.swapped) or super().has_unfinished()

    def stats(self) -> SchedulerStats:
        return dataclasses.replace(super().stats(), num_preemptions_swap=self.num_preemptions_swap,
                                   num_swapped=len(self.swapped))
