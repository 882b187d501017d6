"""The FP8 KV cache at the attention-backend level (CPU): the ``torch`` backend's write and read path
against a quantize-dequantize reference, per-layer scales, copy-on-write of FP8 blocks, and backend
selection by ``kv_cache_dtype``. (The ``triton`` kernels: test_triton_backend.py; FlashInfer's and
FlashAttention's plumbing: test_gpu_backends_cpu.py; the engine and accuracy:
tests/plugins/quantization/test_fp8_kv_cache.py.)"""
import logging

import numpy as np
import pytest
import torch

from kvforge.attention import FP8_E4M3_MAX
from kvforge.builder import select_attention_backend
from kvforge.plugin_manager import get_plugin_manager, reset_plugin_manager
from kvforge.plugins.attention.kv_write import quantize_kv
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.plugins.attention.triton_backend import TritonAttentionBackend
from testing_support import random_layout

FP8 = torch.float8_e4m3fn
CUDA = torch.device("cuda")
MIXED = [(0, 21), (13, 6), (40, 1), (0, 1), (7, 1), (29, 1)]  # prefills, a chunk after a prefix, decodes
KW = dict(num_heads=4, num_kv_heads=2, head_size=32, scale=32 ** -0.5, block_size=8, dtype=torch.float32,
          device=torch.device("cpu"))


@pytest.fixture
def pm():
    reset_plugin_manager()
    yield get_plugin_manager()
    reset_plugin_manager()


def dequantize(x8: torch.Tensor, scale: float) -> torch.Tensor:
    return x8.float() * scale


def test_torch_backend_round_trip_equals_attention_over_the_dequantized_kv():
    """Attention over an FP8 cache is attention over quantize-dequantize(K/V), in float32, and the new
    K/V land in their slots as round_to_e4m3(clamp(x / scale, +-448))."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    k_scale, v_scale = 0.05, 0.02
    fp8 = TorchAttentionBackend(**KW, kv_cache_dtype=FP8)
    fp8.set_kv_scales(0, k_scale=k_scale, v_scale=v_scale)
    ref = TorchAttentionBackend(**KW)  # float32 cache
    layout = random_layout(MIXED, 8, rng, 24)
    t = layout.num_tokens
    q, k, v = torch.randn(t, 4, 32), torch.randn(t, 2, 32) * 4, torch.randn(t, 2, 32)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 22.5, -22.5])  # saturate at +-448 x k_scale = 22.4; never NaN
    cache8 = fp8.allocate_kv_cache(24, 1)[0]
    assert cache8.dtype == FP8 and cache8.shape == fp8.kv_cache_shape(24)
    # the cached prefixes: whatever the slots hold
    cache8.copy_((torch.randn(cache8.shape) * 100).clamp(-448, 448).to(FP8))
    cache32 = torch.stack([dequantize(cache8[0], k_scale), dequantize(cache8[1], v_scale)])
    out8 = fp8.forward(q, k, v, cache8, fp8.build_metadata(layout))
    k8, v8 = quantize_kv(k, torch.tensor([k_scale]), FP8), quantize_kv(v, torch.tensor([v_scale]), FP8)
    out32 = ref.forward(q, dequantize(k8, k_scale), dequantize(v8, v_scale), cache32, ref.build_metadata(layout))
    torch.testing.assert_close(out8, out32, rtol=1e-6, atol=1e-6)
    slots = torch.from_numpy(layout.slot_mapping)
    flat = cache8.view(torch.uint8).view(2, -1, 2, 32)
    assert torch.equal(flat[0, slots], k8.view(torch.uint8)) and torch.equal(flat[1, slots], v8.view(torch.uint8))
    assert k8[0, 0, :4].float().tolist() == [FP8_E4M3_MAX, -FP8_E4M3_MAX, FP8_E4M3_MAX, -FP8_E4M3_MAX]
    # the quantization is the real thing: not a float32 path in disguise, and within e4m3's precision
    err = (dequantize(k8, k_scale) - k).abs()[1:]
    assert 0 < err.max() <= k.abs()[1:].max() / 16


def test_scales_are_per_layer():
    """Two layers with their own scales: each writes and reads its cache with its layer's scales (the
    same cached bytes read under another scale are other K/V)."""
    rng = np.random.default_rng(1)
    backend = TorchAttentionBackend(**KW, kv_cache_dtype=FP8)
    backend.set_kv_scales(5, k_scale=0.5)
    backend.set_kv_scales(6, v_scale=torch.tensor(0.25))  # a checkpoint's 0-d tensor
    caches = backend.allocate_kv_cache(24, 2, first_layer=5)
    assert (backend.layer_kv_scales(caches[0]).k, backend.layer_kv_scales(caches[0]).v) == (0.5, 1.0)
    assert backend.layer_kv_scales(caches[1]).tensor.tolist() == [1.0, 0.25]
    init = (torch.randn(caches[0].shape) * 10).to(FP8)
    for c in caches:
        c.copy_(init)
    layout = random_layout([(16, 3)], 8, rng, 24)  # 3 new tokens after 16 cached ones
    q, k, v = torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    outs = [backend.forward(q, k, v, c, backend.build_metadata(layout)) for c in caches]
    ref = TorchAttentionBackend(**KW)
    for c, out, (ks, vs) in zip(caches, outs, [(0.5, 1.0), (1.0, 0.25)]):
        k8, v8 = quantize_kv(k, torch.tensor([ks]), FP8), quantize_kv(v, torch.tensor([vs]), FP8)
        slots = torch.from_numpy(layout.slot_mapping)
        assert torch.equal(c.view(torch.uint8).view(2, -1, 2, 32)[0, slots], k8.view(torch.uint8))
        cache32 = torch.stack([dequantize(init[0], ks), dequantize(init[1], vs)])
        want = ref.forward(q, dequantize(k8, ks), dequantize(v8, vs), cache32, ref.build_metadata(layout))
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(outs[0], outs[1], atol=1e-2)
    with pytest.raises(RuntimeError, match="already allocated"):
        backend.set_kv_scales(5, k_scale=2.0)
    with pytest.raises(RuntimeError, match="allocate_kv_cache did not make"):
        backend.forward(q, k, v, torch.zeros_like(caches[0]), backend.build_metadata(layout))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="layer 2 k_scale must be a finite number > 0"):
            TorchAttentionBackend(**KW, kv_cache_dtype=FP8).set_kv_scales(2, k_scale=bad)


def test_copy_on_write_copies_fp8_blocks_bit_exactly():
    backend = TorchAttentionBackend(**KW, kv_cache_dtype=FP8)
    caches = backend.allocate_kv_cache(6, 2)
    for c in caches:
        c.copy_((torch.randn(c.shape) * 10).to(FP8))
    before = [c.view(torch.uint8).clone() for c in caches]
    backend.copy_blocks(caches, [(1, 4), (3, 0)])
    for c, b in zip(caches, before):
        got = c.view(torch.uint8)
        assert torch.equal(got[:, [4, 0]], b[:, [1, 3]]) and torch.equal(got[:, 1:4], b[:, 1:4])


def test_capabilities_declare_the_kv_cache_dtypes():
    from kvforge.plugins.attention.flash_attn_backend import FlashAttnBackend
    from kvforge.plugins.attention.flashinfer_backend import FlashInferAttentionBackend

    assert FP8 in TorchAttentionBackend.capabilities.kv_cache_dtypes
    assert FP8 in TritonAttentionBackend.capabilities.kv_cache_dtypes
    assert FP8 in FlashInferAttentionBackend.capabilities.kv_cache_dtypes
    assert FlashAttnBackend.capabilities.kv_cache_dtypes == ()  # see its module docstring
    assert TorchAttentionBackend(**KW).kv_cache_dtype == torch.float32  # default: the model dtype
    reasons = TorchAttentionBackend.validate(device="cpu", dtype=torch.float32, head_size=32, block_size=8,
                                             kv_cache_dtype=torch.float16)
    assert reasons == ["kv_cache_dtype torch.float16 not supported: its cache holds the model dtype or "
                       "['torch.float8_e4m3fn']"]


def test_auto_passes_over_a_backend_without_fp8_and_says_why(pm, monkeypatch, caplog):
    """On CUDA (no GPU needed: validate asks CUDA nothing without one), with triton's FP8 support taken
    away, ``auto`` with an FP8 cache skips it and names the reason; with the model dtype it picks it."""
    import dataclasses

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("flashinfer", "flash_attn"):  # out of the way, wherever they are installed
        monkeypatch.setattr(pm.get("attention_backend", name), "unavailable_reasons", classmethod(lambda c: ["no"]))
    setup = dict(device=CUDA, dtype=torch.bfloat16, head_size=64, block_size=16)
    assert select_attention_backend(pm, "auto", **setup, kv_cache_dtype=FP8)[0] == "triton"
    monkeypatch.setattr(TritonAttentionBackend, "capabilities",
                        dataclasses.replace(TritonAttentionBackend.capabilities, kv_cache_dtypes=()))
    assert select_attention_backend(pm, "auto", **setup)[0] == "triton"
    with caplog.at_level(logging.INFO, logger="kvforge.builder"):
        assert select_attention_backend(pm, "auto", **setup, kv_cache_dtype=FP8)[0] == "torch"
    assert "triton: kv_cache_dtype torch.float8_e4m3fn not supported" in caplog.text
    with pytest.raises(ValueError, match="attention_backend 'triton' cannot be used: kv_cache_dtype "
                                         "torch.float8_e4m3fn not supported"):
        select_attention_backend(pm, "triton", **setup, kv_cache_dtype=FP8)
    monkeypatch.setattr(TorchAttentionBackend, "capabilities",
                        dataclasses.replace(TorchAttentionBackend.capabilities, kv_cache_dtypes=()))
    with pytest.raises(ValueError, match=r"no attention backend accepts device=cuda dtype=torch.bfloat16 "
                                         r"kv_cache_dtype=torch.float8_e4m3fn .*torch: kv_cache_dtype"):
        select_attention_backend(pm, "auto", **setup, kv_cache_dtype=FP8)
