"""``/v1/responses`` on the real server with the real default model, driven by the official ``openai``
client: greedy outputs equal chat's for the same conversation, streamed events are the client's own
types and assemble the non-streamed response, stored responses chain, refused fields say why."""
import asyncio
import base64
import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from conftest import API_KEY
from kvforge.errors import RequestFailedError, RequestFailure
from kvforge.server.response_store import ResponseStore
from kvforge.server.responses_api import _Turn
from kvforge.server.responses_protocol import MAX_UNRENDERED_ITEM_BYTES, RESPONSES_REFUSED, ResponsesRequest
from kvforge.server.tools import ToolOptions, ToolPlan
from kvforge.tool_parsing import get_reasoning_parser
from testing_support import doc_field_table

MODEL = "smol"
GREEDY = dict(model=MODEL, temperature=0)
STORY = "Tell me a story about a dragon."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
NAMED = {"type": "function", "name": "get_weather"}
EVENTS = TypeAdapter(ResponseStreamEvent)
DOC = Path(__file__).resolve().parents[2] / "docs" / "responses.md"


@pytest.fixture(scope="module")
def smol(smol_server):
    # conftest's shared default-model server (served as MODEL), with the tool and reasoning flags as a
    # deployment sets them: qwen3 finds no <think> in SmolLM2's output, so unconstrained text is all
    # content, as chat's is
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def story(smol):
    return smol.responses.create(input=STORY, max_output_tokens=8, **GREEDY)


def streamed(client, **kw):
    """The events of a streamed response (each checked against the client's event types) and the stream."""
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    for e in events:
        # the client builds them leniently: validate each one strictly (warnings: the client's own union quirks)
        EVENTS.validate_python(e.to_dict(warnings=False))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, stream


def test_text_equals_chat_greedy_with_usage(smol, story):
    chat = smol.chat.completions.create(messages=[{"role": "user", "content": STORY}], max_tokens=8, **GREEDY)
    assert chat.choices[0].finish_reason == "length"
    assert story.id.startswith("resp_") and story.object == "response" and story.model == MODEL
    assert story.output_text == chat.choices[0].message.content
    assert story.status == "incomplete" and story.incomplete_details.reason == "max_output_tokens"
    [message] = story.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.id.startswith("msg_")
    u = story.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert u.total_tokens == u.input_tokens + 8 and u.output_tokens_details.reasoning_tokens == 0
    assert (story.temperature, story.max_output_tokens, story.store, story.tools) == (0, 8, True, [])


def test_message_items_and_instructions_equal_chat_with_a_system_message(smol):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name "},
                                          {"type": "input_text", "text": "a colour."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue.",
                                                                   "annotations": []}]},
             {"role": "user", "content": "Another one?"}]
    r = smol.responses.create(input=items, instructions="Answer in one word.", max_output_tokens=6, **GREEDY)
    chat = smol.chat.completions.create(messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}], max_tokens=6, **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.instructions == "Answer in one word."


def test_json_schema_format_is_held(smol):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer"}},
              "required": ["colour", "count"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}
    r = smol.responses.create(input="Pick a colour and a count.", text={"format": fmt}, max_output_tokens=40, **GREEDY)
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"colour", "count"} and value["colour"] in schema["properties"]["colour"]["enum"]
    assert isinstance(value["count"], int) and r.text.format.type == "json_schema" and r.text.format.name == "pick"


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_function_calls_follow_the_schema_and_round_trip(smol, tokenizer, choice):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    r = smol.responses.create(input=[ask], tools=[WEATHER], tool_choice=choice, max_output_tokens=40, **GREEDY)
    assert r.status == "completed"
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "get_weather"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and isinstance(args["city"], str)
    # the result goes back after the call, as the client sends the output items it got
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    back = smol.responses.create(input=[ask, *r.output, result], tools=[WEATHER], tool_choice="none",
                                 max_output_tokens=8, **GREEDY)
    assert [o.type for o in back.output] == ["message"] and back.output_text
    conv = [ask, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    prompt = tokenizer.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True)
    assert back.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_streamed_text_assembles_the_non_streamed_response(smol):
    kw = dict(input="Say hello.", max_output_tokens=48, **GREEDY)
    whole = smol.responses.create(**kw)
    assert whole.status == "completed"  # it stops by itself: the accumulator needs response.completed
    events, stream = streamed(smol, **kw)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    final = stream.get_final_response()
    assert final.output_text == whole.output_text == "".join(e.delta for e in events[4:-4])
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == events[2].item.id and final.id == events[0].response.id


def test_streamed_incomplete_text_equals_non_streamed(smol, story):
    events, _ = streamed(smol, input=STORY, max_output_tokens=8, **GREEDY)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == story.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == story.output_text


def test_streamed_function_call_equals_non_streamed(smol):
    kw = dict(input="What is the weather in Paris?", tools=[WEATHER], tool_choice=NAMED, max_output_tokens=40,
              **GREEDY)
    whole = smol.responses.create(**kw)
    events, stream = streamed(smol, **kw)
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.arguments == ""
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [call] = stream.get_final_response().output
    assert call.type == "function_call" and call.arguments == whole.output[0].arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


def test_store_retrieve_and_previous_response_id(smol, story):
    assert smol.responses.retrieve(story.id).model_dump() == story.model_dump()
    unstored = smol.responses.create(input="Hi.", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError, match=unstored.id):
        smol.responses.retrieve(unstored.id)
    follow = smol.responses.create(input="Who is in it?", previous_response_id=story.id, max_output_tokens=6,
                                   **GREEDY)
    explicit = smol.responses.create(input=[{"role": "user", "content": STORY},
                                            {"role": "assistant", "content": story.output_text},
                                            {"role": "user", "content": "Who is in it?"}],
                                     max_output_tokens=6, **GREEDY)
    assert follow.output_text == explicit.output_text
    assert follow.usage.input_tokens == explicit.usage.input_tokens > story.usage.input_tokens
    assert follow.previous_response_id == story.id
    with pytest.raises(openai.BadRequestError, match="previous_response_id: .*resp_nope") as err:
        smol.responses.create(input="x", previous_response_id="resp_nope", max_output_tokens=2, **GREEDY)
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("field, value, says", [
    ("reasoning", {"effort": "high"}, "reasoning controls"),
    ("background", True, "background responses"),
    ("tools", [{"type": "web_search"}], "'web_search' tool"),
    ("include", ["message.output_text.logprobs"], "log probabilities are not returned"),
    ("truncation", "auto", "never drops input"),
    ("input", [{"type": "web_search_call", "id": "ws_1"}], "function_call_output"),
])
def test_refused_fields_name_themselves(smol, field, value, says):
    kw = {"input": "x"} | {field: value}
    with pytest.raises(openai.BadRequestError) as err:
        smol.responses.create(model=MODEL, extra_body=kw, max_output_tokens=2)
    assert err.value.body["param"].startswith(field) and says in err.value.message


def test_constrained_tool_choice_with_json_format_is_refused(smol):
    with pytest.raises(openai.BadRequestError, match="text.format"):
        smol.responses.create(input="x", tools=[WEATHER], tool_choice="required", max_output_tokens=2,
                              text={"format": {"type": "json_object"}}, **GREEDY)


def test_unknown_model_is_404(smol):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        smol.responses.create(model="nope", input="x")


# -- in-process: the output split (no model can be made to reason on demand) ------------------------
class _FakeServing:
    def tokenizer(self):
        return SimpleNamespace(encode=lambda text, add_special_tokens: text.split())


async def _outputs(pieces, finish, fail=None):
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        yield 0, SimpleNamespace(num_cached_tokens=0, prompt_token_ids=[], outputs=[SimpleNamespace(
            text=piece, token_ids=[0], finish_reason=finish if last and fail is None else None)])
    if fail is not None:
        raise fail


def _events(turn, pieces, finish, fail=None):
    async def collect():
        return [chunk async for chunk in turn.events(_outputs(pieces, finish, fail))]
    out = []
    for chunk in asyncio.run(collect()):
        kind, data = re.fullmatch(r"event: (\S+)\ndata: (.*)\n\n", chunk, re.S).groups()
        event = json.loads(data)
        assert event["type"] == kind
        out.append(EVENTS.validate_python(event))
    return out


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_reasoning_and_auto_calls_stream_what_the_whole_output_holds(cut):
    text = ('<think>It is about weather.</think>Let me look.<tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "c"}}</tool_call>')
    req = ResponsesRequest(input="x", tools=[WEATHER])
    plan = ToolPlan.build(req.tools, None, None, ToolOptions(True, "hermes"))
    turn = _Turn(req, MODEL, plan, get_reasoning_parser("qwen3"), 3, [], ResponseStore(), _FakeServing())
    whole, reasoning = turn.whole_output(text, "stop")
    assert reasoning == "It is about weather."
    assert [o["type"] for o in whole] == ["reasoning", "message", "function_call"]
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    events = _events(turn, pieces, "stop")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.usage.output_tokens_details.reasoning_tokens == 4
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == reasoning and final.output_text == whole[1]["content"][0]["text"]
    assert (final.output[2].name, final.output[2].arguments) == (whole[2]["name"], whole[2]["arguments"])
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning


def test_included_encrypted_reasoning_is_the_reasoning_whole_or_streamed_and_can_be_sent_back():
    """LiteLLM sends include=["reasoning.encrypted_content"] to keep reasoning across stateless turns."""
    text = "<think>It is about weather.</think>Sunny."
    req = ResponsesRequest(input="x", include=["reasoning.encrypted_content", "file_search_call.results"],
                           store=False)
    turn = _Turn(req, MODEL, ToolPlan("none"), get_reasoning_parser("qwen3"), 3, [], ResponseStore(), _FakeServing())
    whole, reasoning = turn.whole_output(text, "stop")
    final = _events(turn, [text[i:i + 4] for i in range(0, len(text), 4)], "stop")[-1].response
    for item in (whole[0], final.output[0].model_dump()):
        assert base64.b64decode(item["encrypted_content"]).decode() == reasoning == "It is about weather."
    again = ResponsesRequest(input=[final.output[0].model_dump(exclude_none=True), {"role": "user", "content": "y"}])
    assert again.items()[0].encrypted_content == whole[0]["encrypted_content"]
    plain = _Turn(ResponsesRequest(input="x"), MODEL, ToolPlan("none"), get_reasoning_parser("qwen3"), 3, [],
                  ResponseStore(), _FakeServing())
    assert "encrypted_content" not in plain.whole_output(text, "stop")[0][0]


def test_a_failure_mid_stream_ends_with_response_failed_and_is_stored_without_output():
    req = ResponsesRequest(input="x")
    store = ResponseStore()
    turn = _Turn(req, MODEL, ToolPlan("none"), None, 3, req.items(), store, _FakeServing())
    failure = RequestFailedError(RequestFailure("structured_outputs: the grammar failed", 400))
    events = _events(turn, ["Hello", " wor"], None, fail=failure)
    assert [e.type for e in events[-3:]] == ["response.output_text.delta", "response.output_text.delta",
                                             "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "invalid_prompt"
    assert failed.error.message == "structured_outputs: the grammar failed" and failed.output[0].type == "message"
    assert store.get(turn.id).body["status"] == "failed" and store.get(turn.id).items == req.items()


def test_a_named_call_cut_short_streams_incomplete_and_is_not_replayed():
    req = ResponsesRequest(input="x", tools=[WEATHER], tool_choice=NAMED)
    store = ResponseStore()
    plan = ToolPlan.build(req.tools, "get_weather", None, ToolOptions())
    turn = _Turn(req, MODEL, plan, None, 3, req.items(), store, _FakeServing())
    events = _events(turn, ['{"city": ', '"Par'], "length")
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.output[0].status == "incomplete"
    assert final.output[0].arguments == '{"city": "Par'
    assert store.get(turn.id).items == req.items()  # the cut call cannot be sent back


# -- over the tiny server (conftest's): what a client sends that is kept but not rendered is bounded ----
def test_an_unrendered_item_over_its_limit_is_a_400_naming_input_and_one_under_it_is_kept(server):
    def create(text):
        item = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
        return httpx.post(f"{server.url}/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                          json={"model": "tiny", "input": [item, {"role": "user", "content": "hi"}],
                                "max_output_tokens": 2})
    r = create("r" * 2 * 2**20)  # 2 MiB that cost no token (issue 34's were 12 MiB for 32 prompt tokens)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    said = re.search(r"item 0 \(reasoning\) carries (\d+) bytes .* at most (\d+) ", r.json()["error"]["message"])
    assert int(said[1]) > 2 * 2**20 and int(said[2]) == MAX_UNRENDERED_ITEM_BYTES
    r = create("r" * 1000)
    assert r.status_code == 200, r.text
    kept = httpx.get(f"{server.url}/v1/responses/{r.json()['id']}", headers={"Authorization": f"Bearer {API_KEY}"})
    assert kept.json() == r.json()


def test_docs_list_the_honoured_and_refused_fields():
    def table(marker):
        return doc_field_table(DOC, marker)

    fields = set(ResponsesRequest.model_fields)
    assert table("responses-refused") == list(RESPONSES_REFUSED)
    honoured = table("responses-honoured")
    assert len(honoured) == len(set(honoured)) and set(honoured) == fields - set(RESPONSES_REFUSED)
