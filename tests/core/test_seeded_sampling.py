"""Seeded sampling is reproducible whatever the drafter, k, the policy, the batch, the chunking and the stop
conditions (issue 41), on the real default model: the token at each output position is the draw keyed by
(seed, position), so every run below equals one plain, unchunked, non-speculative run token for token
(docs/sampling.md#seeded-requests)."""
from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

#: the issue's engine: prompts chunked into 64-token steps, n-gram drafts with the default (auto) policy
ISSUE_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
#: copying prompts, so that drafts get accepted; the last is longer than a 64-token step (chunked alone)
PROMPTS = [
    "Repeat this line exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Count: one two three four five, one two three four five, one two three",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Copy the list: apples, pears, plums, apples, pears,",
    "The capital of France is Paris. The capital of France is",
    "a b c d e f g a b c d e f g a b c",
    "Hello! Hello! Hello! Hello!",
    "Say it again and again: " + "the rain in Spain stays mainly in the plain, " * 6,
]


def _params(i: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "top_p": 0.95, "seed": 100 + i, "max_tokens": 32, **kw})


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _llm(spec: dict, **kw) -> LLM:
    return LLM(device="cpu", num_gpu_blocks_override=256, max_num_batched_tokens=64, speculative_config=spec, **kw)


def _accepted(llm: LLM) -> int:
    return llm.llm_engine.spec_stats.num_accepted_tokens


@pytest.fixture(scope="module")
def reference(default_llm) -> list[list[int]]:
    """The eight requests in one plain run: no drafts, the prompts in one step each."""
    return _tokens(default_llm.generate(PROMPTS, [_params(i) for i in range(8)], use_tqdm=False))


@pytest.fixture(scope="module")
def issue_llm() -> LLM:
    return _llm(ISSUE_SPEC)


def test_the_issue_runs_twice_through_one_llm_with_the_same_tokens_as_without_drafts(issue_llm, reference):
    params = [_params(i) for i in range(8)]
    first = _tokens(issue_llm.generate(PROMPTS, params, use_tqdm=False))
    accepted = _accepted(issue_llm)
    second = _tokens(issue_llm.generate(PROMPTS, params, use_tqdm=False))
    assert first == second == reference
    assert accepted > 10  # drafts were accepted (in the second run the policy may have turned them off)


def test_a_seeded_request_gives_its_tokens_alone_and_beside_any_other_requests(issue_llm, reference):
    alone = _tokens(issue_llm.generate([PROMPTS[3]], [_params(3)], use_tqdm=False))[0]
    others = [_params(0, seed=None), SamplingParams(temperature=0, max_tokens=20), _params(1, seed=7, top_p=1.0),
              _params(2, temperature=1.2, seed=None), _params(4, top_k=5), SamplingParams(temperature=0, max_tokens=9),
              _params(5, seed=None, max_tokens=40)]
    beside = _tokens(issue_llm.generate([PROMPTS[3]] + PROMPTS[:3] + PROMPTS[4:], [_params(3)] + others,
                                        use_tqdm=False))
    assert alone == beside[0] == reference[3]


@pytest.mark.parametrize("k,options", [
    (1, {"policy": "fixed"}),  # a draft every step
    (2, {"policy": "auto", "async_scheduling": True}),  # the policy turns drafting off: steps overlap
])
def test_seeded_tokens_do_not_depend_on_k_or_the_policy(k, options, reference):
    spec = dict(ISSUE_SPEC, num_speculative_tokens=k, prompt_lookup_min=1, policy=options["policy"])
    llm = _llm(spec, **{key: v for key, v in options.items() if key != "policy"})
    runner, overlapped = llm.llm_engine.runner, []
    launch = runner.launch
    runner.launch = lambda out, kv, prev=None: overlapped.append(prev is not None) or launch(out, kv, prev)
    # max_tokens 12: the first 12 tokens of the 32-token run (the draws are keyed by position)
    got = _tokens(llm.generate(PROMPTS, [_params(i, max_tokens=12) for i in range(8)], use_tqdm=False))
    assert got == [t[:12] for t in reference]
    assert _accepted(llm) > 5
    # with async scheduling, steps without drafts ran while the step before them was in flight (the
    # rows then count that step's placeholder in their output position)
    assert any(overlapped) == options.get("async_scheduling", False)


def test_max_tokens_and_stop_strings_cut_the_same_tokens(issue_llm, reference, default_llm):
    tok = default_llm.get_tokenizer()
    texts = [tok.decode(t) for t in reference]
    stops = [tok.decode(t[8:10]) for t in reference]  # the first occurrence may be earlier: cut there
    want = [(text[:text.index(stop)] if stop.strip() and stop in text else None) for text, stop in zip(texts, stops)]
    params = [_params(i, max_tokens=5 + 3 * i) for i in range(8)]
    params += [_params(i, stop=[stop]) for i, stop in enumerate(stops) if want[i] is not None]
    outs = issue_llm.generate(PROMPTS + [p for i, p in enumerate(PROMPTS) if want[i] is not None], params,
                              use_tqdm=False)
    for i, out in enumerate(outs[:8]):
        assert out.outputs[0].token_ids == reference[i][:5 + 3 * i]
    cut = [w for w in want if w is not None]
    assert len(cut) >= 4 and [o.outputs[0].text for o in outs[8:]] == cut
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[8:])


def test_a_draft_model_drafting_with_the_keyed_noise_is_accepted_and_changes_nothing(reference, default_model_path):
    """The default model drafting for itself draws each draft with the target's keyed noise at its
    position (the Gumbel coupling): the draft is the target's token unless it falls outside top_p."""
    llm = _llm({"method": "draft_model", "model": default_model_path, "num_speculative_tokens": 3, "policy": "fixed"})
    got = _tokens(llm.generate(PROMPTS[:4], [_params(i, max_tokens=12) for i in range(4)], use_tqdm=False))
    assert got == [t[:12] for t in reference[:4]]
    assert llm.llm_engine.get_stats()["spec_decode"]["acceptance_rate"] > 0.8
