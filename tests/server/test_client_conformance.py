"""Real client libraries, unchanged, against conftest's shared tiny server (``dummy:tiny`` served as ``tiny``):
LiteLLM (chat completions whole and streamed with usage, the Responses API and its stored-response calls),
LangChain's ``ChatOpenAI`` over Chat Completions and the Responses API (a named tool choice, the three
``with_structured_output`` methods, a forced tool call cut by ``max_tokens``) and guidellm's benchmark CLI
(streamed, ``ignore_eos``, continuous usage stats). Forced tool choices and response formats are constraints,
so even the random model's output parses.

Offline: LiteLLM reads its bundled price map (``LITELLM_LOCAL_MODEL_COST_MAP``; otherwise it fetches one, and
retries for seconds without a network), guidellm reads its tokenizer from a local directory (the default
model's, saved by the test) with the Hugging Face hub offline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from conftest import API_KEY, metric_by_label

ASK = [{"role": "user", "content": "Tell me a story about a dragon."}]
#: greedy, and sampled with a seed: the random model's greedy text is a run of newlines, its sampled one words
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 7}}


@pytest.fixture(scope="module")
def litellm():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (read when litellm is imported, and later)
        import litellm
        yield litellm


@pytest.fixture(scope="module")
def lite(server):
    """LiteLLM's connection arguments for the tiny server, as its OpenAI-compatible provider."""
    return {"api_base": f"{server.url}/v1", "api_key": API_KEY}


def usage_numbers(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


# ---- LiteLLM ----

@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_litellm_completion_gives_the_openai_sdks_text_and_usage(client, litellm, lite, sampling):
    common = dict(messages=ASK, max_tokens=16, **SAMPLING[sampling])
    sdk = client.chat.completions.create(model="tiny", **common)
    got = litellm.completion(model="openai/tiny", **lite, **common)
    assert got.choices[0].message.content == sdk.choices[0].message.content
    assert got.choices[0].finish_reason == sdk.choices[0].finish_reason == "length"
    assert usage_numbers(got.usage) == usage_numbers(sdk.usage)


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_litellm_streamed_chunks_assemble_the_text_and_end_with_the_usage(client, litellm, lite, sampling):
    common = dict(messages=ASK, max_tokens=16, **SAMPLING[sampling])
    whole = client.chat.completions.create(model="tiny", **common)
    chunks = list(litellm.completion(model="openai/tiny", **lite, **common, stream=True,
                                     stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usages = [c.usage for c in chunks if getattr(c, "usage", None) is not None]
    assert usages and usage_numbers(usages[-1]) == usage_numbers(whole.usage)


def test_litellm_responses_give_the_openai_sdks_output_whole_and_streamed(client, litellm, lite):
    # (at least 16 output tokens: LiteLLM raises a smaller max_output_tokens to OpenAI's minimum, 16)
    common = dict(input="Once upon a time", max_output_tokens=16, temperature=0)
    sdk = client.responses.create(model="tiny", **common)
    whole = litellm.responses(model="openai/tiny", **lite, **common)
    assert whole.output[0].content[0].text == sdk.output_text
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (sdk.usage.input_tokens, 16)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    events = list(litellm.responses(model="openai/tiny", **lite, **common, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output[0].content[0].text == sdk.output_text


def test_litellm_retrieves_lists_and_deletes_a_stored_response(litellm, lite):
    created = litellm.responses(model="openai/tiny", **lite, input="Hello there", max_output_tokens=16,
                                temperature=0)
    where = dict(response_id=created.id, custom_llm_provider="openai", **lite)  # (LiteLLM's own id wraps ours)
    got = litellm.get_responses(**where)
    assert got.output[0].content[0].text == created.output[0].content[0].text
    items = litellm.list_input_items(**where)
    assert [i["content"] for i in items["data"]] == [[{"type": "input_text", "text": "Hello there"}]]
    assert litellm.delete_responses(**where).deleted is True
    with pytest.raises(litellm.NotFoundError):
        litellm.get_responses(**where)


def test_litellm_responses_with_include_and_store_false_answer_and_store_nothing(client, litellm, lite):
    """What LiteLLM sends to keep reasoning across stateless turns (Codex through LiteLLM does)."""
    r = litellm.responses(model="openai/tiny", **lite, input="Once upon a time", max_output_tokens=16,
                          temperature=0, store=False, include=["reasoning.encrypted_content"])
    assert r.usage.output_tokens == 16 and r.output[0].content[0].text
    with pytest.raises(litellm.NotFoundError):
        litellm.get_responses(response_id=r.id, custom_llm_provider="openai", **lite)


# ---- LangChain ----

def get_weather(city: Literal["Paris", "Oslo"]) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Oslo"]
    sunny: bool


class AnyObject(BaseModel):
    """Every JSON object validates (JSON mode promises an object, not which keys); an array or a string does not."""

    model_config = ConfigDict(extra="allow")


API = ["chat", "responses"]


def chat_openai(server, api: str, max_tokens: int = 64):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, model="tiny", temperature=0,
                      max_tokens=max_tokens, use_responses_api=api == "responses")


@pytest.mark.parametrize("api", API)
def test_langchain_bind_tools_with_a_named_choice_returns_that_call(server, api):
    reply = chat_openai(server, api).bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert reply.text == "" and not reply.invalid_tool_calls
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"], dict) and call["args"]["city"] in ("Paris", "Oslo")


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
@pytest.mark.parametrize("api", API)
def test_langchain_structured_output_is_an_instance_of_the_schema(server, api, method):
    schema = AnyObject if method == "json_mode" else Weather
    out = chat_openai(server, api).with_structured_output(schema, method=method, include_raw=True) \
        .invoke("Report the weather in Oslo as JSON.")
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], schema), out["raw"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", API)
def test_langchain_forced_call_cut_by_max_tokens_is_a_call_not_content(server, api, stream):
    """``{"city": "Paris"}`` takes more than 3 tokens: the call comes back cut (LangChain: an invalid call
    whole, a call with the arguments it could parse streamed), with no text, and the reply says why."""
    bound = chat_openai(server, api, max_tokens=3).bind_tools([get_weather], tool_choice="get_weather")
    if stream:
        chunks = list(bound.stream("Weather in Paris?"))
        reply = chunks[0]
        for chunk in chunks[1:]:
            reply += chunk
    else:
        reply = bound.invoke("Weather in Paris?")
    assert reply.text == ""
    assert [c["name"] for c in reply.tool_calls + reply.invalid_tool_calls] == ["get_weather"], reply
    meta = reply.response_metadata
    if api == "chat":
        assert meta["finish_reason"] == "length", meta
    else:
        assert meta["status"] == "incomplete" and meta["incomplete_details"] == {"reason": "max_output_tokens"}, meta


# ---- guidellm ----

GUIDELLM_REQUESTS = 6
GUIDELLM_OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory) -> Path:
    """The default model's tokenizer (the tiny model's too) as a Hugging Face directory, for guidellm."""
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path


def test_guidellm_benchmark_completes_every_request_with_the_asked_tokens_and_server_usage(server, tokenizer_dir,
                                                                                            tmp_path):
    """guidellm's openai_http backend, streaming (its default): it sends ``max_completion_tokens``,
    ``ignore_eos`` and ``stream_options`` with ``continuous_usage_stats``, and takes the token counts from
    the streamed usage. Each count must be the server's, and no field it sends may go ignored."""
    report = tmp_path / "report.json"
    ignored_before = sum(metric_by_label(server, "kvforge:ignored_request_fields_total", "field").values())
    cmd = [str(Path(sys.executable).with_name("guidellm")), "run",
           "--backend", f"kind=openai_http,target={server.url},model=tiny,api_key={API_KEY}",
           "--profile", "kind=concurrent,streams=2",
           "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
           "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={GUIDELLM_OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # (one worker process: each imports torch and datasets)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    [bench] = json.loads(report.read_text())["benchmarks"]
    n = GUIDELLM_REQUESTS
    assert bench["metrics"]["request_totals"] == {"successful": n, "errored": 0, "incomplete": 0, "total": n}
    requests = bench["requests"]["successful"]
    assert len(requests) == n
    for r in requests:
        body = json.loads(r["request_args"])["body"]
        assert body["ignore_eos"] is True and body["max_completion_tokens"] == GUIDELLM_OUTPUT_TOKENS
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        # counts from the streamed usage (guidellm's fallback, one token per chunk, leaves these None)
        assert r["output_metrics"]["text_tokens"] == r["output_tokens"] == GUIDELLM_OUTPUT_TOKENS
        prompt = httpx.post(f"{server.url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"model": "tiny", "messages": body["messages"]}).json()["count"]
        assert r["input_metrics"]["text_tokens"] == r["prompt_tokens"] == prompt
    assert sum(metric_by_label(server, "kvforge:ignored_request_fields_total", "field").values()) == ignored_before
