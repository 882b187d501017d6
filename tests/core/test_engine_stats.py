"""``EngineStats`` (``kvforge.engine.stats``) is what ``get_stats()`` returns: the keys an engine fills, and
what a data-parallel engine makes of its replicas' (``DataParallelEngine.get_stats``)."""
from __future__ import annotations

import typing

from kvforge.config import EngineConfig
from kvforge.engine.data_parallel import DataParallelEngine
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.stats import COUNT_KEYS, EngineStats


def test_the_count_keys_are_exactly_the_integer_keys():
    hints = typing.get_type_hints(EngineStats)
    assert set(COUNT_KEYS) == {k for k, t in hints.items() if t is int}


def test_an_engine_s_stats_hold_every_key_but_the_data_parallel_one():
    engine = LLMEngine(EngineConfig.create(None, model="dummy:tiny", device="cpu", max_model_len=64,
                                           num_gpu_blocks_override=8))
    try:
        stats = engine.get_stats()
    finally:
        engine.release()
    assert set(stats) == set(EngineStats.__annotations__) - {"data_parallel_routed"}
    assert all(type(stats[k]) is int for k in COUNT_KEYS)
    assert isinstance(stats["kv_cache_usage"], float) and stats["spec_decode"] is None


class _Ref:
    def __init__(self, value):
        self.value = value


class _Method:
    def __init__(self, value):
        self.value = value

    def remote(self, *args):
        return _Ref(self.value)


class _Replica:
    def __init__(self, stats):
        self.stats = _Method(stats)


class _Ray:
    @staticmethod
    def get(refs, timeout=None):
        return [r.value for r in refs]


def _replica_stats(i: int) -> dict:
    counts = {k: 10 * i + n for n, k in enumerate(COUNT_KEYS)}
    return counts | {"kv_cache_usage": 0.25 * i, "waiting_by_priority": {0: i, i: 1}, "spec_decode": None,
                     "rank_batch_requests": [i, i + 1]}


def test_data_parallel_stats_add_the_replicas_up():
    engine = object.__new__(DataParallelEngine)
    parts = [_replica_stats(1), _replica_stats(2)]
    engine._ray, engine.replicas, engine.routed = _Ray(), [_Replica(p) for p in parts], [5, 7]
    total = engine.get_stats()
    assert {k: total[k] for k in COUNT_KEYS} == {k: parts[0][k] + parts[1][k] for k in COUNT_KEYS}
    assert total["kv_cache_usage"] == 0.375
    assert total["waiting_by_priority"] == {0: 3, 1: 1, 2: 1}
    assert total["rank_batch_requests"] == [1, 2, 2, 3] and total["data_parallel_routed"] == [5, 7]
    assert list(total)[:len(parts[0])] == list(parts[0])  # the first replica's keys, in order
    assert parts[0]["num_running"] == 10  # the replicas' own dicts are left as they were
