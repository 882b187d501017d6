"""Piecewise CUDA graphs' buckets and when an engine uses them (the graphs themselves run in
tests/gpu/test_piecewise_graphs_gpu.py; the cut of every family's forward in
tests/plugins/models/test_architectures.py)."""
from __future__ import annotations

import pytest

from kvforge.config import EngineConfig
from kvforge.rank.piecewise_graphs import bucket_of, piecewise_sizes


def test_buckets_pad_a_step_by_at_most_an_eighth_past_256_tokens():
    sizes = piecewise_sizes(2048)
    assert sizes[:8] == [32, 64, 96, 128, 160, 192, 224, 256] and sizes[-1] == 2048
    assert sizes == sorted(set(sizes))
    for n in range(257, 2049):
        b = bucket_of(sizes, n)
        assert b is not None and n <= b and (b - n) / n < 0.5 and (b - n) <= 256
    assert bucket_of(sizes, 1) == 32 and bucket_of(sizes, 33) == 64 and bucket_of(sizes, 257) == 384
    assert bucket_of(sizes, 2049) is None and bucket_of(sizes, 0) is None
    assert piecewise_sizes(200)[-1] == 200 and piecewise_sizes(16) == [16]  # a step's budget ends them


@pytest.mark.parametrize("options,tokens", [
    ({}, 2048),
    ({"max_num_batched_tokens": 512}, 512),  # never more than a step can hold
    ({"tensor_parallel_size": 2}, 0),  # not measured on several GPUs yet: asked for, not by default
    ({"tensor_parallel_size": 2, "max_piecewise_graph_tokens": 1024}, 1024),
    ({"pipeline_parallel_size": 2, "max_piecewise_graph_tokens": 1024}, 0),  # stages hand over outside graphs
    ({"enable_lora": True}, 0),
    ({"max_piecewise_graph_tokens": 0}, 0),
])
def test_an_engine_replays_mixed_steps_up_to_the_resolved_bucket(options, tokens):
    assert EngineConfig(**options).piecewise_graph_tokens() == tokens


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2048"])
def test_a_bad_piecewise_bound_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="max_piecewise_graph_tokens"):
        EngineConfig(max_piecewise_graph_tokens=bad)
