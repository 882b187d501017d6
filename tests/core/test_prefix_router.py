"""The routing score shared by the data-parallel front end and ``kvforge router`` (``kvforge.engine.prefix_router``):
a prompt's block hashes are the paged manager's, a replica's index follows its events and the prompts sent to it,
and the best replica is the holder of the prefix until its load outweighs the hit."""
from __future__ import annotations

import pytest

from kvforge.engine.prefix_router import (
    REPLAYED_MAX,
    Candidate,
    PrefixIndex,
    best,
    check_load_weight,
    prompt_block_hashes,
)
from kvforge.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams


def test_prompt_hashes_are_the_paged_manager_s():
    kv = PagedKVCacheManager(num_blocks=8, block_size=16)
    tokens = list(range(7, 7 + 53))  # three full blocks and a partial one
    assert kv.allocate_slots(Request("a", tokens, SamplingParams()), len(tokens))
    assert prompt_block_hashes(tokens, 16) == kv.hashes["a"] and len(kv.hashes["a"]) == 3
    assert prompt_block_hashes(tokens[:15], 16) == []


def stored(hashes, medium="GPU"):
    return BlockStored(list(hashes), None, [], 16, None, medium)


def test_the_index_counts_leading_blocks_held_in_any_tier():
    idx = PrefixIndex()
    idx.apply(EventBatch(0.0, [stored([1, 2, 3]), stored([4], "CPU")]))
    assert idx.matched([1, 2, 3, 4, 5]) == 4
    assert idx.matched([2, 3]) == 2 and idx.matched([9, 1, 2]) == 0  # leading blocks only
    idx.apply(EventBatch(1.0, [BlockRemoved([2], "GPU")]))
    assert idx.matched([1, 2, 3]) == 1  # the chain is cut where a block went
    idx.apply(EventBatch(2.0, [stored([2], "CPU")]))  # moved to the host tier: still a hit
    assert idx.matched([1, 2, 3, 4]) == 4 and len(idx) == 4
    idx.apply(EventBatch(3.0, [AllBlocksCleared()]))
    assert idx.matched([1]) == 0 and len(idx) == 0


def test_replayed_prompts_count_until_their_events_arrive_and_are_bounded():
    idx = PrefixIndex()
    idx.replay([10, 11])
    assert idx.matched([10, 11, 12]) == 2
    idx.apply(EventBatch(0.0, [stored([10, 11])]))
    assert not idx.replayed  # the events know them now: an eviction takes them out
    idx.apply(EventBatch(1.0, [BlockRemoved([11], "GPU")]))
    assert idx.matched([10, 11]) == 1
    idx.replay(range(REPLAYED_MAX + 5))
    assert len(idx.replayed) == REPLAYED_MAX and idx.matched([0]) == 0 and idx.matched([REPLAYED_MAX + 4]) == 1


def test_the_holder_wins_until_its_load_outweighs_the_hit():
    def pick(matched_a, load_a, load_b, weight):
        return best([Candidate(0, matched_a, load_a), Candidate(1, 0, load_b)], weight).index

    assert pick(4, 0, 0, 1.0) == 0
    assert pick(4, 3, 0, 1.0) == 0  # 4 - 3 > 0
    assert pick(4, 4, 0, 1.0) == 1  # a tie of scores: the less loaded
    assert pick(4, 5, 0, 1.0) == 1  # the hot prefix spills over
    assert pick(4, 1, 0, 5.0) == 1  # a heavier load weight spills sooner
    assert pick(4, 50, 0, 0.0) == 0  # weight 0: prefix only


def test_without_a_hit_the_least_loaded_then_the_least_routed_wins():
    assert best([Candidate(0, 0, 2, routed=0), Candidate(1, 0, 1, routed=9)]).index == 1
    assert best([Candidate(0, 0, 1, routed=5), Candidate(1, 0, 1, routed=4)]).index == 1
    assert best([]) is None


def test_the_load_weight_is_checked():
    assert check_load_weight(2) == 2.0
    for bad in (-1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="--load-weight must be a finite number >= 0"):
            check_load_weight(bad, "--load-weight")  # type: ignore[arg-type]
