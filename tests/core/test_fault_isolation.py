"""One request never harms another (docs/reliability.md): a request that fails on its own ends with
an error and frees its blocks, every other request gets exactly the tokens it gets without it, and
the engine serves the next request."""
from __future__ import annotations

import pytest
import torch

import kvforge
from kvforge import LLM, SamplingParams
from kvforge.engine.llm_engine import NOTHING_TO_SAMPLE
from kvforge.errors import RequestFailure, is_device_error
from kvforge.sampler import NO_TOKEN, LogitsProcessor

PROMPTS = [[5 + i, 17, 300 + 7 * i, 42, 9] for i in range(8)]
BAD = 3  # the request whose logits processor raises


class RaiseFor(LogitsProcessor):
    """Identity, except that it raises when a row's request asks for it (``extra_args["raise"]``)."""

    def apply(self, logits, requests):
        for r in requests:
            kind = (r.sampling_params.extra_args or {}).get("raise")
            if kind == "value":
                raise ValueError("injected: this request's arguments are bad")
            if kind == "bug":
                raise KeyError("injected bug")
        rows = [i for i, r in enumerate(requests) if (r.sampling_params.extra_args or {}).get("raise") == "mask_all"]
        if rows:  # the whole vocabulary masked, as constraints that exclude each other would
            logits = logits.clone()
            logits[rows] = float("-inf")
        rows = [i for i, r in enumerate(requests) if (r.sampling_params.extra_args or {}).get("raise") == "nan"]
        if rows:
            logits = logits.clone()
            logits[rows, 7] = float("nan")
        return logits


@pytest.fixture
def raise_plugin(tiny_llm):
    class Plugin:
        @kvforge.hookimpl
        def register_logits_processors(self, register):
            register("raise_for", RaiseFor)

    pm = tiny_llm.llm_engine.plugin_manager
    pm.register(Plugin(), "raise-plugin")
    yield
    pm.unregister("raise-plugin")


def _params(kind: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logits_processors=["raise_for"],
                          extra_args={"raise": kind} if kind else None)


@pytest.mark.parametrize("kind,status", [("value", 400), ("bug", 500)])
def test_a_raising_logits_processor_fails_only_its_request(tiny_llm, raise_plugin, check_no_blocks, kind, status):
    baseline = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, _params(), use_tqdm=False)]
    params = [_params(kind) if i == BAD else _params() for i in range(len(PROMPTS))]
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if i == BAD:
            assert out.outputs[0].finish_reason == "error"
            assert out.error is not None and out.error.status == status
            assert "injected" in out.error.message
        else:
            assert out.error is None
            assert out.outputs[0].token_ids == baseline[i]  # exactly the tokens it gets without the bad one
    check_no_blocks(tiny_llm.llm_engine)
    again = tiny_llm.generate(PROMPTS[:2], _params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == baseline[:2]


@pytest.mark.parametrize("kind", ["mask_all", "nan"])
def test_a_row_with_nothing_to_sample_fails_only_its_request(tiny_llm, raise_plugin, check_no_blocks, kind):
    baseline = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, _params(), use_tqdm=False)]
    params = [_params(kind) if i == BAD else _params() for i in range(len(PROMPTS))]
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[BAD].error == NOTHING_TO_SAMPLE and outs[BAD].outputs[0].finish_reason == "error"
    assert outs[BAD].outputs[0].token_ids == []  # no made-up token 0
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != BAD] == baseline[:BAD] + baseline[BAD + 1:]
    check_no_blocks(tiny_llm.llm_engine)


def test_a_no_token_row_under_async_scheduling_fails_only_its_request(check_no_blocks):
    """With async scheduling the next step is launched before the host sees NO_TOKEN: it must read a
    valid token on the device, and the request still fails alone."""
    llm = LLM("dummy:tiny", device="cpu", max_model_len=128, num_gpu_blocks_override=64, async_scheduling=True)
    eng = llm.llm_engine
    assert eng.async_scheduling
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    baseline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
    sampler, seen = eng.runner.sampler, {}
    real_prepare, real_sample = sampler.prepare, sampler.sample

    def prepare(reqs):
        seen["reqs"] = list(reqs)
        return real_prepare(reqs)

    def sample(logits, state):
        tokens = real_sample(logits, state)
        for i, r in enumerate(seen["reqs"]):
            if r.request_id.startswith("victim") and len(r.output_token_ids) == 2:
                tokens[i] = NO_TOKEN
        return tokens

    sampler.prepare, sampler.sample = prepare, sample
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request("victim" if i == 1 else f"ok{i}", p, params)
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert done["victim"].error == NOTHING_TO_SAMPLE and len(done["victim"].outputs[0].token_ids) == 2
    assert [done[f"ok{i}"].outputs[0].token_ids for i in (0, 2, 3)] == [baseline[0], baseline[2], baseline[3]]
    check_no_blocks(eng)


def test_a_failing_request_with_n_samples_fails_whole_and_frees_its_blocks(tiny_llm, raise_plugin, check_no_blocks):
    ok = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=3, logits_processors=["raise_for"],
                         extra_args={"raise": "value"})
    baseline = tiny_llm.generate(PROMPTS[:1], ok, use_tqdm=False)[0].outputs[0].token_ids
    outs = tiny_llm.generate([PROMPTS[0], PROMPTS[1]], [ok, bad], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == baseline
    assert outs[1].error is not None and [c.finish_reason for c in outs[1].outputs] == ["error"] * 3
    check_no_blocks(tiny_llm.llm_engine)


def test_a_raising_stop_string_check_fails_only_its_request(tiny_llm, monkeypatch, check_no_blocks):
    from kvforge.engine.output_processor import OutputProcessor

    real = OutputProcessor._update_text

    def update_text(self, seq):
        if seq.request.prompt_token_ids == PROMPTS[BAD]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, seq)

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=["zzz"])
    baseline = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setattr(OutputProcessor, "_update_text", update_text)
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[BAD].outputs[0].finish_reason == "error" and outs[BAD].error.status == 400
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != BAD] == baseline[:BAD] + baseline[BAD + 1:]
    check_no_blocks(tiny_llm.llm_engine)


def test_device_errors_are_never_pinned_on_a_request():
    assert is_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_device_error(ValueError("bad argument"))
    assert not is_device_error(KeyError("x"))
    assert RequestFailure.from_exception(ValueError("x"), "sampling").status == 400
    assert RequestFailure.from_exception(KeyError("x"), "sampling").status == 500


def test_n_samples_with_a_clashing_id_add_nothing(tiny_llm, check_no_blocks):
    eng = tiny_llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("clash#1", [5, 6, 7], p)
    with pytest.raises(ValueError, match="request_id: 'clash#1' is already in use"):
        eng.add_request("clash", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2))
    assert set(eng.scheduler.requests) == {"clash#1"} and set(eng.outputs.parents) == {"clash#1"}
    finished = []
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in finished] == ["clash#1"] and len(finished[0].outputs[0].token_ids) == 3
    check_no_blocks(eng)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=2 ** 64), "seed must be in"),
    (dict(seed=-(2 ** 63) - 1), "seed must be in"),
    (dict(seed=2 ** 64 - 1, n=2), r"seed \+ 1 too"),
    (dict(temperature=float("nan")), "temperature must be in"),
    (dict(temperature=1e300), r"temperature must be in \[0, 10000\]"),
    (dict(repetition_penalty=1e-300), "repetition_penalty must be in"),
    (dict(repetition_penalty=1e300), "repetition_penalty must be in"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(8193)}), "logit_bias: at most 8192"),
    (dict(stop=["x"] * 65), "stop: at most 64"),
    (dict(stop=["x" * 1025]), "stop: at most"),
    (dict(bad_words=["w"] * 1025), "bad_words: at most"),
    (dict(allowed_token_ids=list(range(8193))), "allowed_token_ids: at most"),
])
def test_out_of_range_sampling_fields_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_the_largest_seed_runs(tiny_llm):
    out = tiny_llm.generate([PROMPTS[0]], SamplingParams(seed=2 ** 64 - 1, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_vanishing_temperature_is_greedy(tiny_llm):
    greedy = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tiny = tiny_llm.generate(PROMPTS, SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]


def test_a_vanishing_top_p_keeps_the_top_token(tiny_llm):
    greedy = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tiny = tiny_llm.generate(PROMPTS, SamplingParams(top_p=1e-300, max_tokens=6, ignore_eos=True, seed=1),
                             use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]


def test_n_above_max_n_is_refused():
    llm = LLM("dummy:tiny", device="cpu", max_model_len=64, num_gpu_blocks_override=32, max_n=2)
    with pytest.raises(ValueError, match=r"n: 3 is more than the limit of 2 \(max_n=2"):
        llm.generate("hi", SamplingParams(n=3), use_tqdm=False)


def test_a_bad_word_that_tokenizes_to_nothing_is_refused(tiny_llm, monkeypatch):
    tok = tiny_llm.llm_engine.tokenizer
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: [] if text.strip() == "nothing" else real(text, **kw))
    with pytest.raises(ValueError, match="bad_words: 'nothing' tokenizes to no tokens"):
        tiny_llm.generate("hi", SamplingParams(bad_words=["nothing"]), use_tqdm=False)


def test_prompt_logprobs_in_slices_match_all_at_once(tiny_llm, monkeypatch):
    import kvforge.rank.prompt_logits as mr

    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    prompt = list(range(10, 60))
    whole = tiny_llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    monkeypatch.setattr(mr, "PROMPT_LOGPROBS_SLICE_BYTES", tiny_llm.llm_engine.model_config.vocab_size * 12 * 7)
    assert tiny_llm.llm_engine.runner.prompt_logprobs_rows() == 7
    sliced = tiny_llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert len(sliced) == len(prompt) and sliced[0] is None
    for a, b in zip(whole[1:], sliced[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)
            # the top entries' ranks exactly; a deep rank may move by one between exact float ties
            assert a[t].rank == b[t].rank if a[t].rank <= 3 else abs(a[t].rank - b[t].rank) <= 1
