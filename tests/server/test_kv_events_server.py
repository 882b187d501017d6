"""KV events through `kvforge serve` (the engine in its engine core process: the events cross the process
boundary in ``StepOutputs``): ``GET /kv_events`` holds the blocks a completion stored, with the hashes the
engine's hash function gives the prompt's tokens, pages by ``since``, and a ZMQ subscriber gets the same
batches, numbered alike."""
from __future__ import annotations

import httpx
import pytest

from conftest import API_KEY, ServerProcess, free_port
from kvforge.engine.prefix_router import prompt_block_hashes
from kvforge.kv_events import decode, event_to_json

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = ("A lighthouse keeper counts the ships that pass in the night, writes each name in a worn book, "
          "and wonders where the sailors are going, what cargo they carry, who waits for them on the far "
          "shore, and whether any of them ever looks back at the small light on the rocks")


@pytest.fixture(scope="module")
def events_server():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    s = ServerProcess("--api-key", API_KEY, "--enable-kv-events", "--kv-events-endpoint", endpoint)
    s.endpoint = endpoint
    yield s
    assert s.stop() == 0


@pytest.fixture
def subscriber(events_server):
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(events_server.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    yield sub
    sub.close(linger=0)


def page(server, since: int, limit: int = 1000) -> dict:
    r = httpx.get(f"{server.url}/kv_events", params={"since": since, "limit": limit}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def complete(server, prompt: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_completion_s_blocks_arrive_over_http_and_zmq_with_the_engine_s_hashes(events_server, subscriber):
    import time

    # the subscription needs a moment to reach the server's socket: send completions until a batch comes
    start = page(events_server, 0)["next"]
    deadline = time.monotonic() + 20
    while not subscriber.poll(100):
        assert time.monotonic() < deadline, "no KV event batch reached the ZMQ subscriber"
        complete(events_server, f"warm-up {time.monotonic()}: {PROMPT}")
    while subscriber.poll(500):  # what the warm-up sent
        subscriber.recv_multipart()
    ids = httpx.post(f"{events_server.url}/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()["tokens"]
    before = page(events_server, 0)["next"]
    complete(events_server, PROMPT)
    answer = page(events_server, before)
    assert answer["enabled"] and answer["block_size"] == 16 and answer["next"] > before >= start
    stored = [e for b in answer["batches"] for e in b["events"] if e["type"] == "BlockStored"]
    expected = prompt_block_hashes(ids, 16)
    assert len(expected) >= 2 and [h for e in stored for h in e["block_hashes"]] == expected
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == ids[:16 * len(expected)]
    assert all(e["medium"] == "GPU" and e["block_size"] == 16 and e["lora_id"] is None for e in stored)
    got = {}
    while len(got) < len(answer["batches"]):  # the same batches, numbered alike, on the socket
        assert subscriber.poll(5000), f"ZMQ had {sorted(got)} of {[b['seq'] for b in answer['batches']]}"
        topic, seq, payload = subscriber.recv_multipart()
        got[int.from_bytes(seq, "big")] = decode(payload)
    for b in answer["batches"]:
        assert [event_to_json(e) for e in got[b["seq"]].events] == b["events"] and got[b["seq"]].ts == b["ts"]


def test_pages_follow_since_and_limit(events_server):
    for i in range(3):
        complete(events_server, f"{i} apples and {i} pears: {PROMPT}")
    whole = page(events_server, 0)
    assert whole["first"] == 0 and len(whole["batches"]) == whole["next"] >= 3
    walked, since = [], 0
    while since < whole["next"]:
        one = page(events_server, since, limit=1)
        assert len(one["batches"]) == 1 and one["next"] == since + 1
        walked += one["batches"]
        since = one["next"]
    assert walked == whole["batches"][:len(walked)] and [b["seq"] for b in walked] == list(range(whole["next"]))
    beyond = page(events_server, whole["next"] + 100)
    assert beyond["batches"] == [] and beyond["next"] < whole["next"] + 100  # (a router restarts from here)


def test_bad_parameters_are_400s_naming_them_and_the_key_is_required(events_server):
    for params, field in (({"since": -1}, "since"), ({"since": "x"}, "since"), ({"limit": 0}, "limit")):
        r = httpx.get(f"{events_server.url}/kv_events", params=params, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.get(f"{events_server.url}/kv_events").status_code == 401  # token ids of prompts: not public
