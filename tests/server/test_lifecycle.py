"""Client disconnects, a concurrent load, graceful SIGTERM, and the server_app_created hook."""
import asyncio
import statistics
import time

import httpx
import pytest

from conftest import API_KEY, ServerProcess, hang_up_mid_stream, metric

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def wait_for(cond, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_disconnect_mid_stream_frees_blocks(smol_server):
    # the real 135M model: slow enough on a CPU that the stream is still running when we hang up
    # (conftest's shared server: its token counter is read before; it exits 0 at the session's end)
    server = smol_server
    before = metric(server, "kvforge:generation_tokens_total")

    def running() -> None:
        assert metric(server, "kvforge:kv_cache_usage_perc") > 0
        assert metric(server, "kvforge:num_requests_running") == 1

    hang_up_mid_stream(server, while_open=running)
    # the connection is closed: the request is aborted and its blocks return at once
    assert wait_for(lambda: metric(server, "kvforge:kv_cache_usage_perc") == 0.0
                    and metric(server, "kvforge:num_requests_running") == 0.0, timeout=10)
    generated = metric(server, "kvforge:generation_tokens_total")
    assert generated - before < 300
    time.sleep(0.5)
    assert metric(server, "kvforge:generation_tokens_total") == generated  # nothing still generating


def test_64_concurrent_streaming_clients(server):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    async def one(i):
        want = 8 + i % 9
        start = time.perf_counter()
        first = None
        text, usage = "", None
        stream = await client.completions.create(model="tiny", prompt=f"client {i} says", max_tokens=want,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices and first is None:
                first = time.perf_counter() - start
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                usage = ch.usage
        return want, usage.completion_tokens, first, time.perf_counter() - start

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(want == got for want, got, _, _ in results)
    ttft = sorted(r[2] for r in results)
    e2e = sorted(r[3] for r in results)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    print(f"\n64 streaming clients: TTFT p50 {q(ttft, .5) * 1e3:.0f} ms p99 {q(ttft, .99) * 1e3:.0f} ms; "
          f"latency p50 {q(e2e, .5) * 1e3:.0f} ms p99 {q(e2e, .99) * 1e3:.0f} ms (mean {statistics.mean(e2e):.2f} s)")
    assert wait_for(lambda: metric(server, "kvforge:kv_cache_usage_perc") == 0.0)


def test_sigterm_lets_running_requests_finish():
    s = ServerProcess()
    try:
        body = {"prompt": "finish me", "max_tokens": 60, "ignore_eos": True}

        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                task = asyncio.create_task(c.post(f"{s.url}/v1/completions", json=body))
                await asyncio.sleep(0.3)
                s.proc.send_signal(__import__("signal").SIGTERM)
                return await task

        r = asyncio.run(go())
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 60
        assert s.proc.wait(60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{s.url}/health", timeout=2)
    finally:
        s.stop()


def test_server_app_created_hook_adds_a_route(tiny_llm):
    from fastapi.testclient import TestClient

    import kvforge
    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.plugin_manager import get_plugin_manager
    from kvforge.server.app import create_app

    class RoutePlugin:
        @kvforge.hookimpl
        def server_app_created(self, app):
            app.add_api_route("/plugin-hello", lambda: {"hello": "from a plugin"})

    pm = get_plugin_manager()
    pm.register(RoutePlugin(), "route-plugin")
    try:
        engine = AsyncLLMEngine(tiny_llm.llm_engine)
        app = create_app(engine, ["tiny"], hook=pm.hook)
        with TestClient(app) as c:
            assert c.get("/plugin-hello").json() == {"hello": "from a plugin"}
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert not engine.is_running
    finally:
        pm.unregister("route-plugin")


def test_health_is_503_when_the_engine_died(tiny_llm):
    from fastapi.testclient import TestClient

    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.server.app import create_app

    engine = AsyncLLMEngine(tiny_llm.llm_engine)
    app = create_app(engine, ["tiny"])
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        original = engine.engine.step

        def broken():
            raise RuntimeError("device lost")

        engine.engine.step = broken
        try:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
            assert c.get("/health").status_code == 503
        finally:
            engine.engine.step = original
    tiny_llm.llm_engine.abort_request(list(tiny_llm.llm_engine.outputs.parents))
