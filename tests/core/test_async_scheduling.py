"""Async scheduling: the next step is scheduled and laid out while the current one runs, its
placeholder tokens filled on the device; the results must equal the synchronous engine's."""
import pytest

from kvforge import LLM, SamplingParams
from kvforge.request import PLACEHOLDER


@pytest.fixture(scope="module")
def engines():
    kw = dict(max_model_len=512, num_gpu_blocks_override=256, device="cpu")
    # forced on: the CPU default is off (nothing overlaps there), the logic is the same as on CUDA
    return LLM("dummy:tiny", async_scheduling=True, **kw), LLM("dummy:tiny", async_scheduling=False, **kw)


def _run(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_async_equals_sync_mixed_workload(engines, check_no_blocks):
    on, off = engines
    prompts = ["a b c", [5, 6, 7, 8, 9, 10] * 9, "hello world, this is a longer prompt", "x", "y z"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 17, 9, 1, 12)]
    params[2] = SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True, logprobs=2)
    params[4] = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True)  # sync-only
    assert _run(on, prompts, params) == _run(off, prompts, params)
    check_no_blocks(on.llm_engine)


def test_stop_token_mid_flight_discards_the_extra_step(engines, check_no_blocks):
    """A request that stops on a token was already scheduled for one more step: that step's token is
    dropped, and its blocks return."""
    on, off = engines
    ref = _run(off, ["stop here please"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0][0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[ref[4]])
    got = _run(on, ["stop here please", "another prompt"], [params, SamplingParams(max_tokens=12, ignore_eos=True)])
    assert got[0][0] == ref[:ref.index(ref[4]) + 1]
    check_no_blocks(on.llm_engine)


def test_one_step_in_flight_and_placeholders(engines):
    on, _ = engines
    eng = on.llm_engine
    eng.add_request("p", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert eng.step() == []  # the prefill is in flight: its token is a placeholder
    req = eng.scheduler.requests["p"]
    assert req.output_token_ids == [PLACEHOLDER] and eng._inflight is not None
    out = eng.step()  # launches the first decode (its input from the device), then applies the prefill
    assert [len(o.outputs[0].token_ids) for o in out] == [1]
    assert req.output_token_ids[0] != PLACEHOLDER and req.output_token_ids[-1] == PLACEHOLDER
    steps = 2
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    assert steps == 4 + 1  # the last token's step is never followed by a wasted one (max_tokens known)
    assert "p" not in eng.scheduler.requests


def test_penalties_run_synchronously(engines):
    on, _ = engines
    eng = on.llm_engine
    eng.add_request("q", [3, 4, 5], SamplingParams(temperature=0, max_tokens=3, presence_penalty=1.0))
    assert len(eng.step()) == 1 and eng._inflight is None  # the token is on the host at once
    while eng.has_unfinished_requests():
        eng.step()


def test_staging_buffers_are_reused(engines):
    """No per-step host allocation: every step lays out in one of two fixed pinned-buffer sets."""
    on, _ = engines
    runner = on.llm_engine.runner.worker  # the driver worker lays the steps out
    ptrs = {id(s): s.tensors["input_ids"].data_ptr() for s in runner.buffers.staging.sets}
    on.generate([[7, 8, 9]] * 3, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert {id(s): s.tensors["input_ids"].data_ptr() for s in runner.buffers.staging.sets} == ptrs


def test_default_is_on_for_cuda_only(tiny_llm):
    assert tiny_llm.llm_engine.config.async_scheduling is None and not tiny_llm.llm_engine.async_scheduling


def test_cli_flag():
    from kvforge.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "hi", "--no-async-scheduling"])
    assert engine_kwargs(args)["async_scheduling"] is False
