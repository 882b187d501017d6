"""The engine with tensor_parallel_size=2 (the ``mp`` executor: a spawned rank over gloo) against one
rank, on the real default model: the same tokens for every request, with prefix caching, chunked
prompts, preemption, async scheduling (placeholder tokens broadcast by the driver), penalties,
structured outputs and n > 1 (copy-on-write blocks); then every rank forgets every request."""
from __future__ import annotations

import os
import signal
import time

import pytest

from kvforge import LLM, SamplingParams
from kvforge.rank.executor import WorkerFailure
from kvforge.rank.messages import BatchState
from kvforge.sampling_params import StructuredOutputsParams

PREFIX = "You are a terse assistant. Answer in one short sentence, then stop. Question: "
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?",
             "Who wrote Hamlet?", "What is 2 + 2?", "Name a planet.", "What do bees make?",
             "How many legs has a spider?", "What is water made of?"]
ENGINE = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=20, max_num_batched_tokens=48,
              enable_prefix_caching=True, async_scheduling=True, swap_space=0)


def _requests():
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [PREFIX + q for q in QUESTIONS]
    params = [greedy] * len(prompts)
    prompts.append(PREFIX + "List three fruits.")
    params.append(SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5))
    prompts.append(PREFIX + "Is the sun a star? Answer yes or no.")
    params.append(SamplingParams(temperature=0, max_tokens=4,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    prompts.append(PREFIX + "Say something.")
    params.append(SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=12, ignore_eos=True))
    return prompts, params


def _run(llm):
    prompts, params = _requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], llm.llm_engine.get_stats()


@pytest.fixture(scope="module")
def tp2():
    llm = LLM(tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def one_rank():
    """``_run`` on a fresh one-rank engine built with ENGINE (its tokens and its stats): the reference of
    the tp2 and pp2 tests, run once for both."""
    return _run(LLM(**ENGINE))


def test_tp2_equals_tp1_token_for_token_on_the_default_model(tp2, one_rank):
    ref, ref_stats = one_rank
    got, stats = _run(tp2)
    assert tp2.llm_engine.executor.name == "mp" and tp2.llm_engine.executor.world_size == 2
    assert got == ref
    for s in (stats, ref_stats):  # the paths this was meant to cover were taken
        assert s["num_preemptions"] > 0 and s["prefix_cache_hits"] > 0
    # every rank forgets every request; every block is free again
    assert tp2.llm_engine.executor.collective_rpc("batch_state") == [{"requests": 0, "blocks": 0}] * 2
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_pp2_equals_one_rank_token_for_token_on_the_default_model(one_rank):
    """Two pipeline stages (layers 0-14 and 15-29), hidden states sent stage to stage over gloo, two
    steps in flight over disjoint requests."""
    ref, _ = one_rank
    llm = LLM(pipeline_parallel_size=2, **ENGINE)
    try:
        got, stats = _run(llm)
        assert [r["layers"] for r in llm.llm_engine.executor.collective_rpc("ready")] == [[0, 15], [15, 30]]
        assert got == ref and stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
        # two steps in flight at once, over disjoint requests (one per stage)
        assert llm.llm_engine.max_in_flight == 2 and llm.llm_engine.num_overlapped_steps > 0
        assert llm.llm_engine.executor.collective_rpc("batch_state") == [{"requests": 0, "blocks": 0}] * 2
    finally:
        llm.shutdown()


def test_tp2_x_pp2_equals_one_rank_on_a_tiny_model(monkeypatch):
    """Four ranks: two stages of two tensor-parallel ranks each (the tiny model's 2 layers, one per stage).
    The step ring's chunks are made too small for most messages, which then go over the connections."""
    from kvforge.plugins.executors.multiproc import MultiprocExecutor

    monkeypatch.setattr(MultiprocExecutor, "ring_chunk_bytes", 128)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 5, 9, 200 + i, 7] * (i + 1) for i in range(8)]
    common = dict(device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=32)
    ref = [o.outputs[0].token_ids for o in LLM("dummy:tiny", **common).generate(prompts, params, use_tqdm=False)]
    llm = LLM("dummy:tiny", tensor_parallel_size=2, pipeline_parallel_size=2, **common)
    try:
        shards = llm.llm_engine.executor.collective_rpc("ready")
        assert [(s["stage"], s["num_heads"]) for s in shards] == [(0, 2), (0, 2), (1, 2), (1, 2)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    finally:
        llm.shutdown()


def test_ranks_hold_their_own_heads_and_agree_on_blocks(tp2):
    # the default model's 9 query heads over 3 KV heads split 6+3 (2+1 KV heads)
    shards = tp2.llm_engine.executor.collective_rpc("ready")
    assert [(s["num_heads"], s["num_kv_heads"]) for s in shards] == [(6, 2), (3, 1)]
    assert tp2.llm_engine.num_blocks == 20


def test_profile_traces_every_rank_own_collectives(tp2, tmp_path):
    import json

    with pytest.raises(RuntimeError, match="without start_profile"):
        tp2.stop_profile()
    tp2.start_profile()
    tp2.generate([PREFIX + QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    tables = tp2.stop_profile(str(tmp_path))
    assert [t.splitlines()[0] for t in tables] == ["rank 0", "rank 1"] and all("aten::mm" in t for t in tables)
    for rank in (0, 1):  # each rank traced its own forwards: its side of the all-reduces
        events = json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"]
        assert sum(e.get("name") == "gloo:all_reduce" for e in events) >= 3 * 2 * 30


def test_killed_rank_fails_the_engine_fast_naming_the_rank():
    llm = LLM(tensor_parallel_size=2, **ENGINE)
    try:
        executor = llm.llm_engine.executor
        proc = executor.procs[1]
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
            llm.generate(["hello there"], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(WorkerFailure, match="rank 1"):
            llm.llm_engine.check_health()
    finally:
        start = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - start < 10 and proc.poll() is not None
    assert not os.path.exists(f"/dev/shm/{executor._ring.name.lstrip('/')}")  # the step ring is removed


def test_bad_rank_count_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(tensor_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' runs one rank"):
        LLM(tensor_parallel_size=2, distributed_executor_backend="uni", **ENGINE)


def test_ray_not_installed_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(WorkerFailure, match=r"needs Ray, which is not installed \(pip install 'kvforge\[ray\]'\)"):
        LLM(tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)


def test_the_default_backend_is_ray_only_when_told_or_the_node_is_too_small(monkeypatch, tmp_path):
    """A Ray cluster another program runs on this node (its address file in the system temp dir) does
    not make the ranks Ray actors; ``RAY_ADDRESS`` or a connected process does."""
    import sys

    import torch

    from kvforge.rank.executor import default_backend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", None)
    cluster_file = tmp_path / "ray" / "ray_current_cluster"
    cluster_file.parent.mkdir()
    cluster_file.write_text("127.0.0.1:6379")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where Ray's address file would say a cluster runs
    cpu = torch.device("cpu")
    assert (default_backend(1, cpu), default_backend(2, cpu)) == ("uni", "mp")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert default_backend(2, cpu) == "ray"


def test_speculative_decoding_under_tp2_keeps_the_tokens(default_llm):
    """ngram drafts verified by the rejection sampler on the driver's logits (all ranks run the
    verification rows' forward and logits)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "a b c a b c a b c a b c", "The capital of France is"]
    common = dict(device="cpu", num_gpu_blocks_override=64)
    # one rank, no drafts: conftest's shared default-model engine (greedy tokens do not depend on its pool)
    ref = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "policy": "fixed"}, **common)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        assert llm.llm_engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_a_call_that_raises_on_every_rank_fails_alone_and_the_ranks_live_on(tp2):
    """Issue 34: a call that raises for a reason that is not the device's (as a corrupt file a request
    brought would) is that call's error, as the driver raised it; no rank process exits (they used to),
    and the next call and the next steps are answered in order (every rank's reply was read)."""
    executor = tp2.llm_engine.executor
    procs = dict(executor.procs)
    with pytest.raises(TypeError, match="positional argument"):
        executor.collective_rpc("batch_state", "an argument it does not take")
    assert executor.procs == procs and all(p.poll() is None for p in procs.values())
    assert [s["requests"] for s in executor.collective_rpc("batch_state")] == [0, 0]
    assert executor.call(BatchState()) == executor.collective_rpc(BatchState()) == [{"requests": 0, "blocks": 0}] * 2
    got, _ = _run(tp2)
    assert len(got) == len(_requests()[0]) and all(got)


def test_a_rank_s_failed_call_is_a_rank_call_error_naming_the_first_rank():
    from kvforge.rank.executor import FailedCall, RankCallError, check_calls

    assert check_calls("m", {1: "b", 0: "a"}) == ["a", "b"]
    with pytest.raises(RankCallError, match=r"^rank 1: m failed: OSError: unreadable$"):
        check_calls("m", {0: "a", 2: FailedCall("ValueError: later"), 1: FailedCall.of(OSError("unreadable"))})
