"""The real server, driven by the official `openai` client."""
import httpx
import openai
import pytest

from conftest import API_KEY, MAX_MODEL_LEN, metric

IGNORE_EOS = {"ignore_eos": True}


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]


def test_chat_non_streamed_usage_matches_tokenizer(client, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=7, temperature=0, extra_body=IGNORE_EOS)
    assert r.object == "chat.completion" and r.model == "tiny"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert c.message.content == tokenizer.decode(tokenizer.encode(c.message.content, add_special_tokens=False))


def test_chat_text_parts_equal_string_content(client):
    a = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                       max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    b = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}], max_tokens=5, temperature=0,
        extra_body=IGNORE_EOS)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_streamed_equals_non_streamed_with_usage(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
              temperature=0, extra_body=IGNORE_EOS)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n2_seeded(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick a word."}], n=2,
                                       max_tokens=8, temperature=1.0, seed=3, extra_body=IGNORE_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 16
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick a word."}], n=2,
                                           max_tokens=8, temperature=1.0, seed=3, extra_body=IGNORE_EOS)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: chosen is the top
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_stop_strings(client):
    kw = dict(model="tiny", prompt="The stop test", max_tokens=20, temperature=0, extra_body=IGNORE_EOS)
    full = client.completions.create(**kw).choices[0].text
    stop = full[5:8]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[:full.find(stop)] and cut.finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stop=stop, stream=True, **kw)
                       if ch.choices)
    assert streamed == cut.text


def test_completions_forms_of_prompt(client, tokenizer):
    ids = tokenizer.encode("one two three")
    a = client.completions.create(model="tiny", prompt="one two three", max_tokens=5, temperature=0,
                                  extra_body=IGNORE_EOS)
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    assert a.choices[0].text == b.choices[0].text
    many = client.completions.create(model="tiny", prompt=["one two three", "four"], max_tokens=5, temperature=0,
                                     extra_body=IGNORE_EOS)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == a.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(tokenizer.encode("four"))
    lists = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=3, temperature=0,
                                      extra_body=IGNORE_EOS)
    assert len(lists.choices) == 2 and lists.usage.completion_tokens == 6


def test_completions_echo_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="echo me", max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  extra_body=IGNORE_EOS)
    c = r.choices[0]
    assert c.text.startswith("echo me")
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset[1] == len(lp.tokens[0])
    streamed = list(client.completions.create(model="tiny", prompt="echo me", max_tokens=3, temperature=0,
                                              logprobs=2, stream=True, extra_body=IGNORE_EOS))
    offsets = [o for ch in streamed if ch.choices for o in ch.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0
    echoed = list(client.completions.create(model="tiny", prompt="echo me", max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True, extra_body=IGNORE_EOS))
    parts = [ch.choices[0] for ch in echoed if ch.choices]
    assert "".join(p.text for p in parts) == c.text  # the prompt's tokens lead the first chunk, as above
    assert [t for p in parts for t in p.logprobs.tokens] == lp.tokens
    assert [o for p in parts for o in p.logprobs.text_offset] == lp.text_offset
    assert [v for p in parts for v in p.logprobs.token_logprobs][0] is None


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model"


def test_wrong_key_is_401_and_health_metrics_stay_open(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_tokenize_detokenize(server, tokenizer):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}, headers=auth).json()
    assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, headers=auth).json()
    assert d["prompt"] == "hello world"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=auth).json()
    assert chat["count"] > 5
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10 ** 7]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tokenize_and_detokenize_need_the_api_key(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_metrics_count_tokens(server, client):
    before = metric(server, "kvforge:generation_tokens_total")
    client.completions.create(model="tiny", prompt="count", max_tokens=6, extra_body=IGNORE_EOS)
    assert metric(server, "kvforge:generation_tokens_total") - before == 6
    assert metric(server, "kvforge:time_to_first_token_seconds_count") >= 1
    assert metric(server, "kvforge:e2e_request_latency_seconds_count") >= 1
    assert metric(server, "kvforge:inter_token_latency_seconds_count") >= 5


def test_sampling_fields_over_http(client):
    base = dict(model="tiny", prompt="penalties", max_tokens=8, temperature=0)
    plain = client.completions.create(**base, extra_body=IGNORE_EOS).choices[0].text
    biased = client.completions.create(**base, logit_bias={"42": 100}, extra_body=IGNORE_EOS)
    assert biased.choices[0].text == client.completions.create(**base, extra_body=IGNORE_EOS | {
        "allowed_token_ids": [42]}).choices[0].text
    pen = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=2.0, extra_body=IGNORE_EOS)
    assert pen.choices[0].text != plain
    r = client.completions.create(**base, extra_body={"min_tokens": 8, "repetition_penalty": 1.5})
    assert r.usage.completion_tokens == 8


def test_response_format_json_schema(client):
    import json
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["colour", "n"], "additionalProperties": False}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json please"}],
                                       max_tokens=40, seed=1, response_format={"type": "json_schema", "json_schema": {
                                           "name": "thing", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert obj["colour"] in ("red", "green", "blue") and 0 <= obj["n"] <= 9
    r = client.completions.create(model="tiny", prompt="pick", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"structured_outputs": {"json": "{bad"}})
    assert e.value.body["param"] == "structured_outputs"
