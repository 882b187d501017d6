"""The paged manager's CPU pool: swap_out / swap_in bookkeeping."""
import pytest

from kvforge.kv_cache import KVCacheManager
from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams


def run(kv, r, n):
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def test_swap_out_and_in_move_blocks_between_pools():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    r = req("a", range(10))
    run(kv, r, 10)
    table = list(kv.block_table("a"))
    out = kv.swap_out("a")
    assert [d for d, _ in out] == table and len({c for _, c in out}) == 3
    s = kv.stats()
    assert s.num_used_blocks == 0 and s.num_free_cpu_blocks == 1 and s.num_swapped_out_blocks == 3
    assert kv.block_table("a") == []
    back = kv.swap_in("a")
    assert [c for c, _ in back] == [c for _, c in out]  # same logical order
    assert kv.block_table("a") == [d for _, d in back]
    assert kv.stats().num_free_cpu_blocks == 4 and kv.stats().num_swapped_in_blocks == 3
    # the request goes on growing from where it was; its newly full block is hashed
    r.output_token_ids += [1, 2, 3]
    run(kv, r, 3)
    assert len(kv.block_table("a")) == 4 and kv.blocks[kv.block_table("a")[2]].hash is not None
    kv.free("a")
    assert kv.stats().num_used_blocks == 0


def test_no_room_returns_none_and_changes_nothing():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=2)
    run(kv, req("a", range(12)), 12)
    assert kv.swap_out("a") is None
    assert len(kv.block_table("a")) == 3 and kv.stats().num_free_cpu_blocks == 2
    kv.free("a")
    run(kv, req("b", range(8)), 8)
    kv.swap_out("b")
    run(kv, req("c", range(100, 112)), 12)  # takes 3 of the 4 device blocks
    assert kv.swap_in("b") is None
    assert kv.stats().num_free_cpu_blocks == 0 and kv.block_table("b") == []


def test_shared_block_is_copied_and_stays_for_its_other_owner():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=8)
    run(kv, req("p", range(6)), 6)
    kv.fork("p", "c")
    shared = kv.block_table("p")
    out = kv.swap_out("c")
    assert [d for d, _ in out] == shared
    assert all(kv.ref_count(b) == 1 for b in shared) and kv.block_table("p") == shared
    back = kv.swap_in("c")
    assert not set(d for _, d in back) & set(shared)  # the child's own copies now
    kv.free("p")
    kv.free("c")
    assert kv.stats().num_used_blocks == 0


def test_free_releases_cpu_blocks_of_a_swapped_request():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    run(kv, req("a", range(9)), 9)
    kv.swap_out("a")
    kv.free("a")
    s = kv.stats()
    assert s.num_free_cpu_blocks == 4 and s.num_used_blocks == 0
    with pytest.raises(ValueError, match="not swapped out"):
        kv.swap_in("a")
    with pytest.raises(ValueError, match="holds no device blocks"):
        kv.swap_out("a")


def test_without_a_cpu_pool_swap_out_declines():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4)
    run(kv, req("a", range(9)), 9)
    assert kv.swap_out("a") is None and kv.stats().num_cpu_blocks == 0


def test_contract_defaults_decline_swapping():
    class Minimal(PagedKVCacheManager):
        swap_out = KVCacheManager.swap_out
        swap_in = KVCacheManager.swap_in

    kv = Minimal(num_blocks=4, block_size=4, num_cpu_blocks=4)
    assert kv.swap_out("x") is None and kv.swap_in("x") is None
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        PagedKVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=-1)
