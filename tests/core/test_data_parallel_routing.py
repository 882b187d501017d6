"""``DataParallelEngine`` (two CPU replicas as Ray actors, tiny model) routes by prefix: prompts that share a
prefix go to the replica that holds it (its prefix-cache hits say so; least-busy routing alone would send them
to the other, idle one), the replicas' KV events reach the front end's index and log, and distinct prompts sent
at once still spread over both."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.prefix_router import prompt_block_hashes
from kvforge.sampling_params import SamplingParams

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def dp():
    from kvforge.engine.data_parallel import DataParallelEngine

    config = EngineConfig.create(None, model="dummy:tiny", device="cpu", max_model_len=256,
                                 num_gpu_blocks_override=64, enable_kv_events=True)
    engine = DataParallelEngine(config, 2)
    engine.start()
    yield engine
    engine.shutdown()


def complete(dp, prompts: list[list[int]], max_tokens: int = 4) -> None:
    """Run the prompts at once, each to its end."""
    async def one(i: int, prompt: list[int]) -> None:
        async for _ in dp.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{time.time()}-{i}"):
            pass

    async def main() -> None:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    asyncio.run(main())


def hits(dp) -> list[int]:
    return [s["prefix_cache_hits"] for s in ray.get([r.stats.remote() for r in dp.replicas])]


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_shared_prefix_goes_to_its_holder_and_distinct_prompts_spread(dp):
    prefix = list(range(100, 164))  # four blocks of 16
    complete(dp, [prefix + [1, 2, 3]])
    assert sorted(dp.routed) == [0, 1]
    holder = dp.routed.index(1)
    hashes = prompt_block_hashes(prefix, 16)
    # the holder's BlockStored events, read from the replica, not only the prompt replayed at routing time
    assert wait_until(lambda: set(hashes) <= dp.prefixes[holder].held.get("GPU", set()), 10)
    before = hits(dp)
    for k in range(3):  # one after another: both replicas idle each time
        complete(dp, [prefix + [10 + k]])
    assert dp.routed[holder] == 4 and dp.routed[1 - holder] == 0
    after = hits(dp)
    assert after[holder] - before[holder] == 3 * 64 and after[1 - holder] == before[1 - holder]

    routed = list(dp.routed)
    complete(dp, [[500 + 37 * i + j for j in range(40)] for i in range(4)], max_tokens=8)  # no prefix in common
    assert [a - b for a, b in zip(dp.routed, routed)] == [2, 2]

    def ranks() -> set[int | None]:  # enable_kv_events: every replica's batches, each naming its replica
        page = dp.kv_events_since(0)
        return {b.data_parallel_rank for _, b in page.batches} if page is not None else set()

    assert wait_until(lambda: ranks() == {0, 1}, 10), ranks()
