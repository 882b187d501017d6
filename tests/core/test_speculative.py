"""Speculative decoding in the engine, on the real default model: greedy output is token-for-token the
output without speculation, whatever else is on (docs/speculative.md)."""
from __future__ import annotations

import json

import pytest

from kvforge import LLM, SamplingParams
from kvforge.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "policy": "fixed"}
#: copying is common: the output repeats pieces of the prompt, so n-gram drafts get accepted
PROMPTS = [
    "Repeat this line exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Count: one two three four five, one two three four five, one two three",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Copy the list: apples, pears, plums, apples, pears,",
    "The capital of France is Paris. The capital of France is",
    "a b c d e f g a b c d e f g a b c",
    "Hello! Hello! Hello! Hello!",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Write the word banana five times: banana banana",
]


def _llm(spec: dict | None = NGRAM, **kw) -> LLM:
    kw = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 16, **kw}
    return LLM(speculative_config=spec, **kw)


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def plain():
    return _llm(None, num_gpu_blocks_override=512)


@pytest.fixture(scope="module")
def spec():
    return _llm(num_gpu_blocks_override=512)


@pytest.fixture(scope="module")
def baseline(plain):
    return _tokens(plain.generate(PROMPTS, _greedy(), use_tqdm=False))


def _accepted(llm) -> int:
    return llm.llm_engine.spec_stats.num_accepted_tokens


def test_greedy_output_is_identical_with_ngram_drafts(spec, baseline, check_no_blocks):
    before = _accepted(spec)
    assert _tokens(spec.generate(PROMPTS, _greedy(), use_tqdm=False)) == baseline
    assert _accepted(spec) - before > 20  # drafts were proposed and accepted: the test is not vacuous
    check_no_blocks(spec.llm_engine)


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=32),  # forced chunking: prompts take several steps, drafts share the budget
    dict(num_gpu_blocks_override=16, block_size=8, max_model_len=128),  # too small a pool: preemption
    dict(enable_prefix_caching=False),
    dict(async_scheduling=True),
])
def test_greedy_output_is_identical_under_engine_options(options, baseline, check_no_blocks):
    llm = _llm(**options)
    assert _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False)) == baseline
    if "num_gpu_blocks_override" in options:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert _accepted(llm) > 0
    check_no_blocks(llm.llm_engine)


def test_prefix_cache_hits_with_speculation_match(spec, plain, check_no_blocks):
    """Blocks are hashed only over accepted tokens: a repeat of a prompt plus its generated text hits
    the cache and gives the same continuation as without speculation."""
    first = spec.generate(PROMPTS[:3], _greedy(), use_tqdm=False)
    follow = [p + o.outputs[0].text for p, o in zip(PROMPTS[:3], first)]
    hits = spec.llm_engine.kv_cache.stats().prefix_cache_hits
    got = _tokens(spec.generate(follow, _greedy(8), use_tqdm=False))
    assert spec.llm_engine.kv_cache.stats().prefix_cache_hits > hits
    assert got == _tokens(plain.generate(follow, _greedy(8), use_tqdm=False))
    check_no_blocks(spec.llm_engine)


def test_max_tokens_and_stop_strings_cut_exactly_inside_an_accepted_run(spec, plain):
    # every prompt under each of the three cuts, all in one batch (per-prompt params): a third of the steps
    cuts = (_greedy(7), _greedy(24, stop=["brown", "four", ", 7"]),
            SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[11]))
    params = [p for p in cuts for _ in PROMPTS]
    want = plain.generate(PROMPTS * len(cuts), params, use_tqdm=False)
    got = spec.generate(PROMPTS * len(cuts), params, use_tqdm=False)
    assert len(want) == len(got) == len(params)
    for w, g in zip(want, got):
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason, g.outputs[0].stop_reason) \
            == (w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason, w.outputs[0].stop_reason)


def test_penalties_logit_bias_and_bad_words_see_the_drafts(spec, plain):
    params = _greedy(20, repetition_penalty=1.3, frequency_penalty=0.5, bad_words=["fox"], logit_bias={11: 2.0})
    assert _tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == _tokens(plain.generate(PROMPTS, params,
                                                                                           use_tqdm=False))


def test_logprobs_of_the_emitted_tokens_match(spec, plain):
    params = _greedy(12, logprobs=2)
    want = plain.generate(PROMPTS[:4], params, use_tqdm=False)
    got = spec.generate(PROMPTS[:4], params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs) == 12
        for tok, lw, lg in zip(w.outputs[0].token_ids, w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lg[tok].logprob == pytest.approx(lw[tok].logprob, abs=1e-3)
            assert sorted(lg) == sorted(lw)


def test_n_samples_with_speculation(spec, plain):
    params = _greedy(10, n=2)
    assert _tokens(spec.generate(PROMPTS[:3], params, use_tqdm=False)) == _tokens(
        plain.generate(PROMPTS[:3], params, use_tqdm=False))


def test_n_samples_joining_a_verification_step(spec, plain, check_no_blocks):
    """An n = 2 request whose prompt ends in a step that verifies another request's drafts: its fork
    samples from the same row (it would be lost if the step only sampled the drafting requests)."""
    eng = spec.llm_engine
    eng.add_request("long", PROMPTS[5], _greedy(40))
    for _ in range(20):
        eng.step()
        if any(r.draft_token_ids for r in eng.scheduler.running):
            break
    assert any(r.draft_token_ids for r in eng.scheduler.running)  # the next step verifies drafts
    eng.add_request("pair", PROMPTS[6], _greedy(8, n=2))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    want = _tokens(plain.generate([PROMPTS[6]], _greedy(8, n=2), use_tqdm=False))
    assert done["pair"] == want and len(want) == 2
    check_no_blocks(eng)


def test_seeded_sampling_with_speculation_is_reproducible(spec):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(PROMPTS))]
    a = _tokens(spec.generate(PROMPTS, params, use_tqdm=False))
    b = _tokens(spec.generate(PROMPTS[::-1], params[::-1], use_tqdm=False))[::-1]  # other batch order
    assert a == b and all(len(t) == 16 for t in a)


def test_json_schema_outputs_parse_and_validate_with_speculation(spec):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    outs = spec.generate(["Give a person as JSON: ", "JSON for Bob, 42: "], params, use_tqdm=False)
    for o in outs:
        data = json.loads(o.outputs[0].text)
        assert set(data) == {"name", "age"} and isinstance(data["age"], int)


def test_the_fixed_policy_drafts_every_step_and_stats_add_up(spec):
    stats = spec.llm_engine.get_stats()["spec_decode"]
    assert stats["num_draft_tokens"] >= stats["num_accepted_tokens"] > 0
    assert sum(stats["accepted_by_position"]) == stats["num_accepted_tokens"]
    assert stats["accepted_by_position"] == sorted(stats["accepted_by_position"], reverse=True)
    assert stats["mean_accepted_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"])


@pytest.mark.parametrize("spec_config,match", [
    ({"method": "nope", "num_speculative_tokens": 2}, "unknown drafter 'nope'; valid names: .*ngram"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, r"unknown option\(s\) \['lookup'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "policy": "always"}, "policy must be one of"),
    ({"num_speculative_tokens": 2}, "'method' .* is required"),
])
def test_bad_speculative_configs_are_value_errors(spec_config, match):
    with pytest.raises(ValueError, match=match):
        LLM("dummy:tiny", device="cpu", max_model_len=64, num_gpu_blocks_override=16, speculative_config=spec_config)


@pytest.mark.parametrize("draft", ["default", "dummy:tiny"])
def test_greedy_output_is_identical_with_a_draft_model(draft, baseline, default_model_path, check_no_blocks):
    """The default model drafting for itself accepts every draft; a random tiny model with the same
    vocabulary almost none: the output is the same either way."""
    model = default_model_path if draft == "default" else draft
    llm = _llm({"method": "draft_model", "model": model, "num_speculative_tokens": 3, "policy": "fixed"},
               num_gpu_blocks_override=512)
    assert _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False)) == baseline
    stats = llm.llm_engine.get_stats()["spec_decode"]
    if draft == "default":
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    else:
        assert stats["acceptance_rate"] < 0.5
    check_no_blocks(llm.llm_engine)


def test_sampled_requests_with_a_draft_model_are_reproducible(default_model_path):
    llm = _llm({"method": "draft_model", "model": "dummy:tiny", "num_speculative_tokens": 2, "policy": "fixed"},
               num_gpu_blocks_override=256)
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(4)]
    a = _tokens(llm.generate(PROMPTS[:4], params, use_tqdm=False))
    b = _tokens(llm.generate(PROMPTS[:4], params, use_tqdm=False))
    assert a == b and all(len(t) == 12 for t in a)
    assert llm.llm_engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0


def test_a_draft_model_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary of .* tokens and the target .*; they must share one"):
        # (checked from the configs, before any weight is built)
        _llm({"method": "draft_model", "model": "dummy:llama-3.2-1b", "num_speculative_tokens": 2}, model="dummy:tiny")
