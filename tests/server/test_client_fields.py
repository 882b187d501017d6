"""What clients send unchanged (issue 38): the SDK's own reply echoed back in a chat loop, current OpenAI
fields that cannot change this server's output, vLLM's continuous usage stats, OpenAI's JSON mode (an
object), a model retrieved by id, and clear 404s and 400s for unknown routes and image parts. Against the
tiny session server with the official openai client."""
from __future__ import annotations

import json

import openai
import pytest

from conftest import API_KEY, http, metric_by_label, wait_until

ASK = [{"role": "user", "content": "Tell me a joke about cats as JSON with keys setup and punchline"}]


def test_a_chat_loop_that_sends_the_sdk_reply_back_gets_an_answer(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
    echoed = first.choices[0].message.model_dump()
    assert {"annotations", "audio", "function_call", "refusal"} <= echoed.keys()  # what the SDK puts there
    again = client.chat.completions.create(model="tiny", messages=[*ASK, echoed, {"role": "user", "content": "More"}],
                                           max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 4


def test_annotations_on_a_user_message_are_a_400_naming_them(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[ASK[0] | {"annotations": [{"type": "url_citation"}]}],
                                       max_tokens=2)
    assert "annotations belongs to assistant messages" in str(err.value)


def test_fields_without_effect_are_accepted_and_change_nothing(client):
    common = dict(model="tiny", messages=ASK, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**common)
    extra = client.chat.completions.create(**common, safety_identifier="user-7", prompt_cache_key="session-3",
                                           metadata={"team": "a"}, store=True, service_tier="auto", verbosity="low")
    assert extra.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt="Once", max_tokens=3, temperature=0,
                                           extra_body={"safety_identifier": "u", "prompt_cache_key": "k"})
    assert completion.usage.completion_tokens >= 1


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}
    common = dict(model="tiny", max_tokens=6, temperature=0, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=ASK, **common))
    else:
        chunks = list(client.completions.create(prompt="Once upon", **common))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and len({c.usage.prompt_tokens for c in chunks}) == 1


def test_json_mode_gives_an_object_even_where_the_model_prefers_an_array(client, tokenizer):
    """A bias of +100 on "[" makes the model open an array whenever the grammar lets it: JSON mode must not."""
    bracket = tokenizer.encode("[", add_special_tokens=False)
    assert len(bracket) == 1
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"}, logit_bias={str(bracket[0]): 100})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404(client):
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]


def test_an_unknown_route_is_an_openai_shaped_404_naming_it(server):
    r = http().get(f"{server.url}/v1/nothing/here", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "not_found" and "GET /v1/nothing/here: no such route" in error["message"]


def test_an_image_part_is_a_400_saying_the_model_takes_no_images(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert "this model takes no images" in str(err.value)


def test_responses_take_what_guidellm_sends_and_honour_stop_and_ignore_eos(client):
    common = dict(model="tiny", input="Once upon a time", temperature=0, max_output_tokens=12)
    full = client.responses.create(**common, service_tier="auto", prompt_cache_key="k",
                                   extra_body={"stop": None, "ignore_eos": True})
    assert full.usage.output_tokens == 12, full
    text = full.output_text
    cut = text[len(text) // 2:len(text) // 2 + 2]  # (the tiny model's text: whatever it is, greedy)
    stopped = client.responses.create(**common, extra_body={"stop": [cut], "ignore_eos": True})
    assert cut not in stopped.output_text and text.startswith(stopped.output_text)
    assert stopped.usage.output_tokens < 12


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}])
def test_audio_and_file_parts_are_a_400_naming_what_the_model_does_not_take(client, part):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [part]}])
    assert f"an {part['type']} part, but this model takes no" in str(err.value)
    assert err.value.body["param"] == "messages.0.content"


def test_current_openai_fields_are_accepted_or_refused_by_name(client):
    """openai 3.x's newest chat fields: cache options and breakpoints without effect, moderation refused."""
    common = dict(model="tiny", max_tokens=4, temperature=0)
    plain = client.chat.completions.create(messages=ASK, **common)
    parts = [{"type": "text", "text": ASK[0]["content"], "prompt_cache_breakpoint": {"type": "ephemeral"}}]
    cached = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **common,
                                            extra_body={"prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
                                                        "prompt_cache_retention": "24h"})
    assert cached.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=ASK, **common, extra_body={"moderation": {"model": "omni"}})
    assert err.value.body["param"] == "moderation" and "moderation" in err.value.body["message"]


def test_a_field_outside_the_api_is_answered_as_if_absent_logged_and_counted(server, client):
    """vLLM's rule: accepted with a warning; kvforge also counts it by its path without list indices."""
    def ignored() -> dict[str, float]:
        return metric_by_label(server, "kvforge:ignored_request_fields_total", "field")

    before = ignored()
    common = dict(model="tiny", max_tokens=4, temperature=0)
    plain = client.chat.completions.create(messages=ASK, **common)
    odd = client.chat.completions.create(messages=[ASK[0] | {"mood": "sunny"}], **common,
                                         extra_body={"max_token": 99, "stream_options": None})
    assert odd.choices[0].message.content == plain.choices[0].message.content
    assert odd.usage.completion_tokens == plain.usage.completion_tokens  # max_token (a typo) changed nothing
    after = ignored()
    for field in ("max_token", "messages.mood"):
        assert after.get(field, 0) == before.get(field, 0) + 1, (field, before, after)
    assert wait_until(lambda: any("fields outside the API ignored" in line and "max_token, messages.0.mood" in line
                                  for line in list(server.log)), 5)


def test_strict_request_fields_make_a_field_outside_the_api_a_400_naming_it(tiny_llm):
    from fastapi.testclient import TestClient

    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.server.app import create_app

    app = create_app(AsyncLLMEngine(tiny_llm.llm_engine), ["tiny"], strict_request_fields=True)
    with TestClient(app) as c:
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "mood": 1}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.mood"
        assert "messages.0.mood: unknown field" in r.json()["error"]["message"]
        r = c.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "text", "colour": "red"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.colour"
        assert "kvforge:ignored_request_fields_total{" not in c.get("/metrics").text


def test_responses_list_their_input_items_in_pages_and_are_deleted(client):
    common = dict(model="tiny", temperature=0, max_output_tokens=3)
    first = client.responses.create(input=[{"role": "user", "content": "Say hi."}], **common)
    second = client.responses.create(input="And again.", previous_response_id=first.id, **common)
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in listed.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert listed.data[1].id == first.output[0].id  # the earlier output, as it was returned
    assert [p.text for p in listed.data[2].content] == ["And again."] and listed.has_more is False
    newest = client.responses.input_items.list(second.id)  # desc by default
    assert [i.id for i in newest.data] == [i.id for i in reversed(listed.data)]
    page = client.responses.input_items.list(second.id, order="asc", limit=2)
    rest = client.responses.input_items.list(second.id, order="asc", limit=2, after=page.last_id)
    assert page.has_more and not rest.has_more
    assert [i.id for i in page.data + rest.data] == [i.id for i in listed.data]  # ids are stable between calls
    client.responses.delete(second.id)
    for gone in (lambda: client.responses.retrieve(second.id), lambda: client.responses.delete(second.id),
                 lambda: client.responses.input_items.list(second.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    assert client.responses.retrieve(first.id).id == first.id  # its chain's earlier turn is kept
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(first.id, limit=0)
    assert err.value.body["param"] == "limit"


CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_cut_by_max_tokens_is_a_tool_call_with_finish_length_streamed_or_not(client, choice):
    """LangChain's function-calling structured output reads tool_calls: a cut call must not turn into content."""
    common = dict(model="tiny", messages=ASK, tools=[CITY], tool_choice=choice, temperature=0)
    whole = client.chat.completions.create(max_tokens=64, **common)
    n = whole.usage.completion_tokens
    cut = client.chat.completions.create(max_tokens=n - 1, **common)
    msg = cut.choices[0].message
    assert cut.choices[0].finish_reason == "length" and msg.content is None, msg
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"] and msg.tool_calls[0].function.arguments
    if isinstance(choice, dict):  # named: the output is the arguments themselves, cut one token short
        assert whole.choices[0].message.tool_calls[0].function.arguments.startswith(msg.tool_calls[0].function.arguments)
    chunks = list(client.chat.completions.create(max_tokens=n - 1, stream=True, **common))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert "".join(d.function.name or "" for d in deltas) == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == msg.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
