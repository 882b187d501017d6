"""Engine behaviour on the tiny random Llama: validation, aborts, block accounting, ordering."""
import pytest

from kvforge import LLM, SamplingParams


def test_outputs_in_input_order_and_lengths(tiny_llm, check_no_blocks):
    prompts = ["a b c", [5, 6, 7, 8, 9, 10], "hello world, this is a longer prompt than the others"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 5]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8, 9, 10] and outs[1].prompt is None
    assert outs[0].prompt == "a b c"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    tok = tiny_llm.get_tokenizer()
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    check_no_blocks(tiny_llm.llm_engine)


def test_batched_greedy_equals_one_at_a_time(tiny_llm):
    prompts = ["one two three", "four five", "six seven eight nine ten eleven twelve"]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, p, use_tqdm=False)]
    alone = [tiny_llm.generate(x, p, use_tqdm=False)[0].outputs[0].token_ids for x in prompts]
    assert together == alone


def test_stop_token_ids(tiny_llm):
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = tiny_llm.generate("stop here", p, use_tqdm=False)[0].outputs[0].token_ids
    stop = ref[3]
    first = ref.index(stop)
    out = tiny_llm.generate("stop here", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                        stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_seeded_sampling_reproducible(tiny_llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    a = tiny_llm.generate("x y z", p, use_tqdm=False)[0].outputs[0].token_ids
    b = tiny_llm.generate(["other", "x y z", "more"], [SamplingParams(max_tokens=5), p, SamplingParams()],
                          use_tqdm=False)[1].outputs[0].token_ids
    assert a == b


def test_abort_returns_blocks(tiny_llm, check_no_blocks):
    engine = tiny_llm.llm_engine
    for i in range(4):
        engine.add_request(f"abort-{i}", "some prompt text to fill a block or two",
                           SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.stats().num_used_blocks > 0
    engine.abort_request([f"abort-{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    check_no_blocks(engine)


@pytest.mark.parametrize("prompt,params,field", [
    ("", None, "prompt"),
    ([], None, "prompt"),
    ("x " * 600, None, "prompt"),
    ([10 ** 9], None, "prompt"),
    ("ok", dict(max_tokens=0), "max_tokens"),
    ("ok", dict(temperature=-0.5), "temperature"),
    ("ok", dict(top_p=0.0), "top_p"),
    ("ok", dict(top_p=1.5), "top_p"),
    ("ok", dict(top_k=-3), "top_k"),
    ("ok", dict(min_p=2.0), "min_p"),
])
def test_bad_input_is_a_value_error_naming_the_field(tiny_llm, check_no_blocks, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        tiny_llm.generate(prompt, SamplingParams(**params) if params else None, use_tqdm=False)
    check_no_blocks(tiny_llm.llm_engine)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    # the engine still serves the next request
    assert len(tiny_llm.generate("fine", SamplingParams(max_tokens=2, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_bad_request_in_a_batch_adds_nothing(tiny_llm):
    with pytest.raises(ValueError, match="prompt"):
        tiny_llm.generate(["good", ""], use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_unknown_model_path():
    with pytest.raises(ValueError, match="model"):
        LLM("/no/such/model/dir")


def test_bad_engine_options():
    with pytest.raises(ValueError, match="block_size"):
        LLM("dummy:tiny", block_size=0)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM("dummy:tiny", no_such_option=1)
    with pytest.raises(ValueError, match="unknown attention_backend 'nope'.*torch"):
        LLM("dummy:tiny", attention_backend="nope", device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM("dummy:tiny", max_model_len=10 ** 6, device="cpu")


def test_chat_uses_the_template(tiny_llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = tiny_llm.chat(msgs, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tiny_llm.get_tokenizer().encode(out.prompt)
    with pytest.raises(ValueError, match="messages"):
        tiny_llm.chat([{"content": "no role"}], use_tqdm=False)
