"""Running `kvforge serve` in production (issue 19): readiness apart from liveness, the drain on SIGTERM,
request ids, JSON logs, --disable-log-requests, --root-path and CORS.

Two real servers, started side by side for the module; the last test on each stops it (a drain), so
those two tests come last.
"""
import asyncio
import datetime
import json
import logging
import re
import signal
import sys
import time

import httpx
import pytest

from conftest import API_KEY, ServerProcess, http, metric, wait_until

HEX32 = re.compile(r"[0-9a-f]{32}")
ORIGIN = "https://a.example"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def poll_while_starting(server: ServerProcess, timeout: float = 120) -> list[tuple[int, int, int, str]]:
    """(/ready, /health, GET /v1/models status, /ready's message) each time the server answered,
    from its start until /ready is 200."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            ready = http().get(f"{server.url}/ready")  # (conftest's client: polls cost little CPU)
            health = http().get(f"{server.url}/health")
            models = http().get(f"{server.url}/v1/models")
        except httpx.HTTPError:  # not bound yet (the interpreter is importing)
            time.sleep(0.05)
            continue
        message = ready.json()["error"]["message"] if ready.status_code != 200 else ""
        seen.append((ready.status_code, health.status_code, models.status_code, message))
        if ready.status_code == 200:
            break
        time.sleep(0.05)
    return seen


@pytest.fixture(scope="module")
def servers():
    """Both servers, started side by side (``core_server`` is polled from its start: ``starting``)."""
    core = ServerProcess("--disable-log-requests", "--shutdown-timeout", "1", "--max-model-len", "2048", wait=False)
    other = ServerProcess("--engine-in-process", "--log-format", "json", "--root-path", "/api", "--api-key", API_KEY,
                          "--allowed-origins", json.dumps([ORIGIN]), wait=False)
    try:
        core.starting = poll_while_starting(core)
        core.wait_healthy()
        other.wait_healthy()
        yield core, other
    finally:
        core.stop()
        other.stop()


@pytest.fixture(scope="module")
def core_server(servers):
    """The default engine (a core process), text logs, no request lines, a 1 s drain, max_model_len 2048."""
    return servers[0]


@pytest.fixture(scope="module")
def json_server(servers):
    """An in-process engine, JSON logs, behind a proxy at /api, CORS for ORIGIN, an API key."""
    return servers[1]


def log_records(server: ServerProcess) -> list[dict]:
    """Every line the server printed, each parsed as JSON (a line that is not JSON fails the test)."""
    records = []
    for line in list(server.log):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"a log line is not JSON: {line!r}")
    return records


def stream_lines(response: httpx.Response, lines: list[str]):
    """The SSE data lines of a streamed response, collected into ``lines`` as they come."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            lines.append(line[6:])
            yield line[6:]


# -- readiness ----------------------------------------------------------------------------------------
def test_ready_is_503_while_the_engines_start_then_200(core_server):
    starting = [s for s in core_server.starting if s[0] != 200]
    assert starting, f"never saw the server starting: {core_server.starting}"
    # while starting: the port answers, but /ready, /health and the API are all 503 (the last poll may
    # have seen the engines become ready between its three calls)
    assert all("starting" in s[3] for s in starting), starting
    assert all(s[:3] == (503, 503, 503) for s in starting[:-1]) and starting[0][:3] == (503, 503, 503), starting
    assert core_server.starting[-1][:3] == (200, 200, 200)
    assert httpx.get(f"{core_server.url}/ready").status_code == 200
    assert httpx.get(f"{core_server.url}/health").status_code == 200


def test_ready_is_503_before_the_lifespan_starts_the_engine(tiny_llm):
    from fastapi.testclient import TestClient

    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.server.app import create_app

    app = create_app(AsyncLLMEngine(tiny_llm.llm_engine), ["tiny"])
    c = TestClient(app)  # no lifespan: the engine is not started
    r = c.get("/ready")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert "starting" in r.json()["error"]["message"]
    assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 503
    with TestClient(app) as c:
        assert c.get("/ready").status_code == 200
    assert c.get("/ready").status_code == 503  # stopped: the engine no longer runs


# -- request ids ---------------------------------------------------------------------------------------
def test_a_given_request_id_is_echoed_on_json_stream_and_error_answers(core_server):
    url = f"{core_server.url}/v1/completions"
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, headers={"X-Request-Id": "req-json.1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-json.1"
    assert r.json()["id"].startswith("cmpl-")  # the answer's own id is unchanged
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", url, json=body, headers={"X-Request-Id": "req-stream:2"}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-stream:2"
        assert list(stream_lines(r, []))[-1] == "[DONE]"
    for bad_body in ({"prompt": "hi", "model": "nope"}, {"prompt": "hi", "temperature": -1}):
        r = httpx.post(url, json=bad_body, headers={"X-Request-Id": "req-error/3"})
        assert r.status_code in (400, 404) and r.headers["x-request-id"] == "req-error/3"
    r = httpx.post(url, content=b"x" * 100, headers={"X-Request-Id": "req-body-4"})  # refused by BodyLimits
    assert r.status_code == 400 and r.headers["x-request-id"] == "req-body-4"


def test_a_missing_or_invalid_request_id_is_generated(core_server):
    url = f"{core_server.url}/v1/models"
    ids = [httpx.get(url).headers["x-request-id"] for _ in range(2)]
    for bad in ("x" * 129, "has space", b"caf\xc3\xa9"):
        r = httpx.get(url, headers={"X-Request-Id": bad})
        assert r.status_code == 200
        ids.append(r.headers["x-request-id"])
    assert all(HEX32.fullmatch(i) for i in ids) and len(set(ids)) == len(ids), ids
    assert httpx.get(url, headers={"X-Request-Id": "y" * 128}).headers["x-request-id"] == "y" * 128


def test_engine_requests_are_named_after_the_request_id_and_500s_carry_it(tiny_llm):
    from fastapi.testclient import TestClient

    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.server.app import create_app

    engine = AsyncLLMEngine(tiny_llm.llm_engine)
    engine_ids = []
    add_request = engine.add_request

    async def recording(prompt, params, request_id, *args, **kwargs):
        engine_ids.append(request_id)
        return await add_request(prompt, params, request_id, *args, **kwargs)

    engine.add_request = recording
    app = create_app(engine, ["tiny"])

    @app.get("/broken")
    async def broken():
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "abc"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc"
        assert engine_ids == [f"abc:{r.json()['id']}"]
        # a 500 comes from Starlette's outermost error middleware: it still carries the id
        r = c.get("/broken", headers={"X-Request-Id": "def"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "def"


# -- logs ------------------------------------------------------------------------------------------------
def test_disable_log_requests_writes_no_request_line(core_server):
    for _ in range(2):
        assert httpx.post(f"{core_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                       "user": "someone"}).status_code == 200
    time.sleep(0.3)  # the log reader thread catches up
    log = "".join(core_server.log)
    assert "kvforge ready: serving" in log
    assert "kvforge.server.requests" not in log and "POST /v1/completions" not in log and "someone" not in log


def test_json_logs_one_object_per_line_with_the_request_id(json_server):
    r = httpx.post(f"{json_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "user": "u1"},
                   headers={**AUTH, "X-Request-Id": "json-req-1"})
    assert r.status_code == 200

    def request_lines() -> list[dict]:
        return [rec for rec in log_records(json_server) if rec.get("request_id") == "json-req-1"]

    assert wait_until(lambda: request_lines(), 5)
    records = log_records(json_server)  # every line the server (and its engine) printed parses
    for rec in records:
        assert {"time", "level", "logger", "message"} <= rec.keys(), rec
        assert datetime.datetime.fromisoformat(rec["time"]).tzinfo is not None
    assert any(rec["message"].startswith("kvforge ready: serving") for rec in records)
    [line] = request_lines()
    assert line["logger"] == "kvforge.server.requests" and line["level"] == "INFO"
    assert (line["method"], line["path"], line["status"], line["user"]) == ("POST", "/v1/completions", 200, "u1")
    assert line["response_id"] == r.json()["id"] and line["duration_s"] > 0
    assert "POST /v1/completions 200" in line["message"]


def test_formatters_carry_the_request_id_and_the_traceback():
    from kvforge.log_format import JsonFormatter, TextFormatter

    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("kvforge.server", logging.ERROR, __file__, 1, "failed %s", ("x",), sys.exc_info())
    record.request_id = "rid-1"
    obj = json.loads(JsonFormatter().format(record))
    assert (obj["level"], obj["logger"], obj["message"], obj["request_id"]) == ("ERROR", "kvforge.server",
                                                                                  "failed x", "rid-1")
    assert "Traceback" in obj["exc_info"] and "RuntimeError: boom" in obj["exc_info"]
    text = TextFormatter().format(record)
    assert " ERROR kvforge.server [rid-1]: failed x\nTraceback" in text


# -- proxies and browsers ---------------------------------------------------------------------------------
def test_root_path_serves_what_the_proxy_forwards_with_the_prefix_stripped(json_server):
    # the proxy serves https://host/api/... and forwards /api/v1/models as /v1/models
    assert httpx.get(f"{json_server.url}/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert httpx.get(f"{json_server.url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "dummy:tiny"
    assert httpx.get(f"{json_server.url}/v1/models").status_code == 401  # the key is still checked
    assert httpx.get(f"{json_server.url}/api/v1/models", headers=AUTH).status_code == 404  # not stripped


def test_cors_answers_the_allowed_origin_only(json_server, core_server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{json_server.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(f"{json_server.url}/v1/chat/completions", headers={**preflight, "Origin": "https://b.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{json_server.url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    # without --allowed-origins: no CORS at all
    r = httpx.options(f"{core_server.url}/v1/chat/completions", headers=preflight)
    assert not any(h.startswith("access-control-") for h in r.headers)


# -- the drain (each stops its server: last) -----------------------------------------------------------------
def test_sigterm_drains_new_requests_get_503_and_a_stream_finishes(json_server):
    s = json_server
    body = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[str] = []
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{s.url}/v1/completions", json=body, headers=AUTH) as r:
        lines = stream_lines(r, events)
        for _ in range(3):
            next(lines)
        s.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: httpx.get(f"{s.url}/ready").status_code == 503, 5)
        ready = httpx.get(f"{s.url}/ready").json()["error"]
        assert ready["type"] == "service_unavailable" and "draining" in ready["message"]
        assert httpx.get(f"{s.url}/health").status_code == 200  # liveness holds during the drain
        new = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
        assert new.status_code == 503 and new.json()["error"]["type"] == "service_unavailable"
        assert new.headers["connection"] == "close" and HEX32.fullmatch(new.headers["x-request-id"])
        list(lines)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 300  # it ran to the end
    assert s.proc.wait(30) == 0
    assert any("every request has finished" in rec["message"] for rec in log_records(s))


def test_the_drain_aborts_what_runs_past_the_shutdown_timeout_and_exits_0(core_server):
    s = core_server
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    plain = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            waiting = asyncio.create_task(c.post(f"{s.url}/v1/completions", json=plain))
            running = lambda: metric(s, "kvforge:num_requests_running") == 1  # noqa: E731
            assert await asyncio.to_thread(wait_until, running, 10)  # admitted before the signal
            events = []
            async with c.stream("POST", f"{s.url}/v1/chat/completions", json=chat) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                    if len(events) == 3:
                        s.proc.send_signal(signal.SIGTERM)
                        signalled = time.monotonic()
            return events, time.monotonic() - signalled, await waiting

    events, stream_s, plain_answer = asyncio.run(go())
    # --shutdown-timeout 1: both are cut off after about a second, each with an error it can read
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "service_unavailable"
    assert len(events) < 2000 and stream_s < 10
    assert plain_answer.status_code == 503 and "shut down" in plain_answer.json()["error"]["message"]
    t = time.monotonic()
    assert s.proc.wait(30) == 0
    assert time.monotonic() - t < 15
    assert any("aborting 2 request(s)" in line for line in s.log)
