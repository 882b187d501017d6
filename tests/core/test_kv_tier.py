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
from kvforge.kv_tier import TierChain, TierIndex
from kvforge.rank.swap import CPUSwapSpace, StoreCopies, transfer

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
    assert 'kvforge:prefix_cache_tier_hits_by_tier_total{model_name="m",tier="cpu"} 512.0' in text
    assert 'kvforge:prefix_cache_tier_hits_by_tier_total{model_name="m",tier="disk"} 0.0' in text
    assert f'kvforge:kv_tier_blocks{{model_name="m",tier="cpu"}} {float(stats.tier_held_blocks)}' in text
    assert f'kvforge:kv_tier_stored_blocks_total{{model_name="m"}} {float(stats.tier_stored_blocks)}' in text


def test_a_tier_too_small_to_help_keeps_the_tokens_right(reference):
    tiered, stats, _ = multi_turn(kv_offload_cpu_gib=0.005)  # 7 slots: every block dropped before it is asked for
    assert tiered == reference and stats.tier_held_blocks == stats.tier_slots == 7 and stats.tier_stored_blocks > 7


def test_the_index_drops_its_oldest_never_a_pinned_one_and_checks_tokens():
    tier = TierChain([TierIndex(2)])
    tier.save(11, (1, 2), device_block=5)
    tier.save(12, (3, 4), device_block=6)
    assert not tier.contains(11, (1, 2))  # saved in this step: its copy is made at the step's start, after any read
    tier.save(11, (1, 2), device_block=7)  # held already: refreshed, not copied again
    assert tier.take_transfers().saves == [(0, 5, 0), (0, 6, 1)] and not tier.take_transfers()
    assert tier.contains(11, (1, 2)) and not tier.contains(11, (1, 9))  # a collision is no hit
    tier.pinned = {12}
    tier.save(13, (5, 6), device_block=8)  # full: drops 11 (12 is older, but pinned)
    assert not tier.contains(11, (1, 2)) and tier.contains(12, (3, 4))
    tier.pinned = set()
    tier.save(14, (7, 8), device_block=9)  # drops 12, never 13: saved in this step, its copy not made yet
    assert not tier.contains(12, (3, 4)) and tier.take_transfers().saves == [(0, 8, 0), (0, 9, 1)]
    tier.pinned = {13, 14}
    tier.save(15, (9, 9), device_block=3)  # every slot pinned: not kept
    assert not tier.contains(15, (9, 9))
    tier.load(13, device_block=2)
    ops = tier.take_transfers()
    assert ops.saves == [] and ops.loads == [(0, 0, 2)]


class _Files(TierIndex):
    """A persistent tier of slots: the ranks hear of what it forgets, and get its blocks' tokens."""

    persistent = True


def test_a_block_the_first_tier_drops_moves_down_the_chain_and_the_last_tiers_files_go():
    chain = TierChain([TierIndex(1), _Files(1, medium="DISK")])
    chain.save(1, (10,), device_block=4)
    assert chain.take_transfers().saves == [(0, 4, 0)]
    chain.save(2, (20,), device_block=5)  # the first tier is full: block 1 moves down, read before 2 takes its slot
    ops = chain.take_transfers()
    assert ops.saves == [(0, 5, 0)] and ops.moves == [(0, 0, 0)] and ops.tokens == [(1, 0, (10,))] and not ops.drops
    chain.save(3, (30,), device_block=6)  # 2 moves down and pushes 1 out of the last tier: the ranks drop it
    ops = chain.take_transfers()
    assert ops.moves == [(0, 0, 0)] and ops.drops == [(1, 0)] and ops.tokens == [(1, 0, (20,))]
    assert not chain.contains(1, (10,)) and chain.contains(2, (20,)) and chain.contains(3, (30,))
    chain.load(2, device_block=7)  # from the tier that holds it
    chain.persist(2, (20,), device_block=7)  # a hit on it, loaded in this step (not filled yet): no copy
    chain.persist(3, (30,), device_block=8)  # a hit the persistent tier lacks: copied there, pushing 2 out
    ops = chain.take_transfers()  # (2's file is read at the step's start, dropped at its end)
    assert ops.loads == [(1, 0, 7)] and ops.saves == [(1, 8, 0)] and ops.drops == [(1, 0)] and not ops.moves
    assert ops.tokens == [(1, 0, (30,))]
    chain.persist(3, (30,), device_block=8)  # held there now: refreshed, not copied again
    assert not chain.take_transfers()
    counts = chain.counts()
    assert counts.loaded_by_tier == {"cpu": 0, "disk": 1} and counts.held_by_tier == {"cpu": 1, "disk": 1}
    chain.save(9, (90,), device_block=1)  # 3 goes down to the tier that holds it already: refreshed there
    ops = chain.take_transfers()
    assert ops.saves == [(0, 1, 0)] and not ops.moves and not ops.drops and chain.contains(3, (30,))
    chain.clear()  # the persistent tier's blocks are dropped on the ranks too
    assert chain.take_transfers().drops == [(1, 0)] and chain.counts().held == 0


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
    transfer(dev, [StoreCopies(swap, ins=[(0, 1)]), StoreCopies(tier, outs=[(3, 0), (1, 1)], ins=[(0, 3)])])
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
