"""n samples, stop strings, logprobs and streaming deltas, on the tiny random Llama."""
import math

import pytest

from kvforge import SamplingParams


def test_n_samples(tiny_llm, check_no_blocks):
    out = tiny_llm.generate("count with me", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                                            ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # child i is seeded with seed + i: sample 1 equals a single request seeded with 6
    one = tiny_llm.generate("count with me", SamplingParams(temperature=1.0, seed=6, max_tokens=12,
                                                            ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[1].token_ids == one.outputs[0].token_ids
    check_no_blocks(tiny_llm.llm_engine)


def _reference(tiny_llm, n=24):
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return tiny_llm.generate("the stop test", p, use_tqdm=False)[0].outputs[0]


def test_stop_string_across_token_boundaries(tiny_llm, check_no_blocks):
    ref = _reference(tiny_llm)
    tok = tiny_llm.get_tokenizer()
    # a stop string made of the end of token 4 and the start of token 5
    t4, t5 = tok.decode(ref.token_ids[4:5]), tok.decode(ref.token_ids[5:6])
    assert t4 and t5
    stop = t4[-1:] + t5[:2]
    idx = ref.text.find(stop)
    for include in (False, True):
        out = tiny_llm.generate("the stop test", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                stop=[stop, "\x00never"],
                                                                include_stop_str_in_output=include),
                                use_tqdm=False)[0].outputs[0]
        assert out.text == ref.text[:idx + (len(stop) if include else 0)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
    check_no_blocks(tiny_llm.llm_engine)


def test_streaming_deltas_concatenate_to_the_final_text(tiny_llm, check_no_blocks):
    ref = _reference(tiny_llm)
    engine = tiny_llm.llm_engine
    tok = tiny_llm.get_tokenizer()
    stop = tok.decode(ref.token_ids[10:12])
    rid = engine.add_request("stream-1", "the stop test", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                         stop=[stop]), stream_deltas=True)
    text, ids, finish = "", [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            text += o.outputs[0].text
            ids += o.outputs[0].token_ids
            finish = o.outputs[0].finish_reason or finish
    assert text == ref.text[:ref.text.find(stop)]
    assert ids == ref.token_ids[:len(ids)] and finish == "stop"
    check_no_blocks(engine)


def test_logprobs_consistent_with_prompt_logprobs(tiny_llm):
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    out = tiny_llm.generate("log probabilities", p, use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    for tok, lps in zip(c.token_ids, c.logprobs):
        assert lps[tok].rank == 1  # greedy picks the most likely token
        assert len(lps) == 3
        assert all(v.logprob <= 0 for v in lps.values())
        assert sum(math.exp(v.logprob) for v in lps.values()) <= 1.0 + 1e-5
    # the same tokens, fed back as a prompt, get the same log-probabilities
    ids = out.prompt_token_ids + c.token_ids
    again = tiny_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert again.prompt_logprobs[0] is None and len(again.prompt_logprobs) == len(ids)
    for i, tok in enumerate(c.token_ids):
        pos = len(out.prompt_token_ids) + i
        assert again.prompt_logprobs[pos][tok].logprob == pytest.approx(c.logprobs[i][tok].logprob, abs=1e-4)


def test_logprob_limits(tiny_llm):
    with pytest.raises(ValueError, match="logprobs.*max_logprobs=20"):
        tiny_llm.generate("x", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])



@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_come_from_the_prefill_forwards_in_bounded_slices(tiny_llm, monkeypatch, chunk):
    # Prompt logprobs add no forward: each prompt chunk's forward also gives its positions' logits, at
    # most prompt_logprobs_rows at a time, with one log-softmax / top-k per slice (none per position).
    import kvforge.rank.model_runner as model_runner
    import kvforge.rank.prompt_logits as prompt_logits

    engine = tiny_llm.llm_engine
    monkeypatch.setattr(prompt_logits, "PROMPT_LOGPROBS_SLICE_BYTES", engine.model_config.vocab_size * 12 * 7)
    if chunk is not None:  # the prompt runs in chunks of 16 tokens
        monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", chunk)
    model = engine.runner.model
    calls: dict = {}
    forward, compute_logits, logprob_tensors = model.forward, model.compute_logits, model_runner.logprob_tensors

    def counting_forward(*args, **kw):
        calls["forwards"] += 1
        return forward(*args, **kw)

    def counting_logits(hidden):
        calls["logits_rows"].append(len(hidden))
        return compute_logits(hidden)

    def counting_tensors(*args):
        calls["logprob_tensors"] += 1
        return logprob_tensors(*args)

    monkeypatch.setattr(model, "forward", counting_forward)
    monkeypatch.setattr(model, "compute_logits", counting_logits)
    monkeypatch.setattr(model_runner, "logprob_tensors", counting_tensors)

    def run(first: int, **kw) -> dict:
        calls.update(forwards=0, logits_rows=[], logprob_tensors=0)
        prompt = list(range(first, first + 50))  # not seen before: no prefix-cache hit for the plain request
        out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, **kw),
                                use_tqdm=False)[0]
        return dict(calls, out=out)

    base = 7000 + 200 * (chunk or 0)
    plain = run(base)
    asked = run(base + 100, prompt_logprobs=4)
    assert asked["forwards"] == plain["forwards"] == (3 if chunk is None else 4 + 2)
    assert len(asked["out"].prompt_logprobs) == 50
    # the LM head's extra calls are the prompt slices (each step computes them before its sampled rows)
    prompt_rows = asked["logits_rows"][:len(asked["logits_rows"]) - len(plain["logits_rows"])]
    assert asked["logits_rows"][len(prompt_rows):] == plain["logits_rows"]
    assert sum(prompt_rows) == 49  # positions 0 .. 48 predict tokens 1 .. 49
    # whole: 7 slices of 7; in chunks of 16, 16, 16, 2: slices of 7, 7, 2 for each full chunk, then 1
    assert prompt_rows == ([7] * 7 if chunk is None else [7, 7, 2] * 3 + [1])
    assert asked["logprob_tensors"] == len(prompt_rows)
