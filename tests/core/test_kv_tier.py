"""A host tier of prefix-cached KV blocks (issue 40, `kv_offload_cpu_gib`): blocks the device pool reuses
are saved by prefix hash and loaded again by a later request with the same prefix, with exactly the tokens
of a run without any prefix caching; the index's LRU, pins and collision guard; one step's copies read
every source before writing any block."""
from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.kv_tier import TierIndex
from kvforge.rank.swap import CPUSwapSpace, transfer

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def multi_turn(**engine_args) -> tuple[list[list[int]], Any, dict]:
    """8 sessions sharing a 96-token system prompt, each with 64 tokens of its own, two turns each, one
    request at a time: about 38 distinct blocks through a pool of 24. Returns the tokens, the KV manager's
    stats and the engine's."""
    rng = random.Random(0)
    system = [rng.randrange(100, 20000) for _ in range(96)]
    sessions = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(8)]
    llm = LLM(device="cpu", max_model_len=256, num_gpu_blocks_override=24, block_size=16, **engine_args)
    try:
        outs = [list(llm.generate([system + s + [7] * turn], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
                for turn in range(2) for s in sessions]
        return outs, llm.llm_engine.kv_cache.stats(), dict(llm.llm_engine.get_stats())
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference():
    return multi_turn(enable_prefix_caching=False)[0]


def test_prefixes_the_pool_reused_come_back_from_the_tier_with_the_same_tokens(reference):
    plain, plain_stats, _ = multi_turn()
    tiered, stats, engine_stats = multi_turn(kv_offload_cpu_gib=0.05)  # ~70 slots of this model's 737 KB blocks
    assert plain == reference and tiered == reference
    assert plain_stats.tier_hits == 0 and stats.tier_hits == 32 * 16  # each session's second turn: 4 blocks
    assert stats.prefix_cache_hits == plain_stats.prefix_cache_hits + stats.tier_hits
    assert 0 < stats.tier_held_blocks <= stats.tier_slots and stats.num_used_blocks == 0
    pytest.importorskip("prometheus_client")
    from kvforge.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: engine_stats, "m").render().decode()
    assert 'kvforge:prefix_cache_tier_hits_total{model_name="m"} 512.0' in text
    assert f'kvforge:kv_tier_stored_blocks_total{{model_name="m"}} {float(stats.tier_stored_blocks)}' in text


def test_a_tier_too_small_to_help_keeps_the_tokens_right(reference):
    tiered, stats, _ = multi_turn(kv_offload_cpu_gib=0.005)  # 7 slots: every block dropped before it is asked for
    assert tiered == reference and stats.tier_held_blocks == stats.tier_slots == 7 and stats.tier_stored_blocks > 7


def test_the_index_drops_its_oldest_never_a_pinned_one_and_checks_tokens():
    tier = TierIndex(2)
    tier.save(11, (1, 2), device_block=5)
    tier.save(12, (3, 4), device_block=6)
    tier.save(11, (1, 2), device_block=7)  # held already: refreshed, not copied again
    assert tier.take_transfers() == ([(5, 0), (6, 1)], []) and tier.take_transfers() == ([], [])
    assert tier.contains(11, (1, 2)) and not tier.contains(11, (1, 9))  # a collision is no hit
    tier.pinned = {12}
    tier.save(13, (5, 6), device_block=8)  # full: drops 11 (12 is older, but pinned)
    assert not tier.contains(11, (1, 2)) and tier.contains(12, (3, 4)) and tier.contains(13, (5, 6))
    tier.pinned = {12, 13}
    tier.save(14, (7, 8), device_block=9)  # every slot pinned: not kept
    assert not tier.contains(14, (7, 8))
    tier.load(12, device_block=2)
    assert tier.take_transfers() == ([(8, 0)], [(1, 2)])


class _Backend:
    """What the pools need of an attention backend: a layer's cache shape on the CPU."""

    device = torch.device("cpu")
    kv_cache_dtype = torch.float32

    @staticmethod
    def kv_cache_shape(n: int) -> tuple[int, ...]:
        return (2, n, 4, 1, 2)


def test_one_steps_copies_read_every_source_before_any_write():
    """Block 3 is reused (its old contents saved to slot 0) and refilled from slot 0's old contents in the
    same step; a swap-in writes block 1 while the tier saves block 1's old contents."""
    dev = [torch.arange(2 * 5 * 8, dtype=torch.float32).view(2, 5, 4, 1, 2)]
    old = dev[0].clone()
    tier, swap = CPUSwapSpace(_Backend(), 1, 2), CPUSwapSpace(_Backend(), 1, 2)  # type: ignore[arg-type]
    tier.ready()[0].fill_(-1.0)
    swap.ready()[0].fill_(-2.0)
    transfer(dev, [(swap, [], [(0, 1)]), (tier, [(3, 0), (1, 1)], [(0, 3)])])
    assert torch.equal(tier.caches[0][:, 0], old[:, 3]) and torch.equal(tier.caches[0][:, 1], old[:, 1])
    assert (dev[0][:, 3] == -1).all() and (dev[0][:, 1] == -2).all() and torch.equal(dev[0][:, 0], old[:, 0])


def test_a_third_party_connector_selected_by_name_gets_its_options_and_keeps_the_tokens(reference,
                                                                                           dummy_plugin_installed):
    """The dummy plugin's connector (its own host tensors, a slot cap from ``[plugins.dummy_tier]``, an index
    that counts its loads) proves the contract: the same tokens, its loads counted, its cap held."""
    from kvforge_dummy_plugin.components import CountingTier

    before = CountingTier.loads
    tiered, stats, _ = multi_turn(kv_connector="dummy_tier", kv_offload_cpu_gib=0.05,
                                  plugins={"dummy_tier": {"max_slots": 40}})
    assert tiered == reference and stats.tier_slots == 40 and stats.tier_hits == 32 * 16
    assert CountingTier.loads - before == 32
    with pytest.raises(ValueError, match="no_such_tier"):
        LLM("dummy:tiny", device="cpu", num_gpu_blocks_override=16, kv_connector="no_such_tier")
