"""The fused RMSNorm / RoPE / SiLU-and-mul kernels in Triton's CPU interpreter, against the torch references.

As in tests/plugins/attention/test_triton_backend.py, the interpreter must be on before triton is first
imported, so the kernel tests run in a subprocess with TRITON_INTERPRET=1 (test_kernels_in_interpreter).
"""
import importlib.util

import pytest
import torch

from kvforge.plugins.models import fused_ops
from testing_support import IN_INTERPRETER, interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)



@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the interpreter")
def test_kernels_in_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(__file__)


@pytest.mark.skipif(IN_INTERPRETER, reason="outside the interpreter only")
def test_cpu_uses_the_torch_path():
    assert not fused_ops.use_fused(torch.zeros(2, 2))


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: reduction order only; bf16: the interpreter truncates where the GPU rounds to nearest,
    # so values may be one bf16 step (2**-7 relative) apart
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [48, 64])
def test_rms_norm(dtype, dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, dim, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    assert fused_ops.use_fused(x)
    _close(fused_ops.rms_norm(x, w, 1e-5), fused_ops.rms_norm_ref(x, w, 1e-5), dtype)
    res = torch.randn(5, dim, generator=g).to(dtype)
    want_res = res + x
    out, new_res = fused_ops.rms_norm(x, w, 1e-5, res.clone())
    if dtype == torch.float32:
        assert torch.equal(new_res, want_res)
    else:  # the interpreter truncates to bf16 where the GPU rounds to nearest: one ulp apart at most
        _close(new_res, want_res, dtype)
    _close(out, fused_ops.rms_norm_ref(want_res, w, 1e-5), dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_offset_rms_norm(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 48, generator=g).to(dtype)
    w = (0.1 * torch.randn(48, generator=g)).to(dtype)  # zero-centred: the norm multiplies by 1 + w
    want = fused_ops.rms_norm_ref(x, w, 1e-6, offset=True)
    plain = fused_ops.rms_norm_ref(x, w, 1e-6)
    assert not torch.allclose(want.float(), plain.float(), atol=0.1)  # the two variants differ
    _close(fused_ops.rms_norm(x, w, 1e-6, offset=True), want, dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("d", [16, 24])
def test_qk_norm_in_place_on_qkv_views(dtype, offset, d):
    """Qwen3's / Gemma 3's per-head q and k norms in one kernel, in place on the QKV projection's views,
    v untouched; head sizes that are not powers of two are masked."""
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, t = 4, 2, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)
    qw, kw = (0.5 + torch.rand(d, generator=g)).to(dtype), (0.5 + torch.rand(d, generator=g)).to(dtype)
    want_q = fused_ops.rms_norm_ref(q.clone(), qw, 1e-6, offset)
    want_k = fused_ops.rms_norm_ref(k.clone(), kw, 1e-6, offset)
    got_q, got_k = fused_ops.qk_rms_norm(q, k, qw, kw, 1e-6, offset)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_qkv_views(dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, t = 4, 2, 16, 6
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)  # strided views, as the model passes them
    positions = torch.tensor([0, 3, 17, 63, 5, 40])
    want_q, want_k = fused_ops.rope_ref(positions, q.clone(), k.clone(), cos, sin)
    got_q, got_k = fused_ops.rope(positions, q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    v = qkv[:, (heads + kv_heads) * d:]
    assert torch.equal(v, qkv[:, (heads + kv_heads) * d:].clone())  # v untouched


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    _close(fused_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x), dtype)


@interpreted
def test_tiny_llama_fused_matches_torch_path_to_float_noise(monkeypatch):
    """A whole tiny Llama forward: fused kernels (interpreter) against the torch path, float32: the same
    greedy tokens, log-probabilities within 1e-4 (a float32 reduction order differs, so not bit-exact)."""
    from kvforge import LLM, SamplingParams

    prompts = [[5, 9, 11, 2, 7], [3, 3, 8]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    llm = LLM("dummy:tiny", dtype="float32", attention_backend="torch")
    fused = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(fused_ops, "use_fused", lambda x: False)
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert len(fused) == len(plain) == 2
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 6
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            t = next(iter(la))
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
