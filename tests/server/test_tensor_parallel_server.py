"""`kvforge serve --tensor-parallel-size 2` (two ranks over gloo) on the real default model: chat and
streaming through the official client give the one-rank server's tokens, a client hanging up
aborts its request and every rank forgets it, and a killed rank takes the server down at once:
/health 503, exit, no rank process left behind."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from conftest import SMOL_FLAGS, ServerProcess, hang_up_mid_stream, http, metric, metric_by_label, wait_until


def rank_requests(server) -> dict[str, float]:
    """``kvforge:rank_batch_requests`` by rank label."""
    return metric_by_label(server, "kvforge:rank_batch_requests", "rank")


CHAT = [{"role": "user", "content": "Name three colours."}]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _server_processes(pid: int) -> tuple[list[int], list[int]]:
    """The server's engine core process and the ranks it spawned (its children)."""
    cores = [c for c in _children(pid) if b"kvforge.engine.core" in _cmdline(c)]
    return cores, [r for c in cores for r in _children(c) if b"rank_process" in _cmdline(r)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def servers(default_model_path, smol_server):
    """Two ranks, and the one-rank reference: conftest's shared default-model server (it exits 0 at the
    session's end), whose flags the two-rank server gets too."""
    tp2 = ServerProcess("--tensor-parallel-size", "2", *SMOL_FLAGS, model=default_model_path)
    yield tp2, smol_server
    assert tp2.stop() == 0


def test_chat_and_stream_equal_one_rank(servers):
    import openai

    got = []
    for s in servers:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
        stream = client.completions.create(model=model, prompt="The sea is", max_tokens=12, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        got.append((chat.choices[0].message.content, "".join(c.choices[0].text for c in stream if c.choices)))
    assert got[0] == got[1] and got[0][0]
    assert wait_until(lambda: rank_requests(servers[0]) == {"0": 0.0, "1": 0.0}, timeout=15)


def test_disconnect_aborts_and_every_rank_forgets(servers):
    tp2 = servers[0]
    hang_up_mid_stream(tp2, while_open=lambda: metric(tp2, "kvforge:kv_cache_usage_perc") > 0 or pytest.fail("idle"))
    assert wait_until(lambda: metric(tp2, "kvforge:kv_cache_usage_perc") == 0.0
                      and rank_requests(tp2) == {"0": 0.0, "1": 0.0}, timeout=15), rank_requests(tp2)
    assert metric(tp2, "kvforge:generation_tokens_total") < 300


def test_killed_rank_stops_the_server(default_model_path):
    s = ServerProcess("--tensor-parallel-size", "2", model=default_model_path)
    try:
        cores, ranks = _server_processes(s.proc.pid)
        assert len(cores) == 1 and len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        start = time.monotonic()
        seen_503 = False
        while s.proc.poll() is None and time.monotonic() - start < 30:
            try:
                seen_503 |= http().get(f"{s.url}/health").status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert s.proc.poll() is not None, "the server did not stop within 30 s of losing a rank"
        assert seen_503
        assert any("rank 1" in line and "killed by SIGKILL" in line for line in s.log)
        assert not any(_alive(pid) for pid in cores + ranks)
    finally:
        s.stop()
