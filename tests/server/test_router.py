"""`kvforge router` in front of two `kvforge serve` replicas (tiny model, KV events on): requests that share a
prefix land on the replica that holds it (its prefix-cache counters say so), a prefix stored on a replica
behind the router's back is learnt from that replica's `/kv_events`, distinct prompts spread over both, and a
replica that stops answering or is killed is routed around, then taken back when it answers again."""
from __future__ import annotations

import collections
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from conftest import ServerProcess, free_port, hang_up_mid_stream, http, metric, wait_until

PROMPT = ("In the old harbour town the fishermen mend their nets at dawn, the bakers open their shutters, "
          "children run along the sea wall, and the ferry to the islands sounds its horn twice before it leaves")
DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"


class RouterProcess:
    """``kvforge router`` over ``backends`` on a free port, polling them every 0.2 s (events every 0.1 s)."""

    def __init__(self, backends: list[ServerProcess], *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvforge.cli", "router", "--port", str(self.port), "--health-interval", "0.2",
               "--events-interval", "0.1", *(a for b in backends for a in ("--backend", b.url)), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: collections.deque[str] = collections.deque(maxlen=500)
        threading.Thread(target=self.log.extend, args=(self.proc.stdout,), daemon=True).start()
        if not wait_until(self._up, 30):
            self.stop()
            raise RuntimeError("the router did not start:\n" + "".join(self.log))

    def _up(self) -> bool:
        assert self.proc.poll() is None, "".join(self.log)
        try:
            return http().get(f"{self.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def backend(self, server: ServerProcess) -> dict:
        return next(b for b in http().get(f"{self.url}/backends").json()["backends"] if b["url"] == server.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def replicas():
    started = [ServerProcess("--enable-kv-events", wait=False) for _ in range(2)]  # (they load side by side)
    try:
        for s in started:
            s.wait_healthy()
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def router(replicas):
    r = RouterProcess(replicas)
    yield r
    r.stop()


def complete(target, prompt: str, max_tokens: int = 4) -> int:
    r = httpx.post(f"{target.url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                   timeout=60)
    return r.status_code


def counters(server) -> tuple[float, float]:
    return metric(server, "kvforge:prefix_cache_hits_total"), metric(server, "kvforge:prefix_cache_queries_total")


def shared_tokens(server, a: str, b: str) -> int:
    """The prompt tokens ``a`` and ``b`` share from the start, in whole blocks of 16."""
    ids = [http().post(f"{server.url}/tokenize", json={"prompt": p}).json()["tokens"] for p in (a, b)]
    n = next((i for i, (x, y) in enumerate(zip(*ids)) if x != y), min(map(len, ids)))
    return n // 16 * 16


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(router, replicas):
    before = [counters(s) for s in replicas]
    assert complete(router, PROMPT + " First") == 200
    grew = [counters(s)[1] > b[1] for s, b in zip(replicas, before)]
    assert sum(grew) == 1
    holder, other = (replicas[0], replicas[1]) if grew[0] else (replicas[1], replicas[0])
    shared = shared_tokens(holder, PROMPT + " First", PROMPT + " Second")
    assert shared >= 32
    held, idle = counters(holder), counters(other)
    for word in ("Second", "Third", "Fourth"):  # each time both are idle: by load alone they would alternate
        assert complete(router, f"{PROMPT} {word}") == 200
    assert counters(holder)[0] - held[0] == 3 * shared
    assert counters(other) == idle


def test_streamed_chats_sharing_a_system_prompt_stay_on_its_holder(router, replicas):
    system = {"role": "system", "content": "You are a ship's cook. " + PROMPT}

    def chat(question: str) -> list[str]:
        body = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    equalize(router, replicas)  # then the first chat's holder is sent one more: by load alone the next go elsewhere
    before = [counters(s) for s in replicas]
    assert chat("What is for dinner?")[-1] == "data: [DONE]"
    grew = [counters(s)[1] > b[1] for s, b in zip(replicas, before)]
    holder, other = (replicas[0], replicas[1]) if grew[0] else (replicas[1], replicas[0])
    assert sum(grew) == 1
    hits, idle = counters(holder)[0], counters(other)
    for question in ("And for breakfast?", "Any dessert?"):
        assert chat(question)[-1] == "data: [DONE]"
    assert counters(holder)[0] - hits >= 2 * 32 and counters(other) == idle


def equalize(router, replicas) -> None:
    """Route short prompts (no whole block: nothing to match; each goes to the replica sent fewer) until the
    router has sent both replicas as many."""
    for i in range(20):
        if len({router.backend(s)["routed"] for s in replicas}) == 1:
            return
        assert complete(router, f"Filler {i}: owls") == 200
    raise AssertionError(f"the fillers went elsewhere: {http().get(f'{router.url}/backends').json()}")


def busiest(router, replicas) -> ServerProcess:
    """The replica the router has sent the most requests (one more goes through the router on a tie)."""
    routed = [router.backend(s)["routed"] for s in replicas]
    if routed[0] == routed[1]:
        assert complete(router, "A tie breaker about owls and their habits at night") == 200
        routed = [router.backend(s)["routed"] for s in replicas]
    return replicas[0] if routed[0] > routed[1] else replicas[1]


def test_a_prefix_stored_behind_the_router_s_back_is_learnt_from_the_replica_s_events(router, replicas):
    target = busiest(router, replicas)  # by load and routed counts the router would pick the other
    other = replicas[1] if target is replicas[0] else replicas[0]
    prompt = "Mountain climbers tell of storms, ropes, cold nights in tents and the view at the top. " * 3
    held = router.backend(target)["held_blocks"]
    assert complete(target, prompt + " Alpha") == 200  # straight to the replica, not through the router
    blocks = shared_tokens(target, prompt + " Alpha", prompt + " Beta") // 16
    assert wait_until(lambda: router.backend(target)["held_blocks"] >= held + blocks, 10), router.backend(target)
    hits, idle = counters(target)[0], counters(other)
    assert complete(router, prompt + " Beta") == 200
    assert counters(target)[0] - hits == blocks * 16 and counters(other) == idle


def test_distinct_prompts_spread_over_both_replicas(router, replicas):
    routed = [router.backend(s)["routed"] for s in replicas]
    tokens = [metric(s, "kvforge:prompt_tokens_total") for s in replicas]
    prompts = [f"Question {i}: why does the number {i * 7919} matter to {['cats', 'dogs', 'owls'][i % 3]}?"
               for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(lambda p: complete(router, p, max_tokens=16), prompts)) == [200] * 6
    spread = [router.backend(s)["routed"] - r for s, r in zip(replicas, routed)]
    assert sum(spread) == 6 and min(spread) >= 2, spread
    assert all(metric(s, "kvforge:prompt_tokens_total") > t for s, t in zip(replicas, tokens))


def test_a_client_hanging_up_aborts_its_request_on_the_replica(router, replicas):
    generated = sum(metric(s, "kvforge:generation_tokens_total") for s in replicas)
    hang_up_mid_stream(router, max_tokens=400)
    assert wait_until(lambda: all(metric(s, "kvforge:num_requests_running") == 0 for s in replicas), 15)
    assert sum(metric(s, "kvforge:generation_tokens_total") for s in replicas) - generated < 400
    assert wait_until(lambda: all(router.backend(s)["in_flight"] == 0 for s in replicas), 5)


def test_a_replica_that_stops_answering_or_dies_is_routed_around(replicas):
    spare = ServerProcess("--enable-kv-events")
    router = RouterProcess([replicas[0], spare])
    try:
        os.kill(spare.proc.pid, signal.SIGSTOP)  # alive but silent: its health checks time out
        assert wait_until(lambda: not router.backend(spare)["healthy"], 10)
        routed = router.backend(spare)["routed"]
        assert [complete(router, f"{i} stars over the desert") for i in range(3)] == [200] * 3
        assert router.backend(spare)["routed"] == routed
        os.kill(spare.proc.pid, signal.SIGCONT)  # it answers again: back in
        assert wait_until(lambda: router.backend(spare)["healthy"], 10)
        assert complete(router, "Rivers run to the sea and the sea never fills") == 200
        assert router.backend(spare)["routed"] == routed + 1  # (the other had three more)
        spare.proc.kill()
        spare.proc.wait()
        # at once, before a health check sees it: the request that picks it is retried on the live one
        assert [complete(router, f"{i} lanterns in the fog") for i in range(3)] == [200] * 3
        assert not router.backend(spare)["healthy"] and http().get(f"{router.url}/health").status_code == 200
        assert router.backend(spare)["routed"] == routed + 1
    finally:
        router.stop()
        spare.stop()


def test_bad_router_flags_name_the_flag(capsys):
    from kvforge.cli import main

    for argv, message in ((["router"], "--backend: give at least one"),
                          (["router", "--backend", "127.0.0.1:8001"], "--backend: must be an http"),
                          (["router", "--backend", "http://a:1", "--load-weight", "-1"], "--load-weight must be"),
                          (["router", "--backend", "http://a:1", "--health-interval", "0"], "--health-interval")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_distributed_md_lists_every_router_flag():
    import argparse

    from kvforge.router.cli import add_router_parser

    subparsers = argparse.ArgumentParser().add_subparsers()
    add_router_parser(subparsers)
    flags = {s for a in subparsers.choices["router"]._actions for s in a.option_strings if s != "--help"} - {"-h"}
    text = DOC.read_text()
    start = text.index("<!-- flags: router -->")
    documented = set(re.findall(r"^\| `(--[a-z-]+)`", text[start:text.index("\n\n", start)], re.M))
    assert documented == flags
