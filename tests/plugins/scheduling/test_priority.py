"""priority scheduler: order, preemption (recompute and swap), aging and invariants, without a model.

A fake runner keeps one token id per cache slot (device and CPU pool) and replays each step as the
model runner does (swap-in sources staged, swap-outs, swap-ins, copy-on-write, the forward's writes),
then checks that every scheduled request reads its own tokens at every position before its end.
"""
import random

import numpy as np
import pytest

from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.plugins.scheduling.priority import PriorityScheduler
from kvforge.request import Request, RequestStatus
from kvforge.sampling_params import SamplingParams
from kvforge.scheduler import ModelRunnerOutput


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, num_cpu_blocks=0, **opts):
    kv = PagedKVCacheManager(num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=num_cpu_blocks)
    s = PriorityScheduler(kv_cache=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=num_blocks * block_size, **opts)
    s.cache = FakeCache(kv)
    return s


def req(rid, n, max_tokens=4, priority=0, arrival=None, first=1):
    r = Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), priority=priority)
    r.max_tokens = max_tokens
    if arrival is not None:
        r.arrival_time = arrival
    return r


class FakeCache:
    """Token ids in place of K/V: [num_blocks, block_size] on the device, the same in the CPU pool."""

    def __init__(self, kv):
        self.kv = kv
        self.dev = np.full((kv.num_blocks, kv.block_size), -1)
        self.cpu = np.full((max(kv.num_cpu_blocks, 1), kv.block_size), -1)

    def run(self, out):
        staged = [self.cpu[c].copy() for c, _ in out.blocks_to_swap_in]  # as kvforge.rank.swap: sources first
        for d, c in out.blocks_to_swap_out:
            self.cpu[c] = self.dev[d]
        for (_, d), data in zip(out.blocks_to_swap_in, staged):
            self.dev[d] = data
        for src, dst in out.blocks_to_copy:
            self.dev[dst] = self.dev[src]
        bs = self.kv.block_size
        spans = [(r, self.kv.block_table(r.request_id), r.num_computed_tokens,
                  r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]) for r in out.scheduled]
        for r, table, start, end in spans:  # the forward writes the step's K/V before reading any
            assert len(table) * bs >= end, "a scheduled token has no slot"
            for pos in range(start, end):
                self.dev[table[pos // bs], pos % bs] = r.token_at(pos)
        for r, table, _, end in spans:
            got = [self.dev[table[pos // bs], pos % bs] for pos in range(end)]
            assert got == r.tokens(0, end), f"{r.request_id} reads another request's K/V"


def step(s):
    out = s.schedule()
    assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    # a request preempted to make room for a better one may be re-admitted at once, never swapped in
    assert not {r.request_id for r in out.scheduled} & {r.request_id for r in s.swapped}
    s.cache.run(out)
    sampled = {r.request_id: [7] for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens}
    s.advance(out)
    s.update(out, ModelRunnerOutput(sampled))
    return out


def run_all(s, limit=1000):
    finished = []
    for _ in range(limit):
        if not s.has_unfinished():
            return finished
        out = step(s)
        finished += [r.request_id for r in out.scheduled if r.finished]
    raise AssertionError("requests did not finish")


def assert_all_free(s):
    st = s.kv_cache.stats()
    assert st.num_used_blocks == 0 and st.num_free_cpu_blocks == st.num_cpu_blocks, st
    assert not s.has_unfinished() and not s.swapped


def test_registered():
    from kvforge.plugin_manager import get_plugin_manager
    assert get_plugin_manager().get("scheduler", "priority") is PriorityScheduler


def test_options():
    assert PriorityScheduler.Options().preemption_mode == "recompute"
    for bad in (dict(preemption_mode="drop"), dict(aging_interval_s=0), dict(aging_interval_s=True),
                dict(long_prefill_token_threshold=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PriorityScheduler.Options(**bad)


def test_waiting_order_is_priority_then_arrival():
    s = make(max_num_seqs=1)
    for rid, prio, t in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 0.5)]:
        s.add(req(rid, 3, max_tokens=1, priority=prio, arrival=t))
    assert s.stats().waiting_by_priority == {0: 2, 1: 1, 2: 1}
    assert run_all(s) == ["d", "b", "c", "a"]
    assert_all_free(s)


def test_blocks_run_out_preempts_lowest_priority_not_newest():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(req("low", 4, max_tokens=8, priority=5, arrival=0.0))
    s.add(req("high", 4, max_tokens=8, priority=0, arrival=1.0))
    s.add(req("mid", 4, max_tokens=8, priority=1, arrival=2.0))
    preempted = []
    while s.has_unfinished():
        preempted += [r.request_id for r in step(s).preempted]
    assert preempted and preempted[0] == "low"
    assert_all_free(s)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_higher_priority_arrival_preempts_lower_running(mode):
    s = make(num_blocks=64, max_num_seqs=2, num_cpu_blocks=32, preemption_mode=mode)
    s.add(req("l1", 6, max_tokens=20, priority=1, arrival=0.0))
    s.add(req("l2", 6, max_tokens=20, priority=1, arrival=1.0))
    step(s)
    s.add(req("same", 6, max_tokens=20, priority=1, arrival=2.0))
    assert not step(s).preempted  # equal priority never preempts
    s.add(req("h", 6, max_tokens=3, priority=0, arrival=3.0))
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["l2"]
    assert "h" in [r.request_id for r in out.scheduled]
    assert s.requests["l2"].status == (RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED)
    if mode == "swap":
        assert out.blocks_to_swap_out and s.requests["l2"].num_computed_tokens == 7
        assert s.stats().num_swapped == 1 and s.stats().num_preemptions_swap == 1
    finished = run_all(s)
    assert finished[0] == "h"
    assert_all_free(s)


def test_swap_round_trip_keeps_progress_and_frees_cpu_blocks():
    s = make(num_blocks=6, block_size=4, budget=64, num_cpu_blocks=16, preemption_mode="swap")
    for i in range(3):
        s.add(req(str(i), 6, max_tokens=6, first=10 * i))
    swapped_in = swapped_out = 0
    while s.has_unfinished():
        out = step(s)
        swapped_out += len(out.blocks_to_swap_out)
        swapped_in += len(out.blocks_to_swap_in)
        for r in out.preempted:
            assert r.status == RequestStatus.SWAPPED and r.num_computed_tokens > 0
    assert swapped_out > 0 and swapped_in == swapped_out == s.kv_cache.stats().num_swapped_out_blocks
    assert s.num_preemptions == s.num_preemptions_swap > 0
    assert_all_free(s)


def test_a_request_swapped_out_is_not_swapped_in_in_the_same_step(monkeypatch):
    s = make(max_num_seqs=2, num_cpu_blocks=16, preemption_mode="swap")
    s.add(req("h", 6, max_tokens=20, priority=0))
    s.add(req("l", 6, max_tokens=20, priority=1, first=50))
    step(s)
    h = s.requests["h"]
    s.running.remove(h)
    s.preempt(h)  # as if an earlier step had swapped "h" out
    out = step(s)
    assert h.status == RequestStatus.SWAPPED and out.blocks_to_swap_out and not out.blocks_to_swap_in
    answers = iter([False])  # the room estimate says no once: "l" is swapped out for "h" ...
    monkeypatch.setattr(PriorityScheduler, "_fits", lambda self, r: next(answers, True))
    out = step(s)  # ... and then yes, for "h" and for "l", whose blocks are not in the pool yet
    assert [r.request_id for r in out.preempted] == ["l"] and h.status == RequestStatus.RUNNING
    assert s.requests["l"].status == RequestStatus.SWAPPED
    monkeypatch.undo()
    run_all(s)
    assert_all_free(s)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    s = make(num_blocks=6, block_size=4, budget=64, num_cpu_blocks=1, preemption_mode="swap")
    for i in range(3):
        s.add(req(str(i), 6, max_tokens=6, first=10 * i))
    run_all(s)
    assert s.num_preemptions > s.num_preemptions_swap
    assert_all_free(s)


def test_abort_of_swapped_request_frees_its_cpu_blocks():
    s = make(num_blocks=64, max_num_seqs=1, num_cpu_blocks=8, preemption_mode="swap")
    s.add(req("low", 9, max_tokens=20, priority=1))
    step(s)
    s.add(req("high", 5, max_tokens=20, priority=0))
    step(s)
    assert s.requests["low"].status == RequestStatus.SWAPPED
    assert s.kv_cache.stats().num_free_cpu_blocks == 8 - 3
    assert [r.request_id for r in s.abort(["low"])] == ["low"]
    assert s.kv_cache.stats().num_free_cpu_blocks == 8 and not s.swapped
    s.abort(["high"])
    assert_all_free(s)


def test_aging_lets_a_starved_request_run():
    def starve(aging):
        t = [0.0]
        s = make(max_num_seqs=1, budget=64, aging_interval_s=aging)
        s.clock = lambda: t[0]
        s.add(req("low", 3, max_tokens=1, priority=5, arrival=0.0))
        for i in range(40):  # a new priority-0 request every step keeps the only slot busy
            s.add(req(f"h{i}", 3, max_tokens=2, priority=0, arrival=t[0]))
            out = step(s)
            if s.requests.get("low") is None:
                return i
            assert all(r.request_id != "low" for r in out.preempted)
            t[0] += 1.0
        return None

    assert starve(None) is None
    # "low" ties with requests that arrive 5 s after it: only h0..h4 (2 steps each) go first
    assert starve(1.0) == 10


@pytest.mark.parametrize("mode,aging,optimistic", [
    ("recompute", None, False), ("swap", None, False), ("swap", 0.5, False), ("swap", 0.5, True)])
def test_random_workload_invariants(mode, aging, optimistic, monkeypatch):
    """Budget, max_num_seqs, a slot for every scheduled token and the K/V each request reads (the
    fake cache), blocks back to zero. ``optimistic`` makes the room estimate always say yes, so that
    requests are swapped in and preempted again in one step (their swap-in cancelled) and CPU blocks
    released by a swap-in take a swap-out of the same step."""
    if optimistic:
        monkeypatch.setattr(PriorityScheduler, "_fits",
                            lambda self, r: len(self.running) + 1 + len(r.forks) <= self.max_num_seqs)
    rng = random.Random(0)
    t = [0.0]
    s = make(num_blocks=12, block_size=4, budget=16, max_num_seqs=4, num_cpu_blocks=12,
             preemption_mode=mode, aging_interval_s=aging)
    s.clock = lambda: t[0]
    n = both = 0
    for _ in range(400):
        if rng.random() < 0.5 and n < 60:
            first = rng.choice([1, 100 * n])  # some share a prompt prefix (prefix-cache hits)
            s.add(req(f"r{n}", rng.randint(1, 30), max_tokens=rng.randint(1, 16),
                      priority=rng.randint(0, 3), arrival=t[0], first=first))
            n += 1
        if rng.random() < 0.05 and s.requests:
            s.abort([rng.choice(sorted(s.requests))])
        out = step(s)
        both += bool(out.blocks_to_swap_in and out.blocks_to_swap_out)
        t[0] += 0.1
    run_all(s)
    assert s.num_preemptions > 0
    if mode == "swap":
        assert s.num_preemptions_swap > 0
    if optimistic:
        assert both > 0  # swaps both ways in one step happened
    assert_all_free(s)


def test_long_prefill_threshold_caps_chunks():
    s = make(budget=32, long_prefill_token_threshold=5)
    s.add(req("a", 20))
    assert s.schedule().num_scheduled_tokens == {"a": 5}
