"""The engine core in its own process (``EngineProcessClient``, what ``kvforge serve`` runs): the same
tokens as the engine on a thread, bad input refused before any stream, an abandoned stream frees its
blocks, a dead core process fails every open stream at once, and a start-up error reaches the caller."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.async_engine import EngineDeadError
from kvforge.engine.process import EngineProcessClient
from kvforge.sampling_params import StructuredOutputsParams

ENGINE = dict(model="dummy:tiny", device="cpu", max_model_len=256, num_gpu_blocks_override=64)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, my name is", "1, 2, 3, 4, 5,"]


def _client() -> EngineProcessClient:
    client = EngineProcessClient(EngineConfig.create(None, **ENGINE))
    client.start()
    return client


@pytest.fixture(scope="module")
def client():
    c = _client()
    yield c
    c.shutdown()
    assert c.proc.poll() is not None  # no process left behind


async def _collect(client, prompt, params, rid):
    ids = []
    async for out in client.generate(prompt, params, rid):
        ids += out.outputs[0].token_ids
    return ids


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_engine_process_streams_equal_the_engine_on_a_thread(client):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(_collect(client, p, params, f"r{i}") for i, p in enumerate(PROMPTS)))

    got = asyncio.run(main())
    ref = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(PROMPTS, params, use_tqdm=False)]
    assert got == ref and all(len(ids) == 24 for ids in got)
    stats = client.get_stats()  # a call into the core process
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_generation_tokens"] >= 4 * 24


def test_bad_request_is_a_value_error_naming_the_field_before_any_stream(client):
    async def main():
        with pytest.raises(ValueError, match="^logprobs: .*max_logprobs"):
            await client.add_request("Hi", SamplingParams(max_tokens=4, logprobs=10_000), "bad")
        with pytest.raises(ValueError, match="^prompt: token ids must be in"):
            await client.add_request([10 ** 9], SamplingParams(max_tokens=4), "bad")  # the id is free again
    asyncio.run(main())
    with pytest.raises(ValueError, match="^structured_outputs: invalid constraint"):
        client.check_structured_outputs(StructuredOutputsParams(json="{not json"))


def test_abandoned_stream_aborts_the_request_and_frees_its_blocks(client):
    async def main():
        stream = await client.add_request("Tell me a story.", SamplingParams(max_tokens=200, ignore_eos=True), "long")
        got = 0
        async for out in stream:
            got += len(out.outputs[0].token_ids)
            if got >= 3:
                break
        await stream.aclose()
        return got
    assert asyncio.run(main()) >= 3
    assert _wait(lambda: client.get_stats()["num_running"] == 0, 10)
    stats = client.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_killed_core_process_fails_open_streams_and_stops_the_client():
    client = _client()
    try:
        async def main():
            stream = await client.add_request("Go on forever.", SamplingParams(max_tokens=250, ignore_eos=True), "r")
            async for _ in stream:
                os.kill(client.pid, signal.SIGKILL)
            return "finished"
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            asyncio.run(main())
        assert time.monotonic() - t0 < 15 and client.dead.is_set() and not client.is_running

        async def after():
            await client.add_request("Hi", SamplingParams(max_tokens=2), "late")
        with pytest.raises(EngineDeadError):
            asyncio.run(after())
    finally:
        client.shutdown()
    assert client.proc.poll() == -signal.SIGKILL


def _core_children() -> list[int]:
    """Live engine core processes started by this process (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid() and b"kvforge.engine.core" in cmd:
            pids.append(int(entry))
    return pids


def test_engine_start_up_error_reaches_the_caller_and_leaves_no_process():
    before = _core_children()
    config = EngineConfig.create(None, **(ENGINE | {"num_gpu_blocks_override": 2, "max_model_len": 2048}))
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the KV cache capacity"):
        EngineProcessClient(config)
    assert _core_children() == before
