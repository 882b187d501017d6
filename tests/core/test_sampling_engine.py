"""Issue-4 features through the engine: shared blocks for n > 1, logits-processor plugins,
bad words, structured outputs (tiny random Llama; the real model for the JSON schema)."""
import json
import re
from dataclasses import dataclass

import pytest
import torch

import kvforge
from kvforge import LLM, SamplingParams
from kvforge.plugin_manager import get_plugin_manager
from kvforge.sampler import LogitsProcessor


def test_n4_holds_the_prompt_blocks_once(tiny_llm, check_no_blocks):
    engine = tiny_llm.llm_engine
    prompt = list(range(100, 140))  # 40 tokens: 3 blocks of 16, the last one partial
    engine.add_request("fan", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    outs = engine.step()  # prefill once, then 4 first tokens
    assert len(outs) == 1 and len(outs[0].outputs) == 4
    kv = engine.kv_cache
    assert kv.stats().num_used_blocks == 3
    tables = [kv.block_table(f"fan#{i}") for i in range(4)]
    assert all(t == tables[0] for t in tables)
    assert all(kv.ref_count(b) == 4 for b in tables[0])
    last = outs[0]
    while engine.has_unfinished_requests():
        for o in engine.step():
            last = o  # cumulative outputs: the last one holds every sample's tokens
    assert last.finished
    final = {c.index: c.token_ids for c in last.outputs}
    assert all(len(v) == 6 for v in final.values())
    assert len({tuple(v) for v in final.values()}) > 1  # the samples differ
    assert kv.stats().num_cow_copies >= 3  # each writer copied the shared partial block
    check_no_blocks(engine)


class ForceToken(LogitsProcessor):
    """Forces the token named in extra_args['force'] (a whole-row operation, no per-token loop)."""

    def apply(self, logits, requests):
        target = torch.tensor([r.sampling_params.extra_args["force"] for r in requests], device=logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[torch.arange(len(requests)), target] = 0.0
        return out


def test_logits_processor_plugin(tiny_llm):
    class Plugin:
        @kvforge.hookimpl
        def register_logits_processors(self, register):
            register("force", ForceToken)

    pm = tiny_llm.llm_engine.plugin_manager  # the manager this engine was built with
    pm.register(Plugin(), "force-plugin")
    try:
        outs = tiny_llm.generate(["a", "b"], [
            SamplingParams(max_tokens=4, ignore_eos=True, logits_processors=["force"], extra_args={"force": 42}),
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == [42] * 4
        assert outs[1].outputs[0].token_ids != [42] * 4
        with pytest.raises(ValueError, match="logits_processors: unknown logits processor 'nope'.*force"):
            tiny_llm.generate("a", SamplingParams(logits_processors=["nope"]), use_tqdm=False)
    finally:
        pm.unregister("force-plugin")


@dataclass
class ScaleOptions:
    factor: float = 1.0


class Scale(LogitsProcessor):
    """Multiplies its rows by its ``[plugins.scale] factor``; records how it was built and called."""

    Options = ScaleOptions
    built: list[dict] = []
    calls: list[tuple] = []

    def __init__(self, *, factor: float, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor
        type(self).built.append(dict(kwargs, factor=factor))

    def apply(self, logits, requests):
        type(self).calls.append((tuple(logits.shape), logits.dtype, logits.device, [r.request_id for r in requests]))
        return logits * self.factor


def test_logits_processor_is_built_once_with_vocab_size_device_and_its_plugin_options():
    class Plugin:
        @kvforge.hookimpl
        def register_logits_processors(self, register):
            register("scale", Scale)

    pm = get_plugin_manager()  # the process-wide manager a new engine is built with
    pm.register(Plugin(), "scale-plugin")
    Scale.built.clear()
    Scale.calls.clear()
    try:
        llm = LLM("dummy:tiny", max_model_len=128, num_gpu_blocks_override=64, device="cpu",
                  plugins={"scale": {"factor": 0.5}})
        assert Scale.built == []  # built on first use, not with the engine
        p = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
        scaled = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0, logits_processors=["scale"])
        engine = llm.llm_engine
        for _ in range(2):
            engine.add_request("plain", [1, 2, 3], p)
            engine.add_request("scaled", [4, 5, 6], scaled)
            while engine.has_unfinished_requests():
                engine.step()
        vocab = engine.model_config.vocab_size
        assert Scale.built == [{"vocab_size": vocab, "device": torch.device("cpu"), "factor": 0.5}]
        # one call per step that samples a request naming it; only that request's row, float32
        assert len(Scale.calls) == 6
        assert all(c == ((1, vocab), torch.float32, torch.device("cpu"), ["scaled"]) for c in Scale.calls)
    finally:
        pm.unregister("scale-plugin")


def test_bad_words_and_allowed_tokens(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = tiny_llm.generate("bad words", p, use_tqdm=False)[0].outputs[0]
    word = tok.decode(ref.token_ids[:1]).strip()
    assert word
    banned = tiny_llm.generate("bad words", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                           bad_words=[word]), use_tqdm=False)[0].outputs[0]
    forms = {tuple(tok.encode(w, add_special_tokens=False)) for w in (word, " " + word)}
    single = {f[0] for f in forms if len(f) == 1}
    assert single and not single & set(banned.token_ids)
    assert banned.token_ids[0] != ref.token_ids[0]
    allowed = tiny_llm.generate("x", SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=[11, 12, 13]),
                                use_tqdm=False)[0].outputs[0]
    assert set(allowed.token_ids) <= {11, 12, 13}


def test_regex_and_choice_constraints(tiny_llm):
    from kvforge.sampling_params import StructuredOutputsParams as SO

    outs = tiny_llm.generate(["code:", "code 2:"], SamplingParams(temperature=1.0, seed=4, max_tokens=20,
                                                                  structured_outputs=SO(regex=r"[a-c]{3}-[0-9]{2}")),
                             use_tqdm=False)
    for o in outs:
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", o.outputs[0].text), o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop"
    choices = ["yes", "no", "maybe later"]
    for seed in range(5):
        o = tiny_llm.generate("answer:", SamplingParams(seed=seed, max_tokens=10, structured_outputs=SO(choice=choices)),
                              use_tqdm=False)[0]
        assert o.outputs[0].text in choices


def test_invalid_constraint_ends_the_request(tiny_llm, check_no_blocks):
    from kvforge.sampling_params import StructuredOutputsParams as SO

    res = tiny_llm.generate("x", SamplingParams(max_tokens=5, structured_outputs=SO(json="{not json")),
                            use_tqdm=False)[0]
    assert res.outputs[0].finish_reason == "error" and res.outputs[0].token_ids == []
    assert res.error.status == 400 and res.error.message.startswith("structured_outputs: invalid constraint")
    check_no_blocks(tiny_llm.llm_engine)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pet": {"enum": ["cat", "dog", "fish"]}},
    "required": ["name", "age", "pet"], "additionalProperties": False}


def _valid(obj):
    return (set(obj) == {"name", "age", "pet"} and isinstance(obj["name"], str) and len(obj["name"]) <= 10
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 150 and obj["pet"] in ("cat", "dog", "fish"))


@pytest.mark.slow
def test_json_schema_samples_all_validate(default_llm):
    from kvforge.sampling_params import StructuredOutputsParams as SO

    llm = default_llm  # (seeded samples: what they are depends on the seeds, not on the engine's pool)
    msgs = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(20)]
    outs = llm.chat(msgs, [SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs=SO(json=SCHEMA))
                           for i in range(20)], use_tqdm=False)
    parsed = [json.loads(o.outputs[0].text) for o in outs]
    assert all(_valid(p) for p in parsed), parsed
    assert len({json.dumps(p, sort_keys=True) for p in parsed}) > 1
