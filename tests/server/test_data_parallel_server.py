"""`kvforge serve --data-parallel-size 2` (two engine replicas as Ray actors, a local Ray started by the
server) on the real default model: concurrent streams through the official client get the text one
engine gives, the requests are spread over both replicas, bad input is still a 400 naming the field,
and a client hanging up aborts its request on its replica. A replica killed outright stops the server
(on the tiny model: a replica's death does not depend on the model it serves, and its start is 3 s shorter)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from conftest import ServerProcess, hang_up_mid_stream, metric, metric_by_label, wait_until

pytest.importorskip("ray")

PROMPTS = [f"Tell me one fact about the number {i}." for i in range(6)]


def routed(server) -> dict[str, float]:
    return metric_by_label(server, "kvforge:data_parallel_requests_total", "replica")


@pytest.fixture(scope="module")
def dp_server(default_model_path):
    s = ServerProcess("--data-parallel-size", "2", model=default_model_path)
    yield s
    assert s.stop() == 0


def test_streams_spread_over_two_replicas_and_match_one_engine(dp_server, default_llm):
    import openai

    from kvforge import SamplingParams

    client = openai.AsyncOpenAI(base_url=f"{dp_server.url}/v1", api_key="x", max_retries=0, timeout=120)

    async def one(prompt):
        stream = await client.completions.create(model=client_model, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    client_model = httpx.get(f"{dp_server.url}/v1/models").json()["data"][0]["id"]
    got = asyncio.run(main())
    # one engine: conftest's shared default-model engine (built once for the session)
    ref = default_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert got == [o.outputs[0].text for o in ref]
    counts = routed(dp_server)
    assert set(counts) == {"0", "1"} and sum(counts.values()) >= len(PROMPTS) and min(counts.values()) >= 2
    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    assert "| `kvforge:data_parallel_requests` | counter |" in doc


def test_bad_input_is_a_400_naming_the_field(dp_server):
    r = httpx.post(f"{dp_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "logprobs": 99})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_disconnect_aborts_on_the_replica(dp_server):
    hang_up_mid_stream(dp_server)
    assert wait_until(lambda: metric(dp_server, "kvforge:num_requests_running") == 0.0, timeout=15)
    assert metric(dp_server, "kvforge:kv_cache_usage_perc") == 0.0
    assert metric(dp_server, "kvforge:generation_tokens_total") < 300 + 12 * len(PROMPTS)


def test_a_dead_replica_stops_the_server():
    import os
    import signal
    import subprocess
    import time

    def replicas() -> set[str]:
        return set(subprocess.run(["pgrep", "-f", "ray::ReplicaActor"], capture_output=True, text=True).stdout.split())

    before = replicas()  # another test's server may be running
    s = ServerProcess("--data-parallel-size", "2")  # dummy:tiny
    try:
        found = sorted(replicas() - before)
        assert len(found) == 2
        os.kill(int(found[0]), signal.SIGKILL)
        start = time.monotonic()
        while s.proc.poll() is None and time.monotonic() - start < 45:
            time.sleep(0.05)
        assert s.proc.poll() is not None, "the server did not stop within 45 s of losing a replica"
        assert any("data-parallel replica" in line for line in s.log)
    finally:
        s.stop()
    assert wait_until(lambda: not (replicas() - before), timeout=2)  # gone within 2 s of the stop
