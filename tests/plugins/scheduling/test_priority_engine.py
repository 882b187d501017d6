"""The priority scheduler in the engine (tiny random Llama): outputs, order, stats and metrics."""
import pytest

from kvforge import LLM, SamplingParams

PROMPTS = [list(range(1 + 7 * i, 30 + 7 * i)) for i in range(4)]
GREEDY_N2 = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)


@pytest.fixture(scope="module")
def reference(tiny_llm):
    return tiny_llm.generate(PROMPTS, GREEDY_N2, use_tqdm=False)


def tiny(mode="recompute", swap_space=0.01, **kw):
    kw = {"max_model_len": 128, "num_gpu_blocks_override": 8, **kw}
    return LLM("dummy:tiny", device="cpu", scheduler="priority", swap_space=swap_space,
               plugins={"priority": {"preemption_mode": mode}}, **kw)


@pytest.mark.parametrize("mode,swap_space", [("recompute", 0.01), ("swap", 0.01), ("swap", 0)])
def test_greedy_outputs_survive_preemption(reference, check_no_blocks, mode, swap_space):
    """8 blocks of 16 for 4 requests of 2 samples that each grow to 4 blocks: many preemptions."""
    llm = tiny(mode, swap_space)
    got = llm.generate(PROMPTS, GREEDY_N2, use_tqdm=False, priority=[1, 0, 1, 0])
    for g, w in zip(got, reference):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_swapped"] == 0
    if mode == "swap" and swap_space:
        assert stats["num_preemptions_swap"] > 0 and stats["num_swapped_out_blocks"] > 0
    else:
        assert stats["num_preemptions_swap"] == 0 and stats["num_swapped_out_blocks"] == 0
    assert stats["num_cpu_blocks"] == (0 if swap_space == 0 else stats["num_free_cpu_blocks"])
    check_no_blocks(llm.llm_engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_late_high_priority_request_finishes_first(check_no_blocks, mode):
    llm = tiny(mode, max_num_seqs=2, num_gpu_blocks_override=32)
    engine = llm.llm_engine
    low = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"low{i}", PROMPTS[i], low, priority=1)
    engine.step()
    engine.step()
    assert engine.get_stats()["waiting_by_priority"] == {1: 2}
    engine.add_request("high", PROMPTS[0][:9], SamplingParams(max_tokens=3, ignore_eos=True), priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished[0] == "high" and sorted(finished[1:]) == [f"low{i}" for i in range(4)]
    stats = engine.get_stats()
    assert stats["num_preemptions"] == 1
    assert stats["num_preemptions_swap"] == (1 if mode == "swap" else 0)
    check_no_blocks(engine)


def test_generate_checks_priority(tiny_llm):
    for bad in ([0], [0, "1"], [0, True], 3):
        with pytest.raises(ValueError, match="priority"):
            tiny_llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False, priority=bad)


def test_metrics_show_modes_swaps_and_waiting_by_priority():
    pytest.importorskip("prometheus_client")
    from kvforge.server.metrics import ServerMetrics

    stats = {"num_running": 1, "num_waiting": 3, "kv_cache_usage": 0.5, "prefix_cache_queries": 0,
             "prefix_cache_hits": 0, "prefix_cache_tier_hits": 0, "kv_tier_stored_blocks": 0,
             "prefix_cache_cpu_hits": 0, "prefix_cache_disk_hits": 0, "kv_tier_cpu_blocks": 0, "kv_tier_disk_blocks": 0,
             "num_preemptions": 5, "num_preemptions_recompute": 2,
             "num_preemptions_swap": 3, "num_swapped_out_blocks": 7, "num_swapped": 1,
             "waiting_by_priority": {0: 1, 2: 2}, "num_prompt_tokens": 0, "num_generation_tokens": 0, "rank_batch_requests": [0, 2]}
    text = ServerMetrics(lambda: stats, "m").render().decode()
    for line in ['kvforge:num_preemptions_total{model_name="m"} 5.0',
                 'kvforge:num_preemptions_by_mode_total{mode="recompute",model_name="m"} 2.0',
                 'kvforge:num_preemptions_by_mode_total{mode="swap",model_name="m"} 3.0',
                 'kvforge:swapped_out_blocks_total{model_name="m"} 7.0',
                 'kvforge:num_requests_swapped{model_name="m"} 1.0',
                 'kvforge:num_requests_waiting_by_priority{model_name="m",priority="0"} 1.0',
                 'kvforge:num_requests_waiting_by_priority{model_name="m",priority="2"} 2.0',
                 'kvforge:rank_batch_requests{model_name="m",rank="1"} 2.0']:
        assert line in text


@pytest.mark.gpu
def test_swapping_on_cuda_keeps_greedy_outputs(check_no_blocks):
    """Pinned pool and asynchronous copies: float32, so that batching cannot change a greedy token."""
    prompts = [list(range(100 + 50 * i, 160 + 50 * i)) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", attention_backend="torch", max_model_len=128)
    want = LLM("dummy:tiny", num_gpu_blocks_override=128, **common).generate(prompts, params, use_tqdm=False)
    llm = LLM("dummy:tiny", num_gpu_blocks_override=16, scheduler="priority", swap_space=0.05,
              plugins={"priority": {"preemption_mode": "swap"}}, **common)
    got = llm.generate(prompts, params, use_tqdm=False, priority=[i % 3 for i in range(8)])
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions_swap"] > 0 and llm.llm_engine.runner.swap_space.caches[0].is_pinned()
    check_no_blocks(llm.llm_engine)
