"""What clients send unchanged (issue 38): the SDK's own reply echoed back in a chat loop, current OpenAI
fields that cannot change this server's output, vLLM's continuous usage stats, OpenAI's JSON mode (an
object), a model retrieved by id, and clear 404s and 400s for unknown routes and image parts. Against the
tiny session server with the official openai client."""
from __future__ import annotations

import json

import openai
import pytest

from conftest import API_KEY, http

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
