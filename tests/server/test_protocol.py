"""Request bodies as the engine gets them (``kvforge.server.protocol``) and tool plans (``server/tools.py``),
without a server: ``logit_bias`` keys, the prompts of a completion, the constraint and the field that asked."""
from __future__ import annotations

import pytest

from kvforge.server.protocol import ChatCompletionRequest, CompletionRequest, Constraint
from kvforge.server.tools import FunctionDef, ToolOptions, ToolPlan


def test_logit_bias_json_keys_become_token_ids_and_a_bad_key_is_named():
    params = CompletionRequest(prompt="x", logit_bias={"42": 100, " 7": -1.5}).sampling_params(4, None)
    assert params.logit_bias == {42: 100.0, 7: -1.5}
    with pytest.raises(ValueError, match="^logit_bias must map token ids to numbers$"):
        CompletionRequest(prompt="x", logit_bias={"a": 1}).sampling_params(4, None)


@pytest.mark.parametrize("prompt, prompts", [("hi", ["hi"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]),
                                             ([[1], [2, 3]], [[1], [2, 3]])])
def test_a_completion_s_prompts_are_one_engine_prompt_each(prompt, prompts):
    assert CompletionRequest(prompt=prompt).prompts() == prompts


def test_the_constraint_names_the_field_that_asked_for_it():
    ask = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=ask).structured() is None
    found = ChatCompletionRequest(messages=ask, guided_regex="a+").structured()
    assert isinstance(found, Constraint) and found.field == "guided_regex" and found.params.regex == "a+"
    found = ChatCompletionRequest(messages=ask, response_format={"type": "json_object"}).structured()
    assert found is not None and found.field == "response_format" and found.params.json == {"type": "object"}


def test_only_required_and_named_choices_constrain_and_only_auto_has_a_parser():
    fns = [FunctionDef(name="f", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})]
    options = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    named = ToolPlan.build(fns, "f", None, options)
    assert named.constraint() is not None and named.constraint().json == fns[0].parameters
    assert ToolPlan.build(fns, "required", None, options).constraint() is not None
    for choice in ("none", "auto"):
        assert ToolPlan.build(fns, choice, None, options).constraint() is None
    assert type(ToolPlan.build(fns, "auto", None, options).new_parser()).__name__ == "HermesToolParser"
    with pytest.raises(ValueError, match="'named' tool choice has no tool-call parser"):
        named.new_parser()
