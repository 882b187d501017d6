"""``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API) driven by the official
``anthropic`` client: on conftest's shared default-model server, greedy answers equal chat's for the same
conversation, streamed events come in Anthropic's order and assemble the whole message, tools round trip,
stop sequences and max_tokens say why the answer stopped; on the shared tiny server, the API key is taken
from ``x-api-key`` too; in process, the thinking / text / tool_use split streams what a whole output holds.

The client has no ``temperature`` argument any more (Anthropic dropped the sampling fields from its
types): greedy requests send it in ``extra_body``, as older clients send it as a field; ``thinking`` goes
there too, for the clients from before it.
"""
import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from conftest import API_KEY
from kvforge.errors import RequestFailedError, RequestFailure
from kvforge.server.anthropic_api import _Reply
from kvforge.server.anthropic_protocol import (
    ANTHROPIC_REFUSED,
    ANTHROPIC_WITHOUT_EFFECT,
    CountTokensRequest,
    MessagesRequest,
)
from kvforge.server.errors import error_body, error_event
from kvforge.server.request_id import RequestInfo, _current
from kvforge.server.tools import FunctionDef, ToolOptions, ToolPlan
from kvforge.tool_parsing import get_reasoning_parser
from testing_support import doc_field_table

MODEL = "smol"
GREEDY = {"temperature": 0}
STORY = "Tell me a story about a dragon."
WEATHER = {"name": "get_weather", "description": "The current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
EVENTS = TypeAdapter(RawMessageStreamEvent)
DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"


@pytest.fixture(scope="module")
def claude(smol_server):
    # conftest's shared default-model server, served as MODEL, with hermes tool calls and the qwen3 reasoning
    # parser (which finds no <think> in SmolLM2's output: its text is all answer)
    return anthropic.Anthropic(base_url=smol_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(smol_server):
    return openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def story(claude):
    return claude.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": STORY}],
                                  extra_body=GREEDY)


def sse(url: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A stream's events as they are on the wire: (the ``event:`` name, the ``data:`` JSON)."""
    r = httpx.post(f"{url}/v1/messages", json=body | {"stream": True}, headers=headers or {}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for chunk in r.text.strip().split("\n\n"):
        name, data = re.fullmatch(r"event: (\S+)\ndata: (.*)", chunk, re.S).groups()
        events.append((name, json.loads(data)))
    return events


def test_system_blocks_and_turns_give_chat_s_greedy_answer(claude, chat):
    system = [{"type": "text", "text": "Answer in one "}, {"type": "text", "text": "word.", "cache_control": {
        "type": "ephemeral"}}]
    turns = [{"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a colour."}]},
             {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
    r = claude.messages.create(model=MODEL, max_tokens=6, system=system, messages=turns, extra_body=GREEDY)
    c = chat.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}])
    assert r.id.startswith("msg_") and (r.type, r.role, r.model) == ("message", "assistant", MODEL)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c.choices[0].finish_reason]


def test_max_tokens_is_the_stop_reason_and_the_output_tokens(story, chat):
    c = chat.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                     messages=[{"role": "user", "content": STORY}])
    assert (story.stop_reason, story.stop_sequence, story.usage.output_tokens) == ("max_tokens", None, 12)
    assert story.content[0].text == c.choices[0].message.content and c.choices[0].finish_reason == "length"


def test_stream_events_come_in_order_and_assemble_the_whole_message(claude, smol_server, story):
    body = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": STORY}], **GREEDY}
    events = sse(smol_server.url, body)
    for name, data in events:
        assert data["type"] == name
        EVENTS.validate_python(data)  # the client's own event types, strictly
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * (len(names) - 5),
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] == story.usage.input_tokens
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert {(d["index"], d["delta"]["type"]) for d in deltas} == {(0, "text_delta")}
    assert "".join(d["delta"]["text"] for d in deltas) == story.content[0].text
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 12
    # the client's accumulator builds the same message from them
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": STORY}],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == story.content[0].text and final.usage.output_tokens == 12


def test_a_stop_sequence_stops_the_text_before_it_and_is_named(claude, smol_server, story):
    text = story.content[0].text
    # a 3-character piece of the answer, first met well inside it
    at = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[at:at + 3]
    body = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": STORY}]}
    r = claude.messages.create(stop_sequences=["<never>", stop], extra_body=GREEDY, **body)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == text[:at] and r.usage.output_tokens < 12
    streamed = sse(smol_server.url, body | GREEDY | {"stop_sequences": [stop]})
    assert streamed[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_tool_use_follows_the_schema_and_its_result_round_trips(claude, chat, tokenizer, choice):
    r = claude.messages.create(model=MODEL, max_tokens=64, messages=[ASK], tools=[WEATHER], tool_choice=choice,
                               extra_body=GREEDY)
    assert r.stop_reason == "tool_use"
    [call] = r.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input, dict) and set(call.input) == {"city", "unit"}
    assert call.input["city"] in ("Paris", "London", "Tokyo") and call.input["unit"] in ("celsius", "fahrenheit")
    # the client sends the tool_use back as it got it, then the result in a user turn
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "22 degrees"}]}
    back = claude.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"},
                                  messages=[ASK, {"role": "assistant", "content": r.content},
                                            {"role": "user", "content": [result]}], extra_body=GREEDY)
    conv = [ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.input}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"}]
    prompt = tokenizer.apply_chat_template(conv, tools=[CHAT_WEATHER], tokenize=False, add_generation_prompt=True)
    assert back.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert "tool\n22 degrees" in prompt  # SmolLM2's template renders the result as a tool turn
    conv[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(call.input)  # chat's wire form
    c = chat.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=conv, tools=[CHAT_WEATHER],
                                     tool_choice="none")
    assert [b.type for b in back.content] == ["text"] and back.content[0].text == c.choices[0].message.content


def test_a_streamed_tool_use_equals_the_whole_one(claude, smol_server):
    body = {"model": MODEL, "max_tokens": 64, "messages": [ASK], "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY}
    whole = claude.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
    events = sse(smol_server.url, body)
    assert [n for n, _ in events[:2]] == ["message_start", "content_block_start"]
    block = events[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in deltas)) == whole.content[0].input
    assert [n for n, _ in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_tool_use_cut_by_max_tokens_is_still_a_tool_use_whole_or_streamed(claude, choice):
    """Cut inside its input: a tool_use block with stop_reason max_tokens, never the JSON text as a text block."""
    full = claude.messages.create(model=MODEL, max_tokens=64, messages=[ASK], tools=[WEATHER], tool_choice=choice,
                                  extra_body=GREEDY)
    common = dict(model=MODEL, max_tokens=full.usage.output_tokens // 2, messages=[ASK], tools=[WEATHER],
                  tool_choice=choice, extra_body=GREEDY)
    cut = claude.messages.create(**common)
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["tool_use"]
    assert cut.content[0].name == "get_weather" and cut.content[0].input != full.content[0].input
    assert set(cut.content[0].input) <= set(full.content[0].input)  # as much as was written
    with claude.messages.stream(**common) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens" and [b.type for b in streamed.content] == ["tool_use"]
    assert streamed.content[0].input == cut.content[0].input  # the client's partial parse of the deltas


def test_count_tokens_is_the_input_tokens_of_the_same_request(claude, tokenizer):
    kw = dict(model=MODEL, system="Be brief.", messages=[ASK], tools=[WEATHER])
    counted = claude.messages.count_tokens(**kw).input_tokens
    r = claude.messages.create(max_tokens=2, tool_choice={"type": "none"}, extra_body=GREEDY, **kw)
    assert counted == r.usage.input_tokens
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, ASK], tools=[CHAT_WEATHER],
                                           tokenize=False, add_generation_prompt=True)
    assert counted == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_a_final_assistant_message_is_continued(claude, chat, tokenizer):
    prefill = "The capital of France is"
    messages = [{"role": "user", "content": "Name the capital of France."}, {"role": "assistant", "content": prefill}]
    r = claude.messages.create(model=MODEL, max_tokens=6, messages=messages, extra_body=GREEDY)
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) + prefill
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    c = chat.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r.content[0].text == c.choices[0].text and r.usage.input_tokens == len(ids)
    assert claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens == len(ids)


def test_thinking_on_a_model_that_does_not_think_changes_nothing(claude, story):
    r = claude.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": STORY}],
                               extra_body=GREEDY | {"thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == story.content[0].text


@pytest.mark.parametrize("body, field, says", [
    ({"max_tokens": None}, "max_tokens", "field required"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result", "source": "x"}]}]}, "messages.0.content.0",
     "must be text, image, tool_use, tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}]},
     "messages.0.content", "this model takes no images"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0", "user messages take text, image, tool_result blocks"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]}, "tools.0.type", "server tool"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice", "not one of the tools"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type", "'enabled', 'adaptive' or 'disabled'"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "tools": [WEATHER], "tool_choice": {"type": "any"}},
     "thinking", "cannot think first"),
    ({"container": "container_1"}, "container", "containers are not supported"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers", "MCP"),
    ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
])
def test_a_bad_request_is_an_anthropic_400_naming_the_field(claude, body, field, says):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]} | body
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.post("/v1/messages", cast_to=object, body={k: v for k, v in body.items() if v is not None})
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert set(err.value.body) == {"type", "error"} and set(err.value.body["error"]) == {"type", "message"}
    message = err.value.body["error"]["message"]
    assert message.startswith(f"{field}: ") and says in message, message


def test_an_unknown_model_or_route_is_an_anthropic_404(claude, smol_server):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-nope", max_tokens=2, messages=[ASK])
    assert err.value.body == {"type": "error", "error": {"type": "not_found_error", "message":
                                                         f"The model `claude-nope` does not exist. Served models: {MODEL}."}}
    r = httpx.post(f"{smol_server.url}/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "error" in httpx.post(f"{smol_server.url}/v1/nothing", json={}).json()  # elsewhere: OpenAI's shape


# -- the tiny server (conftest's): it takes an API key, and runs no reasoning parser --------------------------
def test_the_api_key_is_taken_from_x_api_key_or_a_bearer_token(server):
    hi = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    # an Anthropic client sending x-api-key (this client version sends api_key as a bearer token)
    by_header = anthropic.Anthropic(base_url=server.url, api_key=None, default_headers={"x-api-key": API_KEY},
                                    max_retries=0)
    assert by_header.messages.create(**hi).usage.output_tokens == 2
    bearer = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="tiny", messages=hi["messages"]).input_tokens > 0
    for wrong in (anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0),
                  anthropic.Anthropic(base_url=server.url, api_key=None, default_headers={"x-api-key": "wrong"},
                                      max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as err:
            wrong.messages.create(**hi)
        assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "Incorrect API key provided."}}
    # x-api-key opens the OpenAI routes too; their 401 keeps OpenAI's shape
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers={"x-api-key": API_KEY}).status_code == 200
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_thinking_without_a_reasoning_parser_is_refused(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="--reasoning-parser") as err:
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"thinking": {"type": "adaptive"}})
    assert err.value.body["error"]["message"].startswith("thinking: ")
    r = client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"thinking": {"type": "disabled"}})
    assert r.usage.output_tokens == 2


# -- in process: the output split (no model here can be made to think on demand) ---------------------------
async def _outputs(pieces, finish, stop_reason=None, fail=None):
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1 and fail is None
        yield 0, SimpleNamespace(prompt_token_ids=[], outputs=[SimpleNamespace(text=piece, token_ids=[0], finish_reason=finish if last else None,
                                                          stop_reason=stop_reason if last else None)])
    if fail is not None:
        raise fail


def _events(reply, pieces, finish, stop_reason=None, fail=None):
    async def collect():
        return [chunk async for chunk in reply.events(_outputs(pieces, finish, stop_reason, fail))]
    out = []
    for chunk in asyncio.run(collect()):
        kind, data = re.fullmatch(r"event: (\S+)\ndata: (.*)\n\n", chunk, re.S).groups()
        event = json.loads(data)
        assert event["type"] == kind
        out.append(event)
    return out


TEXT = ('<think>It is about weather.</think>Let me look.<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>')


def _reply(show_thinking: bool) -> _Reply:
    tool = FunctionDef(name="get_weather", parameters=WEATHER["input_schema"])
    plan = ToolPlan.build([tool], "auto", None, ToolOptions(True, "hermes"))
    return _Reply(MODEL, plan, get_reasoning_parser("qwen3"), show_thinking, [], 3)


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_thinking_text_and_tool_use_stream_as_the_whole_output_holds_them(cut):
    reply = _reply(True)
    whole = reply.whole(TEXT, "stop", None, 40)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][0] == {"type": "thinking", "thinking": "It is about weather.", "signature": ""}
    assert whole["content"][2]["input"] == {"city": "Paris", "unit": "celsius"} and whole["stop_reason"] == "tool_use"
    events = _events(reply, [TEXT[i:i + cut] for i in range(0, len(TEXT), cut)], "stop")
    for e in events:
        EVENTS.validate_python(e)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    # one block at a time: each stops before the next starts
    opened = [(e["type"], e["index"]) for e in events if e["type"] in ("content_block_start", "content_block_stop")]
    assert opened == [("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
                      ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2)]
    pieces = {i: "" for i in range(3)}
    for e in events:
        if e["type"] == "content_block_delta":
            d = e["delta"]
            pieces[e["index"]] += d.get("thinking") or d.get("text") or d.get("partial_json")
    assert pieces[0] == whole["content"][0]["thinking"] and pieces[1] == whole["content"][1]["text"]
    assert json.loads(pieces[2]) == whole["content"][2]["input"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1] == {"type": "message_stop"}


def test_without_thinking_asked_for_the_reasoning_is_split_off_and_not_shown():
    reply = _reply(False)
    assert [b["type"] for b in reply.whole(TEXT, "stop", None, 40)["content"]] == ["text", "tool_use"]
    events = _events(reply, [TEXT[i:i + 5] for i in range(0, len(TEXT), 5)], "stop")
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["text", "tool_use"]
    assert not any("thinking" in json.dumps(e.get("delta", {})) for e in events)


def test_a_stop_sequence_met_is_named_and_other_stops_are_end_turn():
    reply = _Reply(MODEL, ToolPlan("none"), None, False, ["END"], 3)
    assert reply.whole("Hi", "stop", "END", 2)["stop_sequence"] == "END"
    assert reply.whole("Hi", "stop", 7, 2)["stop_reason"] == "end_turn"  # a stop token id, not a sequence
    assert reply.whole("Hi", "stop", None, 2)["stop_reason"] == "end_turn"


def test_a_failure_mid_stream_ends_with_an_error_event():
    reply = _Reply(MODEL, ToolPlan("none"), None, False, [], 3)
    failure = RequestFailedError(RequestFailure("structured_outputs: the grammar failed", 400))
    events = _events(reply, ["Hello", " wor"], None, fail=failure)
    assert [e["type"] for e in events[-3:]] == ["content_block_delta", "content_block_delta", "error"]
    assert events[-1]["error"] == {"type": "invalid_request_error", "message": "structured_outputs: the grammar failed"}


@pytest.mark.parametrize("path, anthropic_shape", [("/v1/messages", True), ("/v1/messages/count_tokens", True),
                                                  ("/v1/messagesx", False), ("/v1/chat/completions", False)])
def test_errors_take_anthropic_s_shape_on_the_messages_routes_only(path, anthropic_shape):
    token = _current.set(RequestInfo("r", path))  # as RequestContext sets it for the request being handled
    try:
        body, event = error_body(503, "the server is draining"), error_event(503, "the server is draining")
    finally:
        _current.reset(token)
    if anthropic_shape:
        assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "the server is draining"}}
        assert event == f"event: error\ndata: {json.dumps(body)}\n\n"
    else:
        assert body["error"]["message"] == "the server is draining" and body["error"]["type"] == "service_unavailable"
        assert event == f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


# -- docs/server.md's tables are the models' fields --------------------------------------------------------
def table(marker: str) -> list[str]:
    return doc_field_table(DOC, marker)


def test_docs_list_every_field_as_honoured_without_effect_or_refused():
    fields = {f.alias or name for name, f in MessagesRequest.model_fields.items()}
    honoured, without, refused = table("anthropic"), table("anthropic-without-effect"), table("anthropic-refused")
    assert without == list(ANTHROPIC_WITHOUT_EFFECT) and refused == list(ANTHROPIC_REFUSED)
    assert len(honoured + without + refused) == len(set(honoured + without + refused))
    assert set(honoured + without + refused) == fields
    count = set(table("anthropic-count-tokens"))
    assert count == {f.alias or name for name, f in CountTokensRequest.model_fields.items()} and count <= fields
