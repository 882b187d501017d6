"""The ``triton`` backend compiled for the GPU, in bf16, against the ``torch`` reference in float32.

Run on the GPU machine: python -m pytest -m gpu tests/gpu/test_triton_backend_gpu.py
"""
import numpy as np
import pytest
import torch

from kvforge.attention import BatchLayout
from testing_support import random_layout

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

HEADS, KV_HEADS = 32, 8  # GQA 4


def _backends(head_size, block_size, **options):
    from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
    from kvforge.plugins.attention.triton_backend import TritonAttentionBackend

    kw = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=head_size, scale=head_size ** -0.5,
              block_size=block_size, device=torch.device("cuda"))
    return (TorchAttentionBackend(**kw, dtype=torch.float32),
            TritonAttentionBackend(**kw, dtype=torch.bfloat16, **options))


def _rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def _compare(specs, head_size, block_size, seed=0, **options):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    ref, tri = _backends(head_size, block_size, **options)
    num_blocks = sum(-(-(p + q) // block_size) for p, q in specs) + 8
    layout = random_layout(specs, block_size, rng, num_blocks)
    t = layout.num_tokens
    q = torch.randn(t, HEADS, head_size, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, KV_HEADS, head_size, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, KV_HEADS, head_size, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(tri.kv_cache_shape(num_blocks), device="cuda", dtype=torch.bfloat16)
    cache_ref = cache.float()  # the reference sees exactly the bf16 values, in float32
    meta = tri.build_metadata(layout)
    out = tri.forward(q, k, v, cache, meta)
    expect = ref.forward(q.float(), k.float(), v.float(), cache_ref, ref.build_metadata(layout))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert torch.equal(cache.float(), cache_ref)  # the same slots written with the same values
    return _rel_err(out, expect), meta


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_size", [64, 128])
def test_mixed_batch(head_size, block_size):
    specs = [(0, 300), (1000, 200), (37, 5), (0, 1), (100, 1), (2047, 1), (4000, 1)]
    err, _ = _compare(specs, head_size, block_size)
    assert err < 1e-2


@pytest.mark.parametrize("ctx", [4096, 16384])
@pytest.mark.parametrize("block_size", [16, 128])
def test_long_decode_split_k(ctx, block_size):
    specs = [(ctx - 1, 1), (ctx // 2, 1), (ctx - 100, 1)]
    err, meta = _compare(specs, 128, block_size)
    assert meta.num_splits > 1  # 3 sequences x 8 KV heads: split-K
    assert err < 1e-2
    err1, meta1 = _compare(specs, 128, block_size, decode_num_splits=1)
    assert meta1.num_splits == 1 and err1 < 1e-2


def test_decode_replays_in_cuda_graph():
    """A captured decode step stays correct when the contexts change between replays."""
    rng = np.random.default_rng(1)
    ref, tri = _backends(128, 16)
    first, later = [(500, 1), (3000, 1)], [(900, 1), (4000, 1)]
    layout = random_layout(later, 16, rng, 400)
    # the first step uses the same blocks with shorter contexts: only seq_lens and slots differ
    pos = np.array([p for p, _ in first])
    layout0 = BatchLayout(query_start_loc=layout.query_start_loc, seq_lens=pos.astype(np.int32) + 1,
                          block_tables=layout.block_tables,
                          slot_mapping=(layout.block_tables[[0, 1], pos // 16] * 16 + pos % 16).astype(np.int64))
    q = torch.randn(2, HEADS, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, KV_HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache = torch.randn(tri.kv_cache_shape(400), device="cuda", dtype=torch.bfloat16)
    meta = tri.build_metadata(layout0)
    tri.forward(q, k, v, cache, meta)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.forward(q, k, v, cache, meta)
    new = tri.build_metadata(layout)
    meta.seq_lens.copy_(new.seq_lens)
    meta.slot_mapping.copy_(new.slot_mapping)
    graph.replay()
    expect = ref.forward(q.float(), k.float(), v.float(), cache.float(), ref.build_metadata(layout))
    torch.cuda.synchronize()
    assert _rel_err(out, expect) < 1e-2


@pytest.mark.parametrize("splits", [None, 1])
def test_decode_with_window_soft_cap_and_sinks_replays_in_cuda_graph(splits):
    """A captured decode step of two sliding-window layers (700 keys, soft-capped, with sinks; 1500 keys),
    replayed after update_graph_metadata moved the contexts on and the blocks that left both windows were
    given back (entries 0): block 0 holds NaN for triton, which must not read it, and finite data for
    the reference, which masks it."""
    windows, block_size = (700, 1500), 16
    rng = np.random.default_rng(2)
    ref, tri = _backends(128, block_size, decode_num_splits=splits)
    sinks = torch.linspace(-1.0, 3.0, HEADS, device="cuda")
    for b in (ref, tri):
        b.layer(0, sliding_window=windows[0], logits_soft_cap=20.0, sinks=sinks)
        b.layer(1, sliding_window=windows[1])
    first, later = [(500, 1), (3000, 1), (40, 1)], [(900, 1), (4000, 1), (41, 1)]
    base = random_layout(later, block_size, rng, 400)
    used = np.arange(base.block_tables.shape[1])[None, :] < -(-base.seq_lens[:, None] // block_size)
    tables = np.where(used, base.block_tables + 1, 0).astype(np.int32)  # block 0: nobody's

    def step(specs, give_back: bool) -> BatchLayout:
        pos = np.array([p for p, _ in specs])
        t = tables.copy()
        if give_back:  # the blocks wholly before the wider window
            for i, p in enumerate(pos):
                t[i, :max(0, p - windows[1] + 1) // block_size] = 0
        return BatchLayout(query_start_loc=base.query_start_loc, seq_lens=(pos + 1).astype(np.int32), block_tables=t,
                           slot_mapping=(tables[np.arange(len(pos)), pos // block_size] * block_size
                                         + pos % block_size).astype(np.int64))

    q = torch.randn(3, HEADS, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, KV_HEADS, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cache = torch.randn(tri.kv_cache_shape(401), device="cuda", dtype=torch.bfloat16)
    meta = tri.build_graph_metadata(step(first, give_back=False))
    assert meta.window_splits.keys() == (set(windows) if splits is None else set())
    for i in (0, 1):
        tri.forward(q, k, v, cache, meta, tri.layers[i])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [tri.forward(q, k, v, cache, meta, tri.layers[i]) for i in (0, 1)]
    later_layout = step(later, give_back=True)
    tri.update_graph_metadata(meta, later_layout)
    cache[:, 0] = float("nan")
    graph.replay()
    ref_cache = cache.float()
    ref_cache[:, 0] = torch.randn_like(ref_cache[:, 0])
    ref_meta = ref.build_metadata(later_layout)
    for i in (0, 1):
        expect = ref.forward(q.float(), k.float(), v.float(), ref_cache, ref_meta, ref.layers[i])
        torch.cuda.synchronize()
        assert torch.isfinite(outs[i]).all() and _rel_err(outs[i], expect) < 1e-2, f"layer {i}"
