"""The ``flashinfer`` and ``flash_attn`` backends without their libraries or a GPU: refusals, selection,
host-side planning, and the forward plumbing against fake libraries that follow the documented
semantics (FlashInfer's CSR page table; FlashAttention's page table and bottom-right causal mask)."""
import dataclasses
import sys
import types

import numpy as np
import pytest
import torch

from kvforge.builder import select_attention_backend
from kvforge.plugin_manager import get_plugin_manager, reset_plugin_manager
from kvforge.plugins.attention import flash_attn_backend as fa_mod
from kvforge.plugins.attention.flash_attn_backend import FlashAttnBackend
from kvforge.plugins.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    as_slice,
    plan_paged_indices,
    token_indices,
)
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from testing_support import random_layout

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


def test_token_indices_and_slices():
    qsl = np.array([0, 1, 8, 9, 12, 13], dtype=np.int32)  # q_lens 1, 7, 1, 3, 1
    assert token_indices(qsl, np.array([0, 2, 4])).tolist() == [0, 8, 12]
    assert token_indices(qsl, np.array([1, 3])).tolist() == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11]
    assert token_indices(qsl, np.array([], dtype=np.int64)).tolist() == []
    assert as_slice(token_indices(qsl, np.array([1, 2]))) == slice(1, 9)
    assert as_slice(np.array([0, 8, 12])) is None
    assert as_slice(np.array([], dtype=np.int64)) is None


# -- forward plumbing against fake libraries --------------------------------------------------------
def reference(q, k_cache, v_cache, cu_q, kv_lens, pages, scale, causal):
    """Paged attention, one sequence at a time: q rows cu_q[i]:cu_q[i+1] over kv_lens[i] keys stored in
    pages[i]; causal aligned bottom-right (FlashInfer and FlashAttention >= 2 alike)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i in range(len(kv_lens)):
        s, e, n = int(cu_q[i]), int(cu_q[i + 1]), int(kv_lens[i])
        page_ids = torch.as_tensor(pages[i], dtype=torch.long)
        keys = k_cache[page_ids].flatten(0, 1)[:n].repeat_interleave(group, dim=1).float()  # [n, heads, d]
        vals = v_cache[page_ids].flatten(0, 1)[:n].repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), keys) * scale
        if causal:
            qpos = torch.arange(n - (e - s), n)[:, None]
            scores = scores.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).to(q.dtype)
    return out


class FakePrefillWrapper:
    """BatchPrefillWithPagedKVCacheWrapper's plan/run surface (flashinfer 0.7), computing ``reference``."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False):
        assert kv_layout == "NHD"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None):
        assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in
                   (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len))
        assert bool((paged_kv_last_page_len >= 1).all() and (paged_kv_last_page_len <= page_size).all())
        self.qo_indptr = qo_indptr.clone()
        ind, last = paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist()
        self.pages = [paged_kv_indices[ind[i]:ind[i + 1]].tolist() for i in range(len(last))]
        self.kv_lens = [(len(p) - 1) * page_size + n for p, n in zip(self.pages, last)]
        self.heads = (num_qo_heads, num_kv_heads, head_dim_qk)
        self.causal, self.scale, self.dtype = causal, sm_scale, q_data_type
        self.kv_dtype = kv_data_type or q_data_type

    def run(self, q, paged_kv_cache, *, out=None, k_scale=None, v_scale=None):
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == self.dtype and q.shape[1:] == (self.heads[0], self.heads[2])
        assert q.shape[0] == int(self.qo_indptr[-1]) and q.is_contiguous()
        assert k_cache.dtype == v_cache.dtype == self.kv_dtype  # flashinfer checks the planned kv_data_type
        # flashinfer 0.7's run(): sm_scale *= k_scale, then out *= v_scale (the raw FP8 values are read)
        scale = self.scale * (1.0 if k_scale is None else k_scale)
        o = reference(q, k_cache, v_cache, self.qo_indptr, self.kv_lens, self.pages, scale, self.causal)
        if v_scale is not None:
            o = o * v_scale
        if out is None:
            return o
        out.copy_(o)
        return out


class FakeDecodeWrapper(FakePrefillWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False):
        assert kv_layout == "NHD"

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             sm_scale=None, q_data_type="float16", kv_data_type=None):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        super().plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     causal=False, sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type)


def _pages(page_table, kv_lens, page_size):
    return [page_table[i, :-(-int(n) // page_size)].tolist() for i, n in enumerate(kv_lens.tolist())]


def fake_fa4(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
             softmax_scale=None, causal=False):
    assert page_table.dtype == seqused_k.dtype == cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k is None
    assert max_seqlen_q == int(torch.diff(cu_seqlens_q).max()) and max_seqlen_k == int(seqused_k.max())
    out = reference(q, k, v, cu_seqlens_q, seqused_k, _pages(page_table, seqused_k, k.shape[1]), softmax_scale,
                    causal)
    return out, None


def fake_fa3(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
             cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
             max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None,
             softmax_scale=None, causal=False):
    assert k is None and v is None and max_seqlen_q is not None
    return reference(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens,
                     _pages(page_table, cache_seqlens, k_cache.shape[1]), softmax_scale, causal)


def fake_fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
             causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
             return_attn_probs=False, block_table=None):
    assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    kv_lens = torch.diff(cu_seqlens_k)
    return reference(q, k, v, cu_seqlens_q, kv_lens, _pages(block_table, kv_lens, k.shape[1]), softmax_scale,
                     causal)


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


def compare_with_torch(cls, specs, block_size, dtype=torch.float32, num_blocks=NUM_BLOCKS, **options):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    kw = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, block_size=block_size, dtype=dtype,
              device=torch.device("cpu"))
    ref, under_test = TorchAttentionBackend(**kw), cls(**kw, **options)
    layout = make_layout(specs, block_size, rng, num_blocks)
    t = layout.num_tokens
    q, k, v = torch.randn(t, 8, 64, dtype=dtype), torch.randn(t, 2, 64, dtype=dtype), torch.randn(t, 2, 64, dtype=dtype)
    # the whole cache holds random K/V: the cached prefixes are whatever their slots hold
    cache = torch.randn(ref.kv_cache_shape(num_blocks), dtype=dtype)
    caches = [cache.clone(), cache.clone()]
    want = ref.forward(q, k, v, caches[0], ref.build_metadata(layout))
    got = under_test.forward(q, k, v, caches[1], under_test.build_metadata(layout))
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
    plan = meta.extra["flashinfer"]
    assert plan.decode.tolist() == [0, 27, 28, 31]  # q_len 1 rows, interleaved: gathered
    assert plan.prefill.tolist() == list(range(1, 27)) + [29, 30]
    assert backend._decode.kv_lens == [22, 5, 34, 48] and backend._prefill.kv_lens == [27, 19, 2]
    meta = backend.build_metadata(make_layout(DECODES_FIRST, 4, np.random.default_rng(0)))
    assert (meta.extra["flashinfer"].decode, meta.extra["flashinfer"].prefill) == (slice(0, 3), slice(3, 29))
    backend.build_metadata(make_layout(DECODES_FIRST, 4, np.random.default_rng(0)))  # the wrappers move on
    with pytest.raises(RuntimeError, match="earlier step"):
        backend.forward(*(torch.zeros(29, h, 64) for h in (8, 2, 2)), torch.zeros(2, NUM_BLOCKS, 4, 2, 64), meta)


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
    assert fi._prefill.kv_dtype == fi._decode.kv_dtype == FP8


def test_flash_attn_refuses_an_fp8_cache(pm, monkeypatch, no_cuda):
    monkeypatch.setattr(fa_mod, "load_function", lambda name: (lambda *a, **k: None) if name == "fa4" else None)
    ok = dict(device=CUDA, dtype=torch.bfloat16, head_size=128, block_size=16)
    assert FlashAttnBackend.validate(**ok) == FlashAttnBackend.validate(**ok, kv_cache_dtype=torch.bfloat16) == []
    with pytest.raises(ValueError, match=r"attention_backend 'flash_attn' cannot be used: kv_cache_dtype "
                                         r"torch.float8_e4m3fn not supported: its cache holds the model dtype only "
                                         r"\(FlashAttention reads FP8 K/V only with an FP8 query"):
        select_attention_backend(pm, "flash_attn", **ok, kv_cache_dtype=FP8)
