"""The ``triton`` backend's kernels in Triton's CPU interpreter, against the ``torch`` reference (float32).

NOTE: the interpreter must be on (TRITON_INTERPRET=1) before triton.language is first imported, and
must stay off for every other test of the session (a GPU run, other triton users). So the kernel
tests run only where TRITON_INTERPRET=1 is set for the whole process: test_kernels_in_interpreter
re-runs this file in a fresh Python process with it set (the run_in_triton_interpreter fixture). To debug one case directly:
TRITON_INTERPRET=1 python -m pytest tests/plugins/attention/test_triton_backend.py -k mixed
"""
import importlib.util

import numpy as np
import pytest
import torch

from kvforge.attention import ATTENTION_FEATURES, LAYER_FEATURES
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.plugins.attention.triton_backend import TritonAttentionBackend
from testing_support import IN_INTERPRETER, first_visible, give_back_blocks, interpreted, random_layout

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)



@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the interpreter")
def test_kernels_in_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(__file__)


@pytest.fixture
def scalar_index_patch():
    """Triton 3.6's interpreter turns a loop bound into an int with ``int(array)``, which numpy >= 2.4
    refuses for its 1-element scalar arrays (later Triton releases squeeze first); patch that for
    these tests only. The kernels are unchanged."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch)
        yield


NUM_BLOCKS = 96
# (cached prefix, new query tokens) per sequence: a fresh prefill spanning several query tiles, a
# chunk after a cached prefix, a chunk whose prefix covers a whole key tile, decodes of varied length
MIXED = [(0, 70), (45, 20), (100, 9), (0, 1), (70, 1), (130, 1), (5, 1), (600, 1)]


def _backends(block_size, num_heads=4, num_kv_heads=2, head_size=64, kv_cache_dtype=None, **options):
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, scale=head_size ** -0.5,
              block_size=block_size, dtype=torch.float32, device=torch.device("cpu"), kv_cache_dtype=kv_cache_dtype)
    return TorchAttentionBackend(**kw), TritonAttentionBackend(**kw, **options)


def _run_both(specs, block_size, seed=0, layer=None, **kw):
    """Outputs and caches of both backends on the same batch, for a layer declared with ``layer`` (the
    keyword arguments of AttentionBackend.layer; None: plain). The triton cache starts with NaN in every
    slot outside what the queries may see, so any read past seq_len would show up. With a sliding window
    the blocks wholly before each window are given back (block-table entries 0): block 0 holds finite
    data for the reference and NaN for triton, whose kernels must not even read it."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    ref, tri = _backends(block_size, **kw)
    layer = layer or {}
    ref_layer, tri_layer = ref.layer(0, **layer), tri.layer(0, **layer)
    layout = random_layout(specs, block_size, rng, NUM_BLOCKS)
    window = layer.get("sliding_window")
    first = first_visible(specs, window)
    num_blocks = NUM_BLOCKS
    if window is not None:
        layout, num_blocks = give_back_blocks(layout, first, block_size), NUM_BLOCKS + 1
    t, h, hkv, d = layout.num_tokens, ref.num_heads, ref.num_kv_heads, ref.head_size
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cache_ref = torch.randn(ref.kv_cache_shape(num_blocks))
    cache_tri = torch.full_like(cache_ref, float("nan"))
    flat_ref, flat_tri = cache_ref.view(2, -1, hkv, d), cache_tri.view(2, -1, hkv, d)
    for i, (prefix, q_len) in enumerate(specs):
        pos = np.arange(first[i], prefix + q_len)
        ctx = torch.from_numpy(layout.block_tables[i, pos // block_size] * block_size + pos % block_size)
        flat_tri[:, ctx] = flat_ref[:, ctx]
    out_ref = ref.forward(q, k, v, cache_ref, ref.build_metadata(layout), ref_layer)
    meta = tri.build_metadata(layout)
    out_tri = tri.forward(q, k, v, cache_tri, meta, tri_layer)
    return out_ref, out_tri, cache_ref, cache_tri, layout, meta


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_mixed_batch_matches_torch(block_size):
    out_ref, out_tri, cache_ref, cache_tri, layout, meta = _run_both(MIXED, block_size)
    assert meta.num_splits == 2  # 5 decodes x 2 KV heads leave the SMs idle: split-K
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)
    slots = torch.from_numpy(layout.slot_mapping)
    flat = (2, -1) + cache_ref.shape[3:]
    torch.testing.assert_close(cache_tri.view(flat)[:, slots], cache_ref.view(flat)[:, slots], atol=0, rtol=0)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_forced_splits(splits):
    # 3 splits of a 1-token or 5-token context leave empty partitions, which the reduce must ignore
    specs = [(0, 1), (5, 1), (64, 1), (200, 1)]
    out_ref, out_tri, *_, meta = _run_both(specs, 16, seed=1, decode_num_splits=splits)
    assert meta.num_splits == splits
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 1)])
def test_gqa_groups(num_heads, num_kv_heads):
    # MHA, a group that is not a power of two, and multi-query attention
    specs = [(20, 13), (40, 1), (3, 1)]
    out_ref, out_tri, *_ = _run_both(specs, 32, seed=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                     head_size=32)
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


# -- per-layer variants: sliding window, soft cap, sinks ---------------------------------------------------
# contexts longer than the windows: fresh prefills over several query tiles, chunks after cached prefixes
# (one whose first query tile needs unmasked key tiles between the window's edge and the diagonal), decodes
WINDOWED = [(0, 70), (45, 20), (300, 40), (100, 9), (0, 1), (70, 1), (130, 1), (5, 1), (600, 1)]
SINKS = torch.tensor([0.5, -1.0, 2.0, 3.0])  # one logit per query head (4 heads)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
@pytest.mark.parametrize("block_size, window, splits", [(16, 40, 3), (16, 200, None), (64, 40, None), (64, 200, 3)])
def test_sliding_window_matches_torch(block_size, window, splits):
    # block 16: key tiles span blocks (one table entry per key); 64: one entry per tile. Window 200: the
    # chunk after 300 cached tokens has unmasked key tiles between the window's edge and the diagonal.
    # NaN in block 0, where every given-back entry points: the kernels read no key before the window
    out_ref, out_tri, *_, meta = _run_both(WINDOWED, block_size, layer=dict(sliding_window=window),
                                           decode_num_splits=splits)
    if splits is None:  # the window's own split count: 5 decodes x 2 KV heads, but only `window` keys
        assert meta.num_splits == 2 and meta.window_splits == {window: 1}
    assert torch.isfinite(out_tri).all()
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layer", [dict(logits_soft_cap=1.5), dict(sinks=SINKS),
                                   dict(sliding_window=40, logits_soft_cap=1.5, sinks=SINKS)],
                         ids=["soft-cap", "sinks", "all-three"])
def test_soft_cap_and_sinks_match_torch(layer, splits):
    # split 1: the sinks join in the decode kernel; split 3: in the reduce (once, not once per split)
    out_ref, out_tri, *_ = _run_both(WINDOWED if "sliding_window" in layer else MIXED, 16, seed=5, layer=layer,
                                     decode_num_splits=splits)
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (8, 1)])
def test_variants_with_gqa_groups(num_heads, num_kv_heads):
    # each query head of a group gets its own sink; a group that is not a power of two pads its rows
    layer = dict(sliding_window=30, logits_soft_cap=2.0, sinks=torch.linspace(-1.0, 2.0, num_heads))
    out_ref, out_tri, *_ = _run_both([(20, 13), (50, 20), (40, 1), (3, 1)], 32, seed=6, layer=layer,
                                     num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32)
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
def test_window_split_counts_follow_the_windows():
    _, tri = _backends(16)
    tri.layer(0, sliding_window=512)
    tri.layer(1)
    tri.layer(2, sliding_window=4096)
    layout = random_layout([(8000, 1)], 16, np.random.default_rng(0), 512)
    meta = tri.build_metadata(layout)  # 1 decode x 2 KV heads: splits by the keys each layer reads
    assert (meta.num_splits, meta.window_splits) == (31, {512: 2, 4096: 16})
    graph = tri.build_graph_metadata(layout)  # the longest context the graph may see: the table's width
    assert (graph.num_splits, graph.window_splits) == (31, {512: 2, 4096: 16})


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
def test_padded_tokens_and_strided_q():
    # the runner may pass more rows than meta.num_tokens, and q as a view of a fused qkv tensor
    rng = np.random.default_rng(3)
    ref, tri = _backends(16, head_size=32)
    layout = random_layout([(10, 6), (30, 1)], 16, rng, NUM_BLOCKS)
    t = layout.num_tokens
    qkv = torch.randn(t + 3, (4 + 2 + 2) * 32)
    q = qkv[:, :128].view(t + 3, 4, 32)
    k, v = qkv[:, 128:192].view(t + 3, 2, 32), qkv[:, 192:].view(t + 3, 2, 32)
    cache = torch.randn(ref.kv_cache_shape(NUM_BLOCKS))
    cache2 = cache.clone()
    out_ref = ref.forward(q, k, v, cache, ref.build_metadata(layout))
    out_tri = tri.forward(q, k, v, cache2, tri.build_metadata(layout))
    assert out_tri.shape == (t, 4, 32)
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
def test_reshape_and_cache_writes_exactly_the_slots():
    from kvforge.kernels.attention import reshape_and_cache

    cache = torch.full((2, 6, 16, 3, 32), -7.0)
    k, v = torch.randn(5, 3, 32), torch.randn(5, 3, 32)
    slots = torch.tensor([17, 3, 95, -1, 40])  # -1: a padding token, written nowhere
    reshape_and_cache(k, v, cache, slots)
    expect = torch.full((2, 6 * 16, 3, 32), -7.0)
    keep = slots >= 0
    expect[0, slots[keep]] = k[keep]
    expect[1, slots[keep]] = v[keep]
    assert torch.equal(cache.view(2, -1, 3, 32), expect)


# -- FP8 cache ----------------------------------------------------------------------------------------
# NOTE: Triton 3.9's interpreter rounds float32 -> float8e4nv wrongly where rounding carries into the
# exponent (31.99 becomes 16.0, not 32.0: interpreter.py's _convert_float adds the rounding bit to the
# mantissa without carrying) and rounds half up, not to even. The GPU rounds in hardware (cvt.rn.satfinite,
# tests/gpu/test_fp8_kv_cache_gpu.py). So these tests feed K/V that are e4m3 values times power-of-two
# scales: x / scale is exactly representable, no rounding happens, and the kernels' division, saturation,
# stores, loads and scale folding are checked bit for bit against the torch backend.
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 2.0 ** -5, 2.0 ** -7


def _representable(shape, scale):
    return (torch.randn(shape) * 100).clamp(-448, 448).to(FP8).float() * scale


def _run_both_fp8(specs, block_size, seed=0, window=None, **kw):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    ref, tri = _backends(block_size, kv_cache_dtype=FP8, **kw)
    layers = [b.layer(0, sliding_window=window) for b in (ref, tri)]
    layout = random_layout(specs, block_size, rng, NUM_BLOCKS)
    if window is not None:  # blocks before the windows given back; block 0 holds others' (finite) data
        layout = give_back_blocks(layout, first_visible(specs, window), block_size)
    t, h, hkv, d = layout.num_tokens, ref.num_heads, ref.num_kv_heads, ref.head_size
    q, k, v = torch.randn(t, h, d), _representable((t, hkv, d), K_SCALE), _representable((t, hkv, d), V_SCALE)
    k[0, 0, :2] = torch.tensor([1e3, -1e3])  # beyond 448 x K_SCALE = 14: saturated to +-448
    caches = []
    for b in (ref, tri):
        b.set_kv_scales(0, k_scale=K_SCALE, v_scale=V_SCALE)
        caches.append(b.allocate_kv_cache(NUM_BLOCKS + 1, 1)[0])
    init = (torch.randn(caches[0].shape) * 100).clamp(-448, 448).to(FP8)
    for c in caches:
        c.copy_(init)
    out_ref = ref.forward(q, k, v, caches[0], ref.build_metadata(layout), layers[0])
    meta = tri.build_metadata(layout)
    out_tri = tri.forward(q, k, v, caches[1], meta, layers[1])
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))  # the same bytes written
    assert caches[1].view(2, -1, hkv, d)[0, int(layout.slot_mapping[0]), 0, :2].float().tolist() == [448.0, -448.0]
    return out_ref, out_tri, meta


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp8_cache_mixed_batch_matches_torch(block_size):
    out_ref, out_tri, meta = _run_both_fp8(MIXED, block_size)
    assert meta.num_splits == 2  # the split path's partials carry v_scale into the reduce
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
def test_fp8_cache_unsplit_decode_and_gqa_match_torch():
    specs = [(20, 13), (40, 1), (3, 1), (200, 1)]
    out_ref, out_tri, meta = _run_both_fp8(specs, 16, seed=4, decode_num_splits=1, num_heads=6, head_size=32)
    assert meta.num_splits == 1
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
def test_fp8_cache_with_a_sliding_window_matches_torch():
    out_ref, out_tri, _ = _run_both_fp8(WINDOWED, 16, seed=7, window=40, decode_num_splits=3)
    torch.testing.assert_close(out_tri, out_ref, atol=1e-4, rtol=1e-4)


@interpreted
@pytest.mark.usefixtures("scalar_index_patch")
def test_fp8_reshape_and_cache_writes_exactly_the_slots():
    from kvforge.kernels.attention import reshape_and_cache

    cache = torch.full((2, 6, 16, 3, 32), -7.0).to(FP8)
    k, v = _representable((5, 3, 32), 0.25), _representable((5, 3, 32), 0.5)
    slots = torch.tensor([17, 3, 95, -1, 40])  # -1: a padding token, written nowhere
    scales = torch.tensor([0.25, 0.5])
    reshape_and_cache(k, v, cache, slots, scales)
    expect = torch.full((2, 6 * 16, 3, 32), -7.0).to(FP8)
    keep = slots >= 0
    expect[0, slots[keep]] = (k[keep] / 0.25).to(FP8)
    expect[1, slots[keep]] = (v[keep] / 0.5).to(FP8)
    assert torch.equal(cache.view(torch.uint8).view(2, -1, 3, 32), expect.view(torch.uint8))
    with pytest.raises(ValueError, match="needs its layer's kv_scales"):
        reshape_and_cache(k, v, cache, slots)


@interpreted  # pure arithmetic, but its module imports triton: keep that import out of this process
def test_choose_num_splits():
    from kvforge.kernels.attention import choose_num_splits

    assert choose_num_splits(64, 8, 16384, 132) == 1  # the batch alone fills the SMs
    assert choose_num_splits(4, 8, 200, 132) == 1  # context too short to split
    assert choose_num_splits(2, 8, 16384, 132) == 33  # ~4 programs per SM
    assert choose_num_splits(1, 8, 1024, 132) == 4  # no split below 256 keys
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64  # capped


def test_validate_and_options(monkeypatch):
    kw = dict(dtype=torch.float16, head_size=128, block_size=16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.validate(device="cpu", **kw) == []
    assert TritonAttentionBackend.validate(device="cpu", **kw, features=LAYER_FEATURES) == []
    assert TritonAttentionBackend.validate(device="cpu", **kw, features=ATTENTION_FEATURES) == [
        "no bidirectional spans support (the model's layers need it)"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert any("device cpu" in r for r in TritonAttentionBackend.validate(device="cpu", **kw))
    reasons = TritonAttentionBackend.validate(device="cuda", dtype=torch.float16, head_size=80, block_size=8)
    assert any("head size 80" in r for r in reasons) and any("block size 8" in r for r in reasons)
    with pytest.raises(ValueError, match="decode_num_splits"):
        TritonAttentionBackend.Options(decode_num_splits=0)


def test_registered():
    from kvforge.plugin_manager import get_plugin_manager

    assert get_plugin_manager().get("attention_backend", "triton") is TritonAttentionBackend
