"""Penalties, logit bias, masks and logits processors against a small reference on fixed logits."""
import pytest
import torch

from kvforge.plugins.sampling.default import DefaultSampler
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams

V = 12


def make_req(rid, prompt, output, **kw):
    r = Request(rid, list(prompt), SamplingParams(**kw))
    r.output_token_ids = list(output)
    r.sampling_params._eos_token_ids = (0,)
    return r


def reference(logits, req):
    """Straightforward per-token loops: what each parameter means."""
    p = req.sampling_params
    x = logits.clone()
    if p.min_tokens and len(req.output_token_ids) < p.min_tokens:
        for t in list(p._eos_token_ids) + list(p.stop_token_ids or []):
            x[t] = float("-inf")
    if p.allowed_token_ids is not None:
        for t in range(V):
            if t not in p.allowed_token_ids:
                x[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    for t in range(V):
        if t in seen and p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = req.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


CASES = [
    dict(presence_penalty=0.5),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=-1.0, frequency_penalty=0.7),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.8, presence_penalty=0.2),
    dict(logit_bias={3: 5.0, 7: -100.0}),
    dict(min_tokens=5, stop_token_ids=[4]),
    dict(allowed_token_ids=[1, 2, 9]),
    dict(),
]


def test_processing_matches_reference():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), V) * 3
    reqs = [make_req(str(i), [1, 5, 5, 8], [2, 2, 3, 11], **kw) for i, kw in enumerate(CASES)]
    s = DefaultSampler(vocab_size=V, device=torch.device("cpu"))
    got = s.process(logits, s.prepare(reqs))
    for i, r in enumerate(reqs):
        torch.testing.assert_close(got[i], reference(logits[i], r), msg=str(CASES[i]))


def test_greedy_respects_masks_and_bias():
    s = DefaultSampler(vocab_size=V, device=torch.device("cpu"))
    logits = torch.zeros(3, V)
    logits[:, 0] = 10.0  # EOS is the favourite
    reqs = [make_req("a", [1], [], temperature=0, min_tokens=2),
            make_req("b", [1], [], temperature=0, logit_bias={6: 20.0}),
            make_req("c", [1], [], temperature=0, allowed_token_ids=[4, 5])]
    toks = s.sample(logits, s.prepare(reqs)).tolist()
    assert toks[0] != 0 and toks[1] == 6 and toks[2] in (4, 5)


def test_bad_words_block_the_last_token_after_the_prefix():
    s = DefaultSampler(vocab_size=V, device=torch.device("cpu"))
    r = make_req("a", [1], [7, 8], temperature=0)
    r.bad_words_token_ids = [[8, 9], [5]]  # "8 9" is blocked only right after 8; "5" always
    logits = torch.zeros(1, V)
    logits[0, 9] = 5.0
    logits[0, 5] = 4.0
    logits[0, 3] = 3.0
    assert s.sample(logits, s.prepare([r])).item() == 3
    r.output_token_ids = [7, 7]
    assert s.sample(logits, s.prepare([r])).item() == 9


def test_sampling_param_validation():
    for kw, field in [(dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
                      (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={1: 200}), "logit_bias"),
                      (dict(logit_bias={"x": 1}), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
                      (dict(min_tokens=20, max_tokens=5), "min_tokens"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
                      (dict(bad_words=[""]), "bad_words"), (dict(structured_outputs={"regex": "a", "choice": ["b"]}),
                                                           "structured_outputs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


def test_extra_args_are_checked_against_the_enabled_processors_options(dummy_plugin_installed):
    """A processor's request_options check its keys before the request is queued (a ValueError naming
    extra_args.<key>); from Python a key no processor declares passes through; a valid one is applied."""
    from kvforge import LLM
    from kvforge.engine.input_checks import check_extra_args

    # an engine of its own: one built before the dummy plugin was installed does not know its processors
    tiny_llm = LLM("dummy:tiny", max_model_len=512, num_gpu_blocks_override=64, device="cpu")

    ban = dict(logits_processors=["dummy_ban"], max_tokens=1, temperature=0.0)
    with pytest.raises(ValueError, match=r"extra_args\.ban_token_id: ban_token_id must be a token id"):
        tiny_llm.generate(["hello"], SamplingParams(extra_args={"ban_token_id": -1}, **ban), use_tqdm=False)
    with pytest.raises(ValueError, match=r"extra_args\.ban_reason: ban_reason must be a string"):
        tiny_llm.generate(["hello"], SamplingParams(extra_args={"ban_reason": 3}, **ban), use_tqdm=False)
    free = SamplingParams(extra_args={"for_another_plugin": 1}, **ban)
    greedy = tiny_llm.generate(["hello"], free, use_tqdm=False)[0].outputs[0].token_ids[0]
    with pytest.raises(ValueError, match=r"vllm_xargs\.for_another_plugin: no logits processor"):
        check_extra_args(free, field="vllm_xargs")  # the server's strict check
    banned = SamplingParams(extra_args={"ban_token_id": greedy}, **ban)
    assert tiny_llm.generate(["hello"], banned, use_tqdm=False)[0].outputs[0].token_ids[0] != greedy
    tiny_llm.shutdown()
