"""Issue 11's findings, each replayed against a real `kvforge serve`: the request that broke things now
gets an OpenAI-shaped 4xx naming the field (or completes), and a normal request afterwards still works.
Fault injection (the dummy plugin's `fault` logits processor) shows a failing request failing alone and
a device failure failing everything at once."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from conftest import API_KEY, ServerProcess, metric, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def post(server, path, body=None, content=None, headers=AUTH, timeout=60):
    return httpx.post(f"{server.url}{path}", json=body, content=content,
                      headers={**headers, "Content-Type": "application/json"}, timeout=timeout)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serves(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def idle(server, timeout=15.0):
    """The engine holds nothing: no block, no running or waiting sequence."""
    return not any(wait_idle(server, timeout).values())


@pytest.mark.parametrize("body,param", [
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": 2 ** 64 - 1, "n": 2}, "seed"),
    ({"n": 10 ** 6}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ({"logit_bias": {str(i): 1 for i in range(9000)}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"bad_words": ["w"] * 1025}, "bad_words"),
    ({"allowed_token_ids": list(range(9000))}, "allowed_token_ids"),
    ({"priority": 2 ** 70}, "priority"),
    # tools with the default choice (auto) on a server without --enable-auto-tool-choice (docs/tools.md)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"extra_args": {"a": 1}}, "extra_args"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"temperature": 1e300}, "temperature"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"guided_choice": []}, "guided_choice"),
    ({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"},
     "chat_template"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}}},
     "response_format"),
])
def test_bounded_and_refused_fields_are_400_naming_them(server, body, param):
    assert_error(post(server, "/v1/chat/completions", CHAT | body), 400, param)
    still_serves(server)


def test_neutral_values_of_refused_fields_are_accepted(server):
    r = post(server, "/v1/chat/completions", CHAT | {"tools": [], "tool_choice": "none", "store": False, "user": "u1"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content,what", [
    (b'{"messages": [{"role": "user", "content": "\\ud800 lone"}], "max_tokens": 2}', "surrogate"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "UTF-8"),
    (b"[" * 5000 + b"]" * 5000, "nested deeper"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "temperature": Infinity}', "Infinity"),
    (b'{"prompt": "x", ', "malformed JSON"),
    (b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", "5000 digits"),
])
def test_hostile_bodies_are_openai_shaped_400s(server, content, what):
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    err = assert_error(post(server, path, content=content), 400)
    assert what in err["message"], err
    still_serves(server)


def test_unknown_routes_and_methods_are_openai_shaped(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing-here", headers=AUTH), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions", headers=AUTH), 405)


def test_a_huge_prompt_is_refused_before_tokenizing_and_health_stays_responsive(server):
    huge = "word " * (1_600_000)  # 8 MB
    latencies: list[float] = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.monotonic()
            httpx.get(f"{server.url}/health", timeout=30)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)

    t = threading.Thread(target=probe)
    t.start()
    try:
        for path, body, param in (("/v1/completions", {"prompt": huge, "max_tokens": 2}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]},
                                   "messages"),
                                  ("/tokenize", {"prompt": huge}, "prompt")):
            err = assert_error(post(server, path, body), 400, param)
            assert "cannot fit in max_model_len" in err["message"]
    finally:
        stop.set()
        t.join()
    assert latencies and max(latencies) < 2.0, latencies  # was 13 s of stall before
    still_serves(server)


def test_a_vanishing_temperature_answers_like_greedy(server):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    greedy = post(server, "/v1/completions", body | {"temperature": 0}).json()["choices"][0]["text"]
    tiny = post(server, "/v1/completions", body | {"temperature": 1e-300}).json()["choices"][0]["text"]
    assert tiny == greedy and tiny


def test_a_vanishing_top_p_answers_like_greedy(server):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    greedy = post(server, "/v1/completions", body | {"temperature": 0}).json()["choices"][0]["text"]
    tiny = post(server, "/v1/completions", body | {"top_p": 1e-300, "seed": 3}).json()["choices"][0]["text"]
    assert tiny == greedy and tiny


def test_a_constraint_that_leaves_no_token_is_a_400_for_that_request_only(server):
    """A regex whose next character no token can spell: the request ends with a 400, not a made-up
    token or a 500, and the engine holds nothing of it."""
    body = {"prompt": "hi", "max_tokens": 8, "guided_regex": "K\U000897A5r"}
    err = assert_error(post(server, "/v1/completions", body), 400)
    assert "no token can be sampled" in err["message"], err
    assert idle(server)
    still_serves(server)


def test_echo_with_logprobs_on_a_long_prompt_returns_every_position(server):
    ids = list(range(100, 500))
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])


def test_prompt_logprobs_are_returned_when_asked(server):
    r = post(server, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 1, "prompt_logprobs": 1})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 4
    assert all(str(t) in e for t, e in zip([6, 7, 8], entries[1:]))


def _send_and_vanish(server, body: dict, linger: float) -> None:
    """Send a request on a raw socket and close it after ``linger`` seconds, unread."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        time.sleep(linger)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("linger", [0.0, 0.3])
def test_a_client_that_disconnects_leaves_nothing_behind(server, stream, linger):
    before = metric(server, "kvforge:generation_tokens_total")
    body = {"prompt": "tell me a long story", "max_tokens": 480, "ignore_eos": True, "stream": stream}
    for _ in range(4):
        _send_and_vanish(server, body, linger)
    assert idle(server), "a disconnected request kept running or holding blocks"
    # aborted early: far fewer than 4 x 480 tokens were generated
    assert metric(server, "kvforge:generation_tokens_total") - before < 4 * 480
    still_serves(server)


# -- fault injection: a server with the dummy plugin's `fault` logits processor ------------------------

@pytest.fixture(scope="module")
def fault_server(dummy_plugin_installed):
    s = ServerProcess("--api-key", API_KEY, "--max-request-body-bytes", "200000")
    yield s
    s.stop()


def _completion(prompt: str, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logits_processors": ["fault"], "stream": stream}


PROMPTS = [f"prompt number {i} says" for i in range(8)]


async def _run_batch(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as c:
        return list(await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies)))


def test_a_request_whose_plugin_raises_fails_alone(fault_server):
    baseline = asyncio.run(_run_batch(fault_server.url, [_completion(p) for p in PROMPTS]))
    texts = [r.json()["choices"][0]["text"] for r in baseline]
    bad = 5
    bodies = [_completion(p + (" FAULT:request" if i == bad else "")) for i, p in enumerate(PROMPTS)]
    got = asyncio.run(_run_batch(fault_server.url, bodies))
    for i, r in enumerate(got):
        if i == bad:
            assert "injected by kvforge_dummy_plugin" in assert_error(r, 400)["message"]
        else:
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[i]
    # streamed: an error event, then [DONE]
    with httpx.stream("POST", f"{fault_server.url}/v1/completions", headers=AUTH, timeout=60,
                      json=_completion("x FAULT:request", stream=True)) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] is None
    assert "injected" in json.loads(events[-2])["error"]["message"]
    assert idle(fault_server)


def test_a_body_over_the_limit_is_413(fault_server):
    err = assert_error(post(fault_server, "/v1/completions", {"prompt": "x" * 300_000}), 413)
    assert "200000" in err["message"] and err["code"] == "request_too_large"


def test_a_device_failure_fails_every_request_at_once_and_the_server_exits_nonzero(fault_server):
    # runs last in this module: it kills the fault server's engine
    async def scenario():
        async with httpx.AsyncClient(base_url=fault_server.url, headers=AUTH, timeout=60) as c:
            async def long_stream():
                body = {"prompt": "a long one", "max_tokens": 480, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

            streams = [asyncio.create_task(long_stream()) for _ in range(4)]
            await asyncio.sleep(0.5)  # the streams are running
            t0 = time.monotonic()
            fault = await c.post("/v1/completions", json=_completion("boom FAULT:device"))
            events = await asyncio.gather(*streams)
            return fault, events, time.monotonic() - t0

    fault, events, elapsed = asyncio.run(scenario())
    assert fault.status_code == 503, fault.text
    for ev in events:
        assert ev[-1] == "data: [DONE]" and "the engine has stopped" in ev[-2]
    assert elapsed < 1.0, elapsed  # every in-flight request failed at once
    assert httpx.get(f"{fault_server.url}/health", timeout=5).status_code == 503
    fault_server.proc.wait(timeout=30)  # drains and exits by itself
    assert fault_server.proc.returncode == 1
