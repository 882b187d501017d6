"""The ``flashinfer`` and ``flash_attn`` backends without their libraries or a GPU: refusals, selection,
host-side planning, and the forward plumbing against fake libraries that follow the documented
semantics (FlashInfer's CSR page table; FlashAttention's page table and bottom-right causal mask; both
libraries' sliding windows and soft caps, FA4's learnable sinks)."""
import dataclasses
import sys
import types

import numpy as np
import pytest
import torch

from kvforge.attention import ATTENTION_FEATURES, LAYER_FEATURES
from kvforge.builder import select_attention_backend
from kvforge.plugin_manager import get_plugin_manager, reset_plugin_manager
from kvforge.plugins.attention import flash_attn_backend as fa_mod
from kvforge.plugins.attention.flash_attn_backend import FlashAttnBackend
from kvforge.plugins.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    as_slice,
    plan_paged_indices,
    token_indices,
    window_skip_blocks,
)
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from testing_support import first_visible, give_back_blocks, random_layout

CUDA = torch.device("cuda")
FA_MODULES = ("flash_attn", "flash_attn.cute", "flash_attn_interface")


@pytest.fixture
def pm():
    reset_plugin_manager()
    yield get_plugin_manager()
    reset_plugin_manager()


@pytest.fixture
def no_libraries(monkeypatch):
    """Both libraries absent, even where they are installed (None in sys.modules halts an import)."""
    for name in ("flashinfer", *FA_MODULES):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def no_cuda(monkeypatch):
    """No CUDA, and any CUDA query fails the test: validate must not touch CUDA without it."""
    def boom(*a, **k):
        raise AssertionError("validate called a CUDA API while torch.cuda.is_available() is False")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", boom)


# -- refusals and selection -----------------------------------------------------------------------
def test_unavailable_reasons_name_the_pip_command(no_libraries):
    assert FlashInferAttentionBackend.unavailable_reasons() == [
        "flashinfer is not installed: pip install flashinfer-python"]
    assert FlashAttnBackend.unavailable_reasons() == [
        "flash_attn is not installed: pip install flash-attn-4 (FlashAttention-4, Hopper/Blackwell) "
        "or pip install flash-attn"]


@pytest.mark.parametrize("name, hint", [("flashinfer", "pip install flashinfer-python"),
                                        ("flash_attn", "pip install flash-attn-4")])
def test_explicit_selection_without_library_raises(pm, no_libraries, no_cuda, name, hint):
    assert name in pm.names("attention_backend")
    with pytest.raises(ValueError, match=f"attention_backend '{name}' cannot be used") as exc:
        select_attention_backend(pm, name, device=CUDA, dtype=torch.bfloat16, head_size=128, block_size=16)
    assert hint in str(exc.value)


def test_auto_on_cpu_picks_torch(pm):
    name, cls = select_attention_backend(pm, "auto", device=torch.device("cpu"), dtype=torch.float32,
                                         head_size=64, block_size=16)
    assert name == "torch" and cls is TorchAttentionBackend


def test_auto_on_cuda_skips_missing_libraries(pm, no_libraries, no_cuda):
    name, _ = select_attention_backend(pm, "auto", device=CUDA, dtype=torch.bfloat16, head_size=128,
                                       block_size=16)
    assert name not in ("flashinfer", "flash_attn")


def test_refusals_list_every_reason(no_libraries, no_cuda):
    reasons = FlashInferAttentionBackend.validate(device="cpu", dtype=torch.float32, head_size=96, block_size=8)
    assert len(reasons) == 5, reasons  # library, device, dtype, head size, block size


def test_flash_attn_block_sizes_follow_the_installed_implementation(monkeypatch, no_cuda):
    def only(impl):
        monkeypatch.setattr(fa_mod, "load_function", lambda name: (lambda *a, **k: None) if name == impl else None)

    ok = dict(device=CUDA, dtype=torch.bfloat16, head_size=128)
    only("fa4")
    assert FlashAttnBackend.validate(**ok, block_size=16) == []
    assert "block size 256 not supported by flash_attn fa4" in FlashAttnBackend.validate(**ok, block_size=256)[0]
    only("fa2")
    assert "not a multiple of 256" in FlashAttnBackend.validate(**ok, block_size=16)[0]
    assert FlashAttnBackend.validate(**ok, block_size=256) == []
    only("fa3")
    assert FlashAttnBackend.validate(**ok, block_size=64) == []
    assert fa_mod.choose_implementation("fa4", device=CUDA, head_size=128, block_size=16)[1] == [
        "flash_attn fa4 is not installed (flash_attn.cute.flash_attn_varlen_func)"]


# -- host-side planning ---------------------------------------------------------------------------
def test_plan_paged_indices_hand_checked():
    # block size 4; seq 0: 9 tokens in blocks 7, 2, 5 (last holds 1); seq 1: 4 tokens in block 3
    # (exactly full); seq 2: 1 token in block 0. Padding (zeros) past the used blocks is not read.
    tables = np.array([[7, 2, 5, 0], [3, 0, 0, 0], [0, 9, 9, 9]], dtype=np.int32)
    indptr, indices, last = plan_paged_indices(np.array([9, 4, 1]), tables, 4)
    assert indptr.tolist() == [0, 3, 4, 5]
    assert indices.tolist() == [7, 2, 5, 3, 0]
    assert last.tolist() == [1, 4, 1]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    # a subset of the batch, as build_metadata passes it (the decode rows)
    indptr, indices, last = plan_paged_indices(np.array([4]), tables[[1]], 4)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 1], [3], [4])


def test_window_skip_blocks_leave_out_whole_blocks_before_the_first_query_window():
    # block size 4, window 6: a decode at 21 (context 22) sees 16..21, so blocks 0-3 go; a 7-token chunk
    # after 20 cached sees from 15 (block 3 stays, partly); a fresh 19-token prompt keeps everything
    seq_lens, q_lens = np.array([22, 27, 19, 5]), np.array([1, 7, 19, 1])
    assert window_skip_blocks(seq_lens, q_lens, 6, 4).tolist() == [4, 3, 0, 0]
    assert window_skip_blocks(seq_lens, q_lens, None, 4) is None
    tables = np.arange(28, dtype=np.int32).reshape(4, 7)
    indptr, indices, last = plan_paged_indices(seq_lens, tables, 4, window_skip_blocks(seq_lens, q_lens, 6, 4))
    assert indptr.tolist() == [0, 2, 6, 11, 13]
    assert indices.tolist() == [4, 5, 10, 11, 12, 13, 14, 15, 16, 17, 18, 21, 22]
    assert last.tolist() == [2, 3, 3, 1]  # the last page is the same whatever is left out before it


def test_token_indices_and_slices():
    qsl = np.array([0, 1, 8, 9, 12, 13], dtype=np.int32)  # q_lens 1, 7, 1, 3, 1
    assert token_indices(qsl, np.array([0, 2, 4])).tolist() == [0, 8, 12]
    assert token_indices(qsl, np.array([1, 3])).tolist() == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11]
    assert token_indices(qsl, np.array([], dtype=np.int64)).tolist() == []
    assert as_slice(token_indices(qsl, np.array([1, 2]))) == slice(1, 9)
    assert as_slice(np.array([0, 8, 12])) is None
    assert as_slice(np.array([], dtype=np.int64)) is None


# -- forward plumbing against fake libraries --------------------------------------------------------
def reference(q, k_cache, v_cache, cu_q, kv_lens, pages, scale, causal, window_left=-1, softcap=0.0, sinks=None):
    """Paged attention, one sequence at a time: q rows cu_q[i]:cu_q[i+1] over kv_lens[i] keys stored in
    pages[i]; causal aligned bottom-right (FlashInfer and FlashAttention >= 2 alike), and so is the window:
    query i of q_len sits at kv_len - q_len + i and sees window_left keys before it (-1: all); softcap > 0:
    scaled scores become softcap * tanh(score / softcap); sinks: [heads] logits joining each denominator."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i in range(len(kv_lens)):
        s, e, n = int(cu_q[i]), int(cu_q[i + 1]), int(kv_lens[i])
        page_ids = torch.as_tensor(pages[i], dtype=torch.long)
        keys = k_cache[page_ids].flatten(0, 1)[:n].repeat_interleave(group, dim=1).float()  # [n, heads, d]
        vals = v_cache[page_ids].flatten(0, 1)[:n].repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        qpos, kpos = torch.arange(n - (e - s), n)[:, None], torch.arange(n)[None, :]
        if causal:
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
        if window_left >= 0:
            scores = scores.masked_fill(kpos < qpos - window_left, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, e - s, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
    return out


class FakePrefillWrapper:
    """BatchPrefillWithPagedKVCacheWrapper's plan/run surface (flashinfer 0.7), computing ``reference``."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        assert kv_layout == "NHD"
        self.plans = 0  # plan() calls

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, q_data_type="float16", kv_data_type=None):
        assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in
                   (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len))
        assert bool((paged_kv_last_page_len >= 1).all() and (paged_kv_last_page_len <= page_size).all())
        self.plans += 1
        self.qo_indptr = qo_indptr.clone()
        ind, last = paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist()
        self.pages = [paged_kv_indices[ind[i]:ind[i + 1]].tolist() for i in range(len(last))]
        self.kv_lens = [(len(p) - 1) * page_size + n for p, n in zip(self.pages, last)]
        self.heads = (num_qo_heads, num_kv_heads, head_dim_qk)
        self.causal, self.scale, self.dtype = causal, sm_scale, q_data_type
        self.window_left, self.soft_cap = window_left, logits_soft_cap or 0.0
        self.kv_dtype = kv_data_type or q_data_type

    def run(self, q, paged_kv_cache, *, out=None, k_scale=None, v_scale=None):
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == self.dtype and q.shape[1:] == (self.heads[0], self.heads[2])
        assert q.shape[0] == int(self.qo_indptr[-1]) and q.is_contiguous()
        assert k_cache.dtype == v_cache.dtype == self.kv_dtype  # flashinfer checks the planned kv_data_type
        # flashinfer 0.7's run(): sm_scale *= k_scale, then out *= v_scale (the raw FP8 values are read)
        scale = self.scale * (1.0 if k_scale is None else k_scale)
        o = reference(q, k_cache, v_cache, self.qo_indptr, self.kv_lens, self.pages, scale, self.causal,
                      self.window_left, self.soft_cap)
        if v_scale is not None:
            o = o * v_scale
        if out is None:
            return o
        out.copy_(o)
        return out


class FakeDecodeWrapper(FakePrefillWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        assert kv_layout == "NHD"
        assert use_cuda_graph == (paged_kv_indices_buffer is not None)  # graph wrappers bring their buffers
        self.graph_rows = None if paged_kv_indptr_buffer is None else len(paged_kv_indptr_buffer) - 1
        self.plans = 0

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             sm_scale=None, window_left=-1, logits_soft_cap=None, q_data_type="float16", kv_data_type=None):
        assert self.graph_rows in (None, len(last_page_len))  # a graph wrapper's batch size is fixed
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        super().plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     causal=False, sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
                     q_data_type=q_data_type, kv_data_type=kv_data_type)


def _pages(page_table, kv_lens, page_size):
    return [page_table[i, :-(-int(n) // page_size)].tolist() for i, n in enumerate(kv_lens.tolist())]


def _window_left(window_size, causal):
    """FlashAttention's (left, right) window, both inclusive, -1 or None for unbounded; only the causal
    (left, 0) windows a decoder asks for."""
    left, right = window_size
    assert right in (None, -1, 0) and (right != 0 or causal)
    return -1 if left is None else left


#: the keyword arguments of the latest fake FlashAttention call
fa_calls: list[dict] = []


def fake_fa4(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
             softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0):
    # flash-attn-4 4.0.0b36's flash_attn_varlen_func signature, up to the arguments the backend passes
    fa_calls.append(dict(window_size=window_size, learnable_sink=learnable_sink, softcap=softcap))
    assert page_table.dtype == seqused_k.dtype == cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k is None
    assert max_seqlen_q == int(torch.diff(cu_seqlens_q).max()) and max_seqlen_k == int(seqused_k.max())
    assert learnable_sink is None or learnable_sink.shape == (q.shape[1],)
    out = reference(q, k, v, cu_seqlens_q, seqused_k, _pages(page_table, seqused_k, k.shape[1]), softmax_scale,
                    causal, _window_left(window_size, causal), softcap, learnable_sink)
    return out, None


def fake_fa3(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
             cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
             max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None,
             softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0):
    fa_calls.append(dict(window_size=window_size, softcap=softcap))
    assert k is None and v is None and max_seqlen_q is not None
    return reference(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens,
                     _pages(page_table, cache_seqlens, k_cache.shape[1]), softmax_scale, causal,
                     _window_left(window_size, causal), softcap)


def fake_fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
             causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
             return_attn_probs=False, block_table=None):
    fa_calls.append(dict(window_size=window_size, softcap=softcap))
    assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    kv_lens = torch.diff(cu_seqlens_k)
    return reference(q, k, v, cu_seqlens_q, kv_lens, _pages(block_table, kv_lens, k.shape[1]), softmax_scale,
                     causal, _window_left(window_size, causal), softcap)


@pytest.fixture
def on_cpu(monkeypatch):
    """Let the CUDA-only backends be built on the CPU in float32 (for the fakes), and with small blocks
    (block size 4: many page boundaries in a small test)."""
    for cls in (FlashInferAttentionBackend, FlashAttnBackend):
        monkeypatch.setattr(cls, "capabilities", dataclasses.replace(
            cls.capabilities, devices=("cpu", "cuda"), dtypes=(torch.float32, torch.bfloat16), block_sizes=None))


@pytest.fixture
def fake_flashinfer(monkeypatch, on_cpu):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=FakePrefillWrapper, BatchDecodeWithPagedKVCacheWrapper=FakeDecodeWrapper))


def install_fake_flash_attn(monkeypatch, impl):
    top = types.ModuleType("flash_attn")  # FA4 alone leaves flash_attn a bare namespace
    if impl == "fa2":
        top.flash_attn_varlen_func = fake_fa2
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fake_fa4
    iface = types.ModuleType("flash_attn_interface")
    iface.flash_attn_with_kvcache = fake_fa3
    monkeypatch.setitem(sys.modules, "flash_attn", top)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute if impl == "fa4" else None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", iface if impl == "fa3" else None)


NUM_BLOCKS = 48
# (cached prefix, new tokens): interleaved decodes and prefills (gather/scatter path), a chunk after a
# cached prefix, a fresh prefill, a one-token chunk (planned as a decode), contexts ending mid-block
INTERLEAVED = [(21, 1), (20, 7), (0, 19), (4, 1), (33, 1), (0, 2), (47, 1)]
DECODES_FIRST = [(21, 1), (4, 1), (16, 1), (20, 7), (0, 19)]  # contiguous groups (slice path)


def make_layout(specs, block_size, rng, num_blocks=NUM_BLOCKS):
    return random_layout(specs, block_size, rng, num_blocks)


def compare_with_torch(cls, specs, block_size, dtype=torch.float32, num_blocks=NUM_BLOCKS, layer=None, **options):
    """The backend against the torch reference on one step; ``layer``: AttentionBackend.layer's keyword
    arguments (None: plain). With a sliding window the blocks wholly before each window are given back:
    their entries point at block 0, which holds another sequence's (finite) K/V."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    kw = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=block_size, dtype=dtype,
              device=torch.device("cpu"))
    ref, under_test = TorchAttentionBackend(**kw), cls(**kw, **options)
    layer = layer or {}
    specs_of = [b.layer(0, **layer) for b in (ref, under_test)]
    layout = make_layout(specs, block_size, rng, num_blocks)
    if layer.get("sliding_window") is not None:
        layout = give_back_blocks(layout, first_visible(specs, layer["sliding_window"]), block_size)
        num_blocks += 1
    t = layout.num_tokens
    q, k, v = torch.randn(t, 8, 64, dtype=dtype), torch.randn(t, 2, 64, dtype=dtype), torch.randn(t, 2, 64, dtype=dtype)
    # the whole cache holds random K/V: the cached prefixes are whatever their slots hold
    cache = torch.randn(ref.kv_cache_shape(num_blocks), dtype=dtype)
    caches = [cache.clone(), cache.clone()]
    want = ref.forward(q, k, v, caches[0], ref.build_metadata(layout), specs_of[0])
    got = under_test.forward(q, k, v, caches[1], under_test.build_metadata(layout), specs_of[1])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert torch.equal(caches[0], caches[1])  # new K/V landed in the same slots
    return under_test


@pytest.mark.parametrize("specs", [INTERLEAVED, DECODES_FIRST, [(3, 1), (9, 1)], [(0, 5), (6, 4)]],
                         ids=["interleaved", "decodes-first", "decode-only", "prefill-only"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_flashinfer_forward_matches_torch(fake_flashinfer, specs, block_size):
    backend = compare_with_torch(FlashInferAttentionBackend, specs, block_size)
    assert backend._workspace.numel() == 128 << 20


def test_flashinfer_routes_tokens_by_query_length(fake_flashinfer):
    backend = FlashInferAttentionBackend(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=4,
                                         dtype=torch.float32, device=torch.device("cpu"), workspace_mib=16)
    meta = backend.build_metadata(make_layout(INTERLEAVED, 4, np.random.default_rng(0)))
    plan = meta.plan
    assert plan.decode.tolist() == [0, 27, 28, 31]  # q_len 1 rows, interleaved: gathered
    assert plan.prefill.tolist() == list(range(1, 27)) + [29, 30]
    prefill, decode = backend._wrappers[None, None]
    assert decode.kv_lens == [22, 5, 34, 48] and prefill.kv_lens == [27, 19, 2]
    meta = backend.build_metadata(make_layout(DECODES_FIRST, 4, np.random.default_rng(0)))
    assert (meta.plan.decode, meta.plan.prefill) == (slice(0, 3), slice(3, 29))
    backend.build_metadata(make_layout(DECODES_FIRST, 4, np.random.default_rng(0)))  # the wrappers move on
    with pytest.raises(RuntimeError, match="earlier step"):
        backend.forward(*(torch.zeros(29, h, 64) for h in (8, 2, 2)), torch.zeros(2, NUM_BLOCKS, 4, 2, 64), meta)


# -- per-layer variants ---------------------------------------------------------------------------------
# small windows over INTERLEAVED's contexts (up to 48): decodes and chunks whose first blocks were given back
VARIANTS = {"window": dict(sliding_window=6), "soft-cap": dict(logits_soft_cap=2.0),
            "window-and-cap": dict(sliding_window=13, logits_soft_cap=2.0)}


@pytest.mark.parametrize("layer", VARIANTS.values(), ids=VARIANTS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_flashinfer_variants_match_torch(fake_flashinfer, layer, block_size):
    backend = compare_with_torch(FlashInferAttentionBackend, INTERLEAVED, block_size, layer=layer)
    window, cap = layer.get("sliding_window"), layer.get("logits_soft_cap")
    assert list(backend._wrappers) == [(window, cap)]  # one plan key: one pair of wrappers, as before
    for wrapper in backend._wrappers[window, cap]:
        assert (wrapper.window_left, wrapper.soft_cap) == (-1 if window is None else window - 1, cap or 0.0)
        if window is not None:  # the given-back entries (0: block 0 is nobody's here) are left out
            assert all(0 not in pages for pages in wrapper.pages)


def test_flashinfer_plans_each_plan_key_once_per_step(fake_flashinfer):
    """Gemma-2-like layers (sliding and global, all soft-capped) and a plain one: three plan keys, each
    planned once per step with its window and cap; one metadata then serves every layer."""
    kw = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=4, dtype=torch.float32,
              device=torch.device("cpu"))
    ref, fi = TorchAttentionBackend(**kw), FlashInferAttentionBackend(**kw, workspace_mib=16)
    for backend in (ref, fi):
        for i in range(4):
            backend.layer(i, sliding_window=8 if i % 2 == 0 else None, logits_soft_cap=50.0)
        backend.layer(4)
    assert fi.plan_keys == [(8, 50.0), (None, 50.0), (None, None)]
    layout = make_layout(INTERLEAVED, 4, np.random.default_rng(0))
    meta = fi.build_metadata(layout)
    assert list(fi._wrappers) == fi.plan_keys
    for (window, cap), pair in fi._wrappers.items():
        assert [w.plans for w in pair] == [1, 1]
        assert all((w.window_left, w.soft_cap) == (-1 if window is None else 7, cap or 0.0) for w in pair)
    prefill, decode = fi._wrappers[8, 50.0]  # the window's plan starts at the first block it sees
    assert decode.kv_lens == [10, 5, 10, 8] and prefill.kv_lens == [15, 19, 2]
    prefill, decode = fi._wrappers[None, None]
    assert decode.kv_lens == [22, 5, 34, 48] and prefill.kv_lens == [27, 19, 2]
    torch.manual_seed(0)
    t = layout.num_tokens
    q, k, v = torch.randn(t, 8, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    cache = torch.randn(ref.kv_cache_shape(NUM_BLOCKS))
    ref_meta = ref.build_metadata(layout)
    for i in range(5):
        want = ref.forward(q, k, v, cache.clone(), ref_meta, ref.layers[i])
        torch.testing.assert_close(fi.forward(q, k, v, cache.clone(), meta, fi.layers[i]), want, rtol=2e-5, atol=2e-5)
    fi.build_metadata(layout)
    assert all(w.plans == 2 for pair in fi._wrappers.values() for w in pair)


def test_flashinfer_refuses_a_layer_it_has_no_plan_for(fake_flashinfer):
    fi = FlashInferAttentionBackend(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=4,
                                    dtype=torch.float32, device=torch.device("cpu"), workspace_mib=16)
    fi.layer(0, sliding_window=8)
    meta = fi.build_metadata(make_layout(DECODES_FIRST, 4, np.random.default_rng(0)))
    with pytest.raises(RuntimeError, match=r"no plan for layer -1 .* \(None, None\); planned: \[\(8, None\)\]"):
        fi.forward(*(torch.zeros(29, h, 64) for h in (8, 2, 2)), torch.zeros(2, NUM_BLOCKS, 4, 2, 64), meta)


def test_flashinfer_graph_wrappers_per_plan_key(fake_flashinfer):
    """A captured decode step gets a use_cuda_graph wrapper per (batch size, plan key), re-planned before
    each replay; a model with one key keeps one wrapper per batch size."""
    kw = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=4, dtype=torch.float32,
              device=torch.device("cpu"))
    ref, fi = TorchAttentionBackend(**kw), FlashInferAttentionBackend(**kw, workspace_mib=16)
    for backend in (ref, fi):
        backend.layer(0, sliding_window=6)
        backend.layer(1)
    rng = np.random.default_rng(3)
    short, long = (make_layout(specs, 4, rng) for specs in ([(5, 1), (21, 1), (13, 1)], [(9, 1), (30, 1), (2, 1)]))
    # a graph's block tables have a fixed width (the longest context it may see): 10 blocks here
    short, long = (dataclasses.replace(x, block_tables=np.pad(x.block_tables,
                                                              [(0, 0), (0, 10 - x.block_tables.shape[1])]))
                   for x in (short, long))
    meta = fi.build_graph_metadata(short)
    wrappers = meta.graph_wrappers
    assert list(wrappers) == [(6, None), (None, None)] and all(w.graph_rows == 3 for w in wrappers.values())
    fi.update_graph_metadata(meta, long)
    assert [w.plans for w in wrappers.values()] == [2, 2] and wrappers[6, None].window_left == 5
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    cache = torch.randn(ref.kv_cache_shape(NUM_BLOCKS))
    ref_meta = ref.build_metadata(long)
    for i in range(2):
        want = ref.forward(q, k, v, cache.clone(), ref_meta, ref.layers[i])
        torch.testing.assert_close(fi.forward(q, k, v, cache.clone(), meta, fi.layers[i]), want, rtol=2e-5, atol=2e-5)
    assert fi.build_graph_metadata(long).graph_wrappers == wrappers  # same batch size: same wrappers


def test_flashinfer_declares_window_and_soft_cap_but_no_sinks(fake_flashinfer, no_cuda):
    ok = dict(device=CUDA, dtype=torch.bfloat16, head_size=128, block_size=16)
    assert FlashInferAttentionBackend.validate(**ok, features=("sliding_window", "logits_soft_cap")) == []
    assert FlashInferAttentionBackend.validate(**ok, features=ATTENTION_FEATURES) == [
        "no attention sinks support (the model's layers need it)",
        "no bidirectional spans support (the model's layers need it)"]
    fi = FlashInferAttentionBackend(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=4,
                                    dtype=torch.float32, device=torch.device("cpu"), workspace_mib=16)
    with pytest.raises(ValueError, match="cannot run layer 3: no attention sinks support"):
        fi.layer(3, sinks=torch.zeros(8))


@pytest.fixture
def fa_call_log():
    fa_calls.clear()
    yield fa_calls
    fa_calls.clear()


FA_VARIANTS = {**VARIANTS, "sinks": dict(sinks=torch.linspace(-1.0, 3.0, 8)),
               "all-three": dict(sliding_window=13, logits_soft_cap=2.0, sinks=torch.linspace(-1.0, 3.0, 8))}


@pytest.mark.parametrize("impl, block_size, layer", [
    pytest.param(impl, block_size, layer, id=f"{impl}-{name}")
    for impl, block_size in (("fa4", 16), ("fa3", 16), ("fa2", 256)) for name, layer in FA_VARIANTS.items()
    if "sinks" not in layer or impl == "fa4"])  # sinks: FA4 only (test_flash_attn_sinks_need_fa4)
def test_flash_attn_variants_reach_the_call_and_match_torch(monkeypatch, on_cpu, fa_call_log, impl, block_size,
                                                             layer):
    install_fake_flash_attn(monkeypatch, impl)
    compare_with_torch(FlashAttnBackend, INTERLEAVED, block_size, layer=layer)
    window = layer.get("sliding_window")
    call = fa_call_log[-1]
    assert call["window_size"] == ((window - 1, 0) if window is not None else (None, None) if impl == "fa4"
                                   else (-1, -1))
    assert call["softcap"] == layer.get("logits_soft_cap", 0.0)
    assert call.get("learnable_sink") is layer.get("sinks")


@pytest.mark.parametrize("impl", ["fa4", "fa3", "fa2"])
def test_flash_attn_plain_layer_call_is_unchanged(monkeypatch, on_cpu, fa_call_log, impl):
    install_fake_flash_attn(monkeypatch, impl)
    compare_with_torch(FlashAttnBackend, DECODES_FIRST, 256 if impl == "fa2" else 16)
    defaults = dict(window_size=(None, None) if impl == "fa4" else (-1, -1), softcap=0.0)
    assert fa_call_log[-1] == (dict(defaults, learnable_sink=None) if impl == "fa4" else defaults)


def test_flash_attn_sinks_need_fa4(monkeypatch, on_cpu, no_cuda):
    ok = dict(device=CUDA, dtype=torch.bfloat16, head_size=128, block_size=16)
    kw = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=16, dtype=torch.float32,
              device=torch.device("cpu"))
    install_fake_flash_attn(monkeypatch, "fa4")
    assert FlashAttnBackend.validate(**ok, features=LAYER_FEATURES) == []
    assert FlashAttnBackend(**kw).layer(0, sinks=torch.zeros(8)).sinks is not None
    install_fake_flash_attn(monkeypatch, "fa3")
    assert FlashAttnBackend.validate(**ok, features=("sliding_window", "logits_soft_cap")) == []
    assert FlashAttnBackend.validate(**ok, features=LAYER_FEATURES) == [
        "flash_attn fa3 takes no attention sinks (FA4's learnable_sink only)"]
    backend = FlashAttnBackend(**kw)
    with pytest.raises(ValueError, match="cannot run layer 2: no attention sinks support in flash_attn fa3"):
        backend.layer(2, sinks=torch.zeros(8))
    assert backend.layers == {}


@pytest.mark.parametrize("impl, block_size", [("fa4", 16), ("fa3", 16), ("fa2", 256)])
def test_flash_attn_forward_matches_torch(monkeypatch, on_cpu, impl, block_size):
    install_fake_flash_attn(monkeypatch, impl)
    # block size 256: the cache needs room for every sequence's own blocks
    backend = compare_with_torch(FlashAttnBackend, INTERLEAVED, block_size, num_blocks=NUM_BLOCKS)
    assert backend.implementation == impl


def test_flash_attn_implementation_option(monkeypatch, on_cpu):
    install_fake_flash_attn(monkeypatch, "fa4")
    kw = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=16, dtype=torch.float32,
              device=torch.device("cpu"))
    with pytest.raises(ValueError, match="flash_attn fa2 is not installed"):
        FlashAttnBackend(**kw, implementation="fa2")
    with pytest.raises(ValueError, match="implementation must be one of"):
        FlashAttnBackend.Options(implementation="fa9")
    assert FlashAttnBackend(**kw, implementation="fa4").implementation == "fa4"


# -- FP8 KV cache (kv_cache_dtype="fp8") ----------------------------------------------------------------
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("specs", [INTERLEAVED, DECODES_FIRST], ids=["interleaved", "decodes-first"])
def test_flashinfer_reads_an_fp8_cache_with_its_layers_scales(fake_flashinfer, specs):
    """FP8 pages planned as kv_data_type=float8_e4m3fn and run with the layer's k_scale / v_scale (as
    FlashInfer applies them): the torch backend's FP8 result, and the same bytes written."""
    rng = np.random.default_rng(1)
    torch.manual_seed(1)
    kw = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=4, dtype=torch.float32,
              device=torch.device("cpu"), kv_cache_dtype=FP8)
    ref, fi = TorchAttentionBackend(**kw), FlashInferAttentionBackend(**kw)
    caches = []
    for backend in (ref, fi):
        backend.set_kv_scales(3, k_scale=0.05, v_scale=0.02)
        caches.append(backend.allocate_kv_cache(NUM_BLOCKS, 2, first_layer=2)[1])  # model layer 3
    init = (torch.randn(caches[0].shape) * 50).to(FP8).view(torch.uint8)
    for c in caches:
        c.view(torch.uint8).copy_(init)
    layout = make_layout(specs, 4, rng)
    t = layout.num_tokens
    q, k, v = torch.randn(t, 8, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    want = ref.forward(q, k, v, caches[0], ref.build_metadata(layout))
    got = fi.forward(q, k, v, caches[1], fi.build_metadata(layout))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    prefill, decode = fi._wrappers[None, None]
    assert prefill.kv_dtype == decode.kv_dtype == FP8


def test_flash_attn_refuses_an_fp8_cache(pm, monkeypatch, no_cuda):
    monkeypatch.setattr(fa_mod, "load_function", lambda name: (lambda *a, **k: None) if name == "fa4" else None)
    ok = dict(device=CUDA, dtype=torch.bfloat16, head_size=128, block_size=16)
    assert FlashAttnBackend.validate(**ok) == FlashAttnBackend.validate(**ok, kv_cache_dtype=torch.bfloat16) == []
    with pytest.raises(ValueError, match=r"attention_backend 'flash_attn' cannot be used: kv_cache_dtype "
                                         r"torch.float8_e4m3fn not supported: its cache holds the model dtype only "
                                         r"\(FlashAttention reads FP8 K/V only with an FP8 query"):
        select_attention_backend(pm, "flash_attn", **ok, kv_cache_dtype=FP8)


def test_auto_ranks_the_built_ins_by_their_priority(pm):
    from kvforge.builder import auto_order

    order, refused = auto_order(pm)
    assert [n for n, _ in order if n in ("triton", "flashinfer", "flash_attn", "torch")] == [
        "triton", "flashinfer", "flash_attn", "torch"]
    assert not refused


@pytest.mark.parametrize("priority, picked", [(100, "mine"), (0, "torch")])
def test_a_third_party_backend_joins_auto_by_its_priority(pm, priority, picked):
    """``auto`` ranks every registered backend by ``capabilities.auto_priority``: one above the built-ins
    is tried (and here taken) first; one with the default 0 comes after them, so torch still wins on CPU."""
    import dataclasses

    class Mine(TorchAttentionBackend):
        capabilities = dataclasses.replace(TorchAttentionBackend.capabilities, auto_priority=priority)

    pm.registries["attention_backend"].add("mine", Mine, "test")
    name, cls = select_attention_backend(pm, "auto", device=torch.device("cpu"), dtype=torch.float32,
                                         head_size=64, block_size=16)
    assert name == picked and (cls is Mine) == (picked == "mine")
