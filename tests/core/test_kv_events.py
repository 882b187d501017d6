"""KV events (``kvforge.kv_events``): the paged manager and its host tier record what they store and remove,
with the manager's own hashes; the batches encode as vLLM's msgpack structs, page by number in the front end's
log, and reach a ZMQ subscriber; an in-process engine hands them over each step."""
from __future__ import annotations

import socket
import time

import msgspec
import pytest

from kvforge.config import EngineConfig
from kvforge.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventLog,
    decode,
    encode,
    event_from_json,
    event_to_json,
)
from kvforge.kv_tier import TierChain, TierIndex
from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams


def run(kv: PagedKVCacheManager, rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, SamplingParams())
    blocks, _ = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, len(tokens) - len(blocks) * kv.block_size, blocks)
    r.num_computed_tokens = len(tokens)
    return r


def shape(events) -> list[tuple]:
    return [(type(e).__name__, getattr(e, "medium", None), list(getattr(e, "block_hashes", []))) for e in events]


def test_storing_and_evicting_blocks_records_the_manager_s_own_hashes():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4)
    assert kv.enable_kv_events()
    run(kv, "a", list(range(10)))  # two full blocks (and a partial one, never hashed)
    (stored,) = kv.take_kv_events()
    assert stored == BlockStored(kv.hashes["a"], None, list(range(8)), 4, None, "GPU")
    run(kv, "b", [0, 1, 2, 3, 50, 51, 52, 53, 54, 55, 56, 57])  # block 0 is a's: a hit, stored once
    (stored,) = kv.take_kv_events()
    assert kv.hashes["b"][0] == kv.hashes["a"][0]
    assert stored == BlockStored(kv.hashes["b"][1:], kv.hashes["b"][0], list(range(50, 58)), 4, None, "GPU")
    cached = set(kv.hashes["a"]) | set(kv.hashes["b"])
    kv.free("a")
    kv.free("b")
    assert kv.take_kv_events() == []  # freed blocks keep their prefix until they are reused
    run(kv, "c", list(range(100, 124)))  # all six blocks: every cached one is evicted
    removed, stored = kv.take_kv_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "GPU"
    assert sorted(removed.block_hashes) == sorted(cached) and not cached & set(kv.cached)
    assert stored.block_hashes == kv.hashes["c"] and stored.token_ids == list(range(100, 124))


def test_reset_prefix_cache_records_one_all_blocks_cleared():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    kv.enable_kv_events()
    run(kv, "a", list(range(8)))
    kv.free("a")
    kv.take_kv_events()
    assert kv.reset_prefix_cache()
    assert kv.take_kv_events() == [AllBlocksCleared()]


def test_a_manager_without_events_enabled_records_nothing():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    run(kv, "a", list(range(8)))
    kv.free("a")
    run(kv, "b", list(range(20, 36)))
    assert kv.events is None and kv.take_kv_events() == []


def test_the_host_tier_records_its_blocks_under_its_own_medium():
    kv = PagedKVCacheManager(num_blocks=2, block_size=4)
    chain = TierChain([TierIndex(1, medium="CPU")])
    kv.attach_tier(chain)  # (before events: attach_tier and enable_kv_events in any order)
    kv.enable_kv_events()
    run(kv, "a", [1, 2, 3, 4])
    (a0,) = kv.hashes["a"]
    kv.free("a")
    kv.take_kv_events()
    run(kv, "b", list(range(20, 28)))  # an empty block first, then a's: saved to the tier, reused
    assert shape(kv.take_kv_events()) == [("BlockStored", "CPU", [a0]), ("BlockRemoved", "GPU", [a0]),
                                          ("BlockStored", "GPU", kv.hashes["b"])]
    chain.take_transfers()  # a step ran the copies
    b0, b1 = kv.hashes["b"]
    kv.free("b")  # the tail block joins the free queue first: it is reused first
    run(kv, "c", list(range(40, 48)))
    assert shape(kv.take_kv_events()) == [
        ("BlockRemoved", "CPU", [a0]), ("BlockStored", "CPU", [b1]),  # the full tier drops a0 for b1
        ("BlockRemoved", "GPU", [b1, b0]),  # (b0 is not kept: the only slot took b1 in this step)
        ("BlockStored", "GPU", kv.hashes["c"])]


def test_batches_are_vllm_s_msgpack_structs():
    events = [BlockStored([11, -12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"), BlockRemoved([11], "CPU"),
              AllBlocksCleared()]
    batch = EventBatch(1.5, events)
    payload = encode(batch)
    # array-like structs, each event tagged by its class name (vllm.distributed.kv_events' encoding)
    assert msgspec.msgpack.decode(payload) == [1.5, [["BlockStored", [11, -12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4,
                                                     None, "GPU"], ["BlockRemoved", [11], "CPU"],
                                                    ["AllBlocksCleared"]], None]
    assert decode(payload) == batch
    assert [event_from_json(event_to_json(e)) for e in events] == events
    with pytest.raises(ValueError, match="KV event type"):
        event_from_json({"type": "BlockMoved"})


def test_the_log_pages_by_number_and_says_when_batches_were_dropped():
    log = KVEventLog(capacity=3)
    for i in range(5):
        assert log.append(EventBatch(float(i), [])) == i
    page = log.since(0, 10)  # 0 and 1 were dropped
    assert (page.first, page.next, [s for s, _ in page.batches]) == (2, 5, [2, 3, 4])
    assert [b.ts for _, b in page.batches] == [2.0, 3.0, 4.0]
    page = log.since(3, 1)
    assert (page.next, [s for s, _ in page.batches]) == (4, [3])
    assert log.since(5, 10).batches == [] and log.since(5, 10).next == 5
    assert log.since(9, 10).next == 5  # asked past the end: a restarted log, whose numbers start again


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_zmq_subscriber_decodes_every_batch_with_its_number():
    import zmq

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = KVEventLog.for_config(EngineConfig(kv_events_endpoint=endpoint))
    assert log is not None and log.publisher is not None
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # a subscription takes a moment to reach the publisher: batches meanwhile are lost
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            log.append(EventBatch(0.0, []))
        while sub.poll(200):  # (the warm-up batches)
            sub.recv_multipart()
        batches = [EventBatch(float(i), [BlockRemoved([i], "GPU")]) for i in range(3)]
        seqs = [log.append(b) for b in batches]
        got = [sub.recv_multipart() for _ in batches]
        assert [(topic, int.from_bytes(seq, "big"), decode(payload)) for topic, seq, payload in got] == [
            (b"", s, b) for s, b in zip(seqs, batches)]
        with pytest.raises(ValueError, match="kv_events_endpoint: cannot bind"):  # the port is taken
            KVEventLog.for_config(EngineConfig(kv_events_endpoint=endpoint))
    finally:
        sub.close(linger=0)
        log.close()


def test_the_endpoint_option_is_checked_and_turns_events_on():
    with pytest.raises(ValueError, match="kv_events_endpoint must be a ZMQ endpoint"):
        EngineConfig(kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ValueError, match="enable_kv_events must be true or false"):
        EngineConfig(enable_kv_events=1)  # type: ignore[arg-type]
    assert EngineConfig(kv_events_endpoint="ipc:///tmp/kvforge-events").enable_kv_events
    assert KVEventLog.for_config(EngineConfig()) is None


def test_an_in_process_engine_logs_each_step_s_events():
    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge.engine.prefix_router import prompt_block_hashes

    config = EngineConfig.create(None, model="dummy:tiny", device="cpu", max_model_len=128,
                                 num_gpu_blocks_override=16, enable_kv_events=True)
    engine = AsyncLLMEngine(LLMEngine(config), owns_engine=True)
    prompt = list(range(1, 41))  # two full blocks of 16

    async def generate() -> None:
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), "r"):
            pass

    engine.start()
    try:
        import asyncio
        asyncio.run(generate())
        page = engine.kv_events_since(0)
        assert page is not None and page.batches
        stored = [e for _, b in page.batches for e in b.events if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes] == prompt_block_hashes(prompt, 16)
        assert stored[0].token_ids == prompt[:32] and stored[0].medium == "GPU"
    finally:
        engine.shutdown()
