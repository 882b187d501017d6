"""Tool calling, reasoning output and vllm_xargs over HTTP, with the real default model and the official client.

``required`` and named ``tool_choice`` are enforced with structured outputs, so every seeded sample parses,
streamed or not. ``auto`` and the reasoning parser read the model's text: the dummy plugin's ``dummy_script``
logits processor (enabled per request, its tokens given in ``vllm_xargs``) makes that text a fixed one, so
what the server returns is compared with what the parser makes of the same text.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvforge.tool_parsing import get_reasoning_parser, get_tool_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(20)


def check_call(call: dict) -> None:
    """A call of one of TOOLS whose arguments satisfy its schema."""
    assert call["id"].startswith("call_") and call["type"] == "function"
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "London", "Tokyo")
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})


def streamed(client, **kwargs) -> tuple[dict, str]:
    """A streamed chat completion assembled as the official client's users do: (message, finish_reason)."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            d = choice.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.index not in msg["tool_calls"]:  # a call's first delta: id, type, name
                    assert tc.id and tc.type == "function" and tc.function.name
                    msg["tool_calls"][tc.index] = {"id": tc.id, "type": "function",
                                                   "function": {"name": tc.function.name, "arguments": ""}}
                else:
                    assert tc.id is None and not tc.function.name
                msg["tool_calls"][tc.index]["function"]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return msg, finish


@pytest.fixture(scope="module")
def tool_server(smol_server):
    """conftest's shared default-model server: hermes tool calls, qwen3 reasoning, served as ``smol``,
    16 sequences, the dummy plugin installed."""
    return smol_server


@pytest.fixture(scope="module")
def smol(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_parses_for_every_seed(smol, choice, stream):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}

    def one(seed):
        kwargs = dict(model="smol", messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed,
                      max_tokens=96)
        if stream:
            return streamed(smol, **kwargs)
        r = smol.chat.completions.create(**kwargs).choices[0]
        return r.message.model_dump(), r.finish_reason

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, SEEDS))
    ids = []
    for message, finish in results:
        # "required" lets a sampled answer call again and again (this 135M model repeats its call at some
        # seeds until max_tokens): a cut answer is still calls, every one complete but the one being written
        assert finish in ("tool_calls", "length") and message["tool_calls"], message
        assert not message["content"]
        complete = message["tool_calls"] if finish == "tool_calls" else message["tool_calls"][:-1]
        for call in complete:
            check_call(call)
        ids += [call["id"] for call in message["tool_calls"]]
        if choice == "named":
            assert finish == "tool_calls", message  # one call, no array: it always fits
            assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert sum(finish == "tool_calls" for _, finish in results) > len(SEEDS) // 2
    assert len(ids) == len(set(ids))  # every call has its own id


def test_streamed_calls_equal_the_whole_ones(smol):
    kwargs = dict(model="smol", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, max_tokens=96)
    whole = smol.chat.completions.create(**kwargs).choices[0].message
    message, _ = streamed(smol, **kwargs)
    assert [c["function"] for c in message["tool_calls"]] == [c.function.model_dump() for c in whole.tool_calls]


def test_parallel_tool_calls_false_gives_one_call(smol):
    for seed in range(5):
        r = smol.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=96)
        assert len(r.choices[0].message.tool_calls) == 1


def test_a_whole_tool_round_trip(smol, tool_server):
    first = smol.chat.completions.create(model="smol", messages=ASK, tools=TOOLS,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         temperature=0, max_tokens=64).choices[0].message
    call = first.tool_calls[0]
    conversation = ASK + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "It is 22 degrees and sunny."}]
    answer = smol.chat.completions.create(model="smol", messages=conversation, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=24).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the tool's result reached the prompt (SmolLM2's ChatML template renders a tool turn, not the calls)
    import httpx
    ids = httpx.post(f"{tool_server.url}/tokenize", json={"model": "smol", "messages": conversation}).json()["tokens"]
    detok = httpx.post(f"{tool_server.url}/detokenize", json={"model": "smol", "tokens": ids}).json()["prompt"]
    assert "tool\nIt is 22 degrees and sunny." in detok


SCRIPTS = {
    "call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}\n</tool_call>',
    "content and two calls": 'Checking both.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
                             '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                             '"unit": "fahrenheit"}}\n</tool_call>',
    "no call": "I cannot check the weather, sorry.",
}


def scripted(tokenizer, text: str) -> dict:
    """The extra body that makes the output ``text`` then the end of the turn."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"logits_processors": ["dummy_script"], "vllm_xargs": {"script_token_ids": ids}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_auto_tool_choice_reads_calls_with_the_hermes_parser(smol, tokenizer, script, stream):
    text = SCRIPTS[script]
    want = get_tool_parser("hermes")().parse(text)
    kwargs = dict(model="smol", messages=ASK, tools=TOOLS, max_tokens=96, extra_body=scripted(tokenizer, text))
    if stream:
        message, finish = streamed(smol, **kwargs)
    else:
        r = smol.chat.completions.create(**kwargs).choices[0]
        message, finish = r.message.model_dump(), r.finish_reason
    calls = message["tool_calls"] or []
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(c.name, c.arguments) for c in want.calls]
    assert (message["content"] or None) == want.content
    assert finish == ("tool_calls" if want.calls else "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_content_is_split_off(smol, tokenizer, stream):
    text = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny in Paris."
    reasoning, content = get_reasoning_parser("qwen3")().parse(text)
    kwargs = dict(model="smol", messages=ASK, max_tokens=64, extra_body=scripted(tokenizer, text))
    if stream:
        message, _ = streamed(smol, **kwargs)
    else:
        message = smol.chat.completions.create(**kwargs).choices[0].message.model_dump()
    assert message["reasoning_content"] == reasoning == "\nThe user wants Paris.\n"
    assert message["content"] == content


def test_vllm_xargs_reach_the_logits_processor(smol, tokenizer):
    """The dummy plugin's ``dummy_ban`` bans the token its ``ban_token_id`` names: the greedy first token."""
    prompt = "The capital of France is"

    def first_token(**extra):
        r = smol.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, **extra)
        return r.choices[0].logprobs.tokens[0]

    greedy = first_token()
    ids = tokenizer.encode(greedy, add_special_tokens=False)
    assert len(ids) == 1  # a token whose text encodes back to itself
    banned = first_token(extra_body={"logits_processors": ["dummy_ban"], "vllm_xargs": {"ban_token_id": ids[0]}})
    assert banned != greedy
    other = first_token(extra_body={"logits_processors": ["dummy_ban"], "vllm_xargs": {"ban_token_id": ids[0] + 1}})
    assert other == greedy  # another token banned: the greedy one stays


@pytest.mark.parametrize("xargs, field", [({"ban_token_id": -3}, "vllm_xargs.ban_token_id"),
                                          ({"ban_token_id": "seven"}, "vllm_xargs.ban_token_id"),
                                          ({"other": 1}, "vllm_xargs.other")])
def test_bad_vllm_xargs_are_400s_naming_the_key(smol, xargs, field):
    with pytest.raises(openai.BadRequestError) as err:
        smol.chat.completions.create(model="smol", messages=ASK, max_tokens=4,
                                     extra_body={"logits_processors": ["dummy_ban"], "vllm_xargs": xargs})
    assert field in str(err.value)


@pytest.mark.parametrize("body, field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "arguments"),
    ({"functions": [WEATHER["function"]]}, "functions"),
])
def test_bad_tool_requests_are_400s_naming_the_field(tool_server, body, field):
    import httpx
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", json={"model": "smol", "messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert field in r.text


def test_auto_needs_the_server_flag(client):
    """The shared test server runs without --enable-auto-tool-choice: tools with the default (auto) choice
    are a 400 that says which flags, as vLLM's."""
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)


def test_langchain_bind_tools_and_structured_output(tool_server):
    """examples/langchain_tools.py against the server: LangChain's bind_tools with a forced tool returns
    tool_calls, and with_structured_output(method="function_calling") returns the pydantic object (the
    script asserts both)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "langchain_tools.py"
    out = subprocess.run([sys.executable, str(script), "--base-url", f"{tool_server.url}/v1", "--model", "smol"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bind_tools: [{'name': 'get_weather'" in out.stdout and "with_structured_output: city=" in out.stdout
