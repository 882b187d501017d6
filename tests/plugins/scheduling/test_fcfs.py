"""fcfs scheduler invariants, driven without a model (a fake runner samples token 7)."""
import random

import pytest

from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.plugins.scheduling.fcfs import FCFSScheduler
from kvforge.request import PLACEHOLDER, Request, RequestStatus
from kvforge.sampling_params import SamplingParams
from kvforge.scheduler import ModelRunnerOutput


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, **opts):
    kv = PagedKVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return FCFSScheduler(kv_cache=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=num_blocks * block_size, **opts)


def req(rid, n, max_tokens=4):
    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))
    r.max_tokens = max_tokens
    return r


def fake_step(s):
    out = s.schedule()
    sampled = {r.request_id: [7] for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens}
    s.advance(out)
    s.update(out, ModelRunnerOutput(sampled))
    return out


def check_invariants(s, out):
    assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    for r in out.scheduled:
        if r.finished:
            continue
        table = s.kv_cache.block_table(r.request_id)
        # every scheduled token has a slot
        assert len(table) * s.kv_cache.block_size >= r.num_computed_tokens


def test_chunked_prefill_respects_budget():
    s = make(budget=8)
    s.add(req("a", 20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 8}


def test_decodes_and_new_prefill_share_one_budget():
    s = make(budget=10)
    s.add(req("a", 5))
    fake_step(s)  # a prefilled, sampled 1 token
    s.add(req("b", 30))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_async_schedule_before_the_token_is_known():
    """The next step is scheduled while the current one's token is a placeholder; the step that
    samples the last token (max_tokens) is not followed by another."""
    s = make(budget=64)
    s.add(req("a", 5, max_tokens=3))
    a = s.requests["a"]
    out1 = s.schedule()
    s.advance(out1)  # the prefill is in flight
    assert a.output_token_ids == [PLACEHOLDER] and a.num_computed_tokens == 5
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"a": 1}  # the placeholder's decode
    assert [new.request for new in s.update(out1, ModelRunnerOutput({"a": [7]})).new_tokens] == [a]
    s.advance(out2)
    assert a.output_token_ids == [7, PLACEHOLDER]
    out3 = s.schedule()
    s.update(out2, ModelRunnerOutput({"a": [8]}))
    s.advance(out3)  # its token will be the third and last
    assert s.schedule().is_empty
    s.update(out3, ModelRunnerOutput({"a": [9]}))
    assert a.output_token_ids == [7, 8, 9] and a.finished and s.kv_cache.stats().num_used_blocks == 0


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(str(i), 3))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["0", "1"]


def test_long_prefill_threshold():
    s = make(budget=32, long_prefill_token_threshold=5)
    s.add(req("a", 20))
    assert s.schedule().num_scheduled_tokens == {"a": 5}
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        FCFSScheduler.Options(long_prefill_token_threshold=-1)


def test_preemption_by_recompute_frees_newest_and_finishes_all():
    s = make(num_blocks=6, block_size=4, budget=64, max_num_seqs=8)
    for i in range(3):
        s.add(req(str(i), 6, max_tokens=6))  # each needs up to 3 blocks; only 6 blocks in all
    preempted = 0
    for _ in range(200):
        if not s.has_unfinished():
            break
        running = list(s.running)  # in admission order: the newest last
        out = fake_step(s)
        check_invariants(s, out)
        preempted += len(out.preempted)
        # the victims are the newest running requests, newest first
        assert out.preempted == running[::-1][:len(out.preempted)]
        assert all(p.num_computed_tokens == 0 for p in out.preempted)
    assert not s.has_unfinished()
    assert preempted > 0 and s.num_preemptions == preempted
    assert s.kv_cache.stats().num_used_blocks == 0


def test_abort_frees_blocks():
    s = make()
    s.add(req("a", 10))
    s.add(req("b", 10))
    fake_step(s)
    aborted = s.abort(["a", "b", "unknown"])
    assert {r.request_id for r in aborted} == {"a", "b"}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert s.kv_cache.stats().num_used_blocks == 0 and not s.has_unfinished()
    assert s.schedule().finished_request_ids == {"a", "b"}


def test_random_workload_invariants():
    rng = random.Random(0)
    s = make(num_blocks=20, block_size=4, budget=16, max_num_seqs=4)
    n = 0
    for _ in range(400):
        if rng.random() < 0.3 and n < 30:
            s.add(req(f"r{n}", rng.randint(1, 30), max_tokens=rng.randint(1, 8)))
            n += 1
        if rng.random() < 0.05 and s.running:
            s.abort([rng.choice(s.running).request_id])
        out = fake_step(s)
        check_invariants(s, out)
    while s.has_unfinished():
        check_invariants(s, fake_step(s))
    assert s.kv_cache.stats().num_used_blocks == 0
