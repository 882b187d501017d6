"""Structured outputs fail only their own request: a constraint that admits nothing, one that does not
compile in time, and the bounded cache of compiled constraints. Refusals say what is wrong in the
client's terms: no xgrammar clock or C++ source path, and a reference outside the schema named."""
from __future__ import annotations

import json
import re
import time

import pytest

from kvforge import LLM, SamplingParams
from kvforge.engine.structured_output import check_local_refs
from kvforge.sampling_params import StructuredOutputsParams as SO

#: ~0.7 s to compile on this machine: far over a 0.25 s limit (which a two-word choice meets even on a
#: busy machine: the suite runs on two workers)
SLOW_SCHEMA = {"enum": [f"value-{i}" for i in range(20000)]}


def test_a_schema_that_only_refers_to_itself_is_refused(tiny_llm, check_no_blocks):
    mgr = tiny_llm.llm_engine.structured_outputs
    with pytest.raises(ValueError, match="admits no output"):
        mgr.check(SO(json={"$ref": "#"}))
    out = tiny_llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=SO(json={"$ref": "#"})),
                            use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and out.error.status == 400
    check_no_blocks(tiny_llm.llm_engine)


def test_a_constraint_past_its_time_limit_fails_alone_and_later_ones_run(check_no_blocks):
    llm = LLM("dummy:tiny", device="cpu", max_model_len=128, num_gpu_blocks_override=64,
              grammar_compile_timeout=0.25)
    slow = SamplingParams(max_tokens=4, structured_outputs=SO(json=SLOW_SCHEMA))
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["a", "b"], [slow, plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].error.status == 400
    assert "longer than 0.25 s" in outs[0].error.message
    assert len(outs[1].outputs[0].token_ids) == 4
    # the same constraint now fails at once; a quick one compiles on a fresh thread and runs
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="longer than 0.25 s"):
        llm.llm_engine.structured_outputs.check(SO(json=SLOW_SCHEMA))
    assert time.monotonic() - t0 < 0.5
    quick = llm.generate("c", SamplingParams(temperature=0, max_tokens=20,
                                             structured_outputs=SO(choice=["yes", "no"])), use_tqdm=False)[0]
    assert quick.error is None and quick.outputs[0].text in ("yes", "no")
    check_no_blocks(llm.llm_engine)


def test_compiled_constraints_are_kept_in_a_bounded_cache():
    llm = LLM("dummy:tiny", device="cpu", max_model_len=64, num_gpu_blocks_override=32, grammar_cache_size=2)
    mgr = llm.llm_engine.structured_outputs
    for word in ("a", "b", "c", "d"):
        mgr.check(SO(choice=[word]))
    assert len(mgr._cache) == 2
    assert [json.loads(k[0]) if k[0] else k[2] for k in mgr._cache] == [("c",), ("d",)]


def test_xgrammar_errors_carry_no_clock_or_source_path(tiny_llm):
    mgr = tiny_llm.llm_engine.structured_outputs
    with pytest.raises(ValueError) as err:
        mgr.check(SO(json={"type": "bogus"}))
    assert str(err.value) == 'structured_outputs: invalid constraint: Unsupported type "bogus"'
    with pytest.raises(ValueError) as err:
        mgr.check(SO(regex="(["))
    assert str(err.value) == "structured_outputs: invalid constraint: Regex parsing error at position 3: Unclosed '['"


@pytest.mark.parametrize("schema, ref, where", [
    ({"$ref": "https://example.com/s.json"}, "https://example.com/s.json", "#"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "other.json#/x", "#/properties/a"),
    ({"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#anchor"}}]}, "#anchor", "#/anyOf/1/items"),
    ({"$defs": {"a/b": {"$ref": "s.json"}}, "$ref": "#/$defs/a~1b"}, "s.json", "#/$defs/a~1b"),
])
def test_a_reference_outside_the_schema_is_refused_wherever_it_is(tiny_llm, schema, ref, where):
    # xgrammar would compile each one to "any JSON" with only a warning in the log
    with pytest.raises(ValueError, match=re.escape(f"the $ref '{ref}' at {where} is not a pointer into the schema")):
        tiny_llm.llm_engine.structured_outputs.check(SO(json=json.dumps(schema)))


def test_local_references_and_ref_named_data_are_accepted(tiny_llm):
    mgr = tiny_llm.llm_engine.structured_outputs
    mgr.check(SO(json={"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}))
    # a property called "$ref", and "$ref" keys in data (const, default) are not references
    mgr.check(SO(json={"type": "object", "properties": {"$ref": {"type": "string"}},
                       "default": {"$ref": "https://example.com"}, "required": ["$ref"]}))


def test_the_reference_check_walks_any_depth_without_recursion():
    schema: dict = {"$ref": "s.json"}
    for _ in range(5_000):  # Python recurses 1,000 deep
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="'s.json' at #/items/items/"):
        check_local_refs(schema)
