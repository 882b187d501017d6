import pytest

from kvforge import kv_cache as kv_mod
from kvforge.plugins.kv_cache import paged as paged_mod
from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def run(kv, r, n):
    """Allocate n new tokens for r and mark them computed (what the scheduler + update do)."""
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n


def test_allocation_on_demand_and_free():
    kv = PagedKVCacheManager(num_blocks=8, block_size=16)
    r = req("a", range(20))
    run(kv, r, 20)
    assert len(kv.block_table("a")) == 2
    for t in range(12):  # fill the second block up to 32 tokens: no new block
        r.output_token_ids.append(t)
        run(kv, r, 1)
    assert len(kv.block_table("a")) == 2
    r.output_token_ids.append(1)
    run(kv, r, 1)
    assert len(kv.block_table("a")) == 3
    assert kv.stats().num_used_blocks == 3
    kv.free("a")
    s = kv.stats()
    assert s.num_used_blocks == 0 and s.num_free_blocks == 8
    assert all(kv.ref_count(b) == 0 for b in range(8))


def test_allocation_failure_changes_nothing():
    kv = PagedKVCacheManager(num_blocks=2, block_size=16)
    r = req("a", range(40))
    assert not kv.allocate_slots(r, 40)
    assert kv.block_table("a") == [] and kv.stats().num_free_blocks == 2


def test_prefix_cache_hit_and_cap():
    kv = PagedKVCacheManager(num_blocks=16, block_size=16)
    a = req("a", range(64))
    run(kv, a, 64)
    a_table = list(kv.block_table("a"))
    kv.free("a")
    b = req("b", list(range(64)) + [999] * 6)
    blocks, n = kv.get_computed_blocks(b)
    assert n == 64 and blocks == a_table
    assert kv.allocate_slots(b, 6, blocks)
    assert kv.block_table("b")[:4] == a_table
    s = kv.stats()
    assert s.prefix_cache_hits == 64 and s.prefix_cache_queries == 64 + 70
    # a prompt that is exactly the cached prefix still leaves one token to compute
    c = req("c", range(64))
    blocks, n = kv.get_computed_blocks(c)
    assert n == 48
    kv.free("b")
    assert kv.stats().num_used_blocks == 0


def test_prefix_cache_disabled():
    kv = PagedKVCacheManager(num_blocks=16, block_size=16, enable_prefix_caching=False)
    run(kv, req("a", range(64)), 64)
    kv.free("a")
    assert kv.get_computed_blocks(req("b", range(70))) == ([], 0)


def test_hash_collision_is_guarded(monkeypatch):
    monkeypatch.setattr(paged_mod, "hash_block", lambda parent, tokens, extra=None: 42)
    kv = PagedKVCacheManager(num_blocks=8, block_size=4)
    run(kv, req("a", [1, 2, 3, 4, 5]), 5)
    kv.free("a")
    blocks, n = kv.get_computed_blocks(req("b", [9, 9, 9, 9, 9]))
    assert (blocks, n) == ([], 0)
    blocks, n = kv.get_computed_blocks(req("c", [1, 2, 3, 4, 7]))
    assert n == 4


def test_lru_eviction_prefers_oldest_freed_cached_block():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    run(kv, req("a", range(0, 4)), 4)  # 1 block, cached when freed... full block hashed
    run(kv, req("b", range(10, 14)), 4)
    kv.free("a")
    kv.free("b")
    # 2 blocks never used come first; then a's (older) block is evicted before b's
    run(kv, req("c", range(20, 32)), 12)  # needs 3 blocks
    assert kv.get_computed_blocks(req("a2", list(range(0, 4)) + [0]))[1] == 0
    assert kv.get_computed_blocks(req("b2", list(range(10, 14)) + [0]))[1] == 4


def test_fork_copy_on_write():
    kv = PagedKVCacheManager(num_blocks=8, block_size=16)
    p = req("p", range(20))
    run(kv, p, 20)
    kv.fork("p", "c")
    t = kv.block_table("p")
    assert kv.block_table("c") == t and all(kv.ref_count(b) == 2 for b in t)
    c = req("c", range(20))
    c.num_computed_tokens = 20
    c.output_token_ids.append(7)
    run(kv, c, 1)  # writes into the shared partial block: it is copied first
    ct = kv.block_table("c")
    assert ct[0] == t[0] and ct[1] != t[1]
    assert kv.take_copies() == [(t[1], ct[1])]
    assert kv.ref_count(t[0]) == 2 and kv.ref_count(t[1]) == 1 and kv.ref_count(ct[1]) == 1
    kv.free("p")
    kv.free("c")
    assert kv.stats().num_used_blocks == 0


def test_fork_errors():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="unknown request"):
        kv.fork("nope", "x")


def test_hash_chain_depends_on_parent():
    assert kv_mod.hash_block(None, [1, 2]) != kv_mod.hash_block(kv_mod.hash_block(None, [0]), [1, 2])
