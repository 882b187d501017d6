"""The W4A16 kernels (``kvforge.kernels.int4``, through ``int4``'s launchers) in Triton's CPU interpreter,
against a dequantize-then-matmul reference written from the layout definition (tests/quant_reference.py,
which also derives the bounds).
The same checks at Llama-3-8B shapes, and CUDA-graph replay, run on the GPU (tests/gpu/test_quant_kernels_gpu.py).

As in tests/plugins/attention/test_triton_backend.py, the interpreter must be on before triton is first
imported, so the kernel tests run in a subprocess with TRITON_INTERPRET=1 (test_kernels_in_interpreter).
To debug one case: TRITON_INTERPRET=1 python -m pytest tests/plugins/quantization/test_int4_triton.py -k split
"""
import importlib.util

import numpy as np
import pytest
import torch
from quant_reference import ULP, assert_gemm_within_rounding, dequantize_from_layout, random_int4_weight

from kvforge.plugins.quantization.int4 import dequantize as dequantize_int4
from kvforge.plugins.quantization.int4 import dequantize_int4_triton, w4a16_gemm
from testing_support import IN_INTERPRETER, interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from kvforge.kernels.int4 import INT4_CONFIGS, PROGRAMS_PER_SM  # imports triton
from kvforge.kernels.quant_gemm import GemmConfig, choose_split_k, k_per_split, pick_config

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: (K, N, G): N never a multiple of the table's 128-wide N tile; G == K (one group) with K not a
#: multiple of BLOCK_K (a masked K tail); G = 32 below the table's BLOCK_K of 64 (halved to fit)
SHAPES = [(256, 200, 32), (512, 136, 128), (200, 72, 200), (384, 64, 64)]


def _weight_rel(dtype: torch.dtype) -> float:
    """How far the kernel's dequantized weights may be from the reference's: the interpreter
    truncates float32 to bf16 where torch rounds to nearest (one ulp); fp16 and fp32 round alike."""
    return ULP[torch.bfloat16] if dtype == torch.bfloat16 and IN_INTERPRETER else 0.0


def _operands(m, k, n, group_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, qweight, scales, zeros = random_int4_weight(k, n, group_size, dtype, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, q, qweight, scales, zeros


@pytest.fixture(autouse=True)
def bf16_dot_patch(monkeypatch):
    """Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as their raw uint16 bits
    (``InterpreterBuilder.create_dot`` widens only 8-bit floats), which gives garbage; widen bf16 to
    float32 first (exact: a 16-bit shift), which is what the tensor cores compute with. Patched for
    these tests only; the kernels are unchanged."""
    if not IN_INTERPRETER:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield


@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the interpreter")
def test_kernels_in_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(__file__)


@pytest.mark.skipif(IN_INTERPRETER, reason="outside the interpreter only")
def test_cpu_uses_the_reference():
    x, _, qweight, scales, zeros = _operands(3, 256, 40, 32, torch.float32)
    assert torch.equal(w4a16_gemm(x, qweight, scales, zeros, 32), x @ dequantize_int4(qweight, scales, zeros, 32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_int4_follows_the_layout(dtype):
    _, q, qweight, scales, zeros = _operands(1, 256, 24, 64, dtype)
    assert torch.equal(dequantize_int4(qweight, scales, zeros, 64), dequantize_from_layout(q, scales, zeros, 64))


def test_bad_operands_are_refused_by_name():
    _, _, qweight, scales, zeros = _operands(1, 256, 24, 64, torch.float16)
    with pytest.raises(ValueError, match="group_size must be a multiple of 8 that divides K = 256"):
        w4a16_gemm(torch.zeros(1, 256, dtype=torch.float16), qweight, scales, zeros, 48)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] with K = 256"):
        w4a16_gemm(torch.zeros(1, 128, dtype=torch.float16), qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match="share a dtype"):
        w4a16_gemm(torch.zeros(1, 256), qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match=r"scales must be \[K // group_size, N\] = \[8, 24\]"):
        w4a16_gemm(torch.zeros(1, 256, dtype=torch.float16), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16_gemm(torch.zeros(1, 256, dtype=torch.float16), qweight.float(), scales, zeros, 64)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        GemmConfig(block_m=16, block_n=64, block_k=8, num_warps=4, num_stages=2)


def test_split_k_and_buckets():
    # decode on 132 SMs, N tile 128: split until 4 programs per SM, keeping >= 512 of K per split,
    # at most 16: the fastest splits measured at M = 1 (INT4 PROGRAMS_PER_SM's note)
    assert choose_split_k(tiles=48, k=4096, sms=132, programs_per_sm=4) == 8  # qkv: K stops it at 512 a split
    assert choose_split_k(tiles=224, k=4096, sms=132, programs_per_sm=4) == 4  # gate_up
    assert choose_split_k(tiles=32, k=14336, sms=132, programs_per_sm=4) == 16  # down: capped
    assert choose_split_k(tiles=896, k=4096, sms=132, programs_per_sm=2) == 1  # fp8 gate_up fills the GPU alone
    assert choose_split_k(tiles=1, k=1024, sms=132, programs_per_sm=2) == 2  # no split below 512 of K
    assert k_per_split(4096, 3, 128) == (1408, 3)  # rounded up to whole blocks
    assert k_per_split(256, 3, 128) == (128, 2)  # ...which can leave fewer, non-empty, splits
    assert pick_config(INT4_CONFIGS, 1) is pick_config(INT4_CONFIGS, 16) is INT4_CONFIGS[16]
    assert pick_config(INT4_CONFIGS, 17) is INT4_CONFIGS[32]
    assert pick_config(INT4_CONFIGS, 100_000) is INT4_CONFIGS[max(INT4_CONFIGS)]


# ---- in the interpreter -------------------------------------------------------------------------------

@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n,group_size", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_w4a16_gemm_matches_the_reference(m, k, n, group_size, dtype):
    x, q, qweight, scales, zeros = _operands(m, k, n, group_size, dtype)
    got = w4a16_gemm(x, qweight, scales, zeros, group_size)  # the table's config (M 17: the 32 bucket)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_gemm_within_rounding(got, x, dequantize_from_layout(q, scales, zeros, group_size),
                                w_rel=_weight_rel(dtype))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [
    GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, split_k=2),
    GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2, split_k=3),  # BLOCK_K 128 -> 32
    GemmConfig(block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2, split_k=8),
], ids=["split2", "split3-halved-block-k", "split8"])
def test_split_k_matches_the_reference(config, dtype):
    x, q, qweight, scales, zeros = _operands(17, 512, 200, 32, dtype, seed=1)
    got = w4a16_gemm(x, qweight, scales, zeros, 32, config=config)
    assert_gemm_within_rounding(got, x, dequantize_from_layout(q, scales, zeros, 32), w_rel=_weight_rel(dtype))


@interpreted
def test_split_k_from_the_heuristic():
    # K 2048 and one N tile: choose_split_k splits in 4 (512 of K each), as the GPU would
    x, q, qweight, scales, zeros = _operands(1, 2048, 64, 128, torch.float32, seed=2)
    assert choose_split_k(tiles=1, k=2048, sms=132, programs_per_sm=PROGRAMS_PER_SM) == 4
    assert_gemm_within_rounding(w4a16_gemm(x, qweight, scales, zeros, 128), x,
                                dequantize_from_layout(q, scales, zeros, 128))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n,group_size", SHAPES)
def test_dequantize_int4_triton(k, n, group_size, dtype):
    _, q, qweight, scales, zeros = _operands(1, k, n, group_size, dtype, seed=3)
    got, want = dequantize_int4_triton(qweight, scales, zeros, group_size), dequantize_int4(qweight, scales, zeros,
                                                                                            group_size)
    if dtype == torch.bfloat16:  # the interpreter truncates where torch (and the GPU) round to nearest
        assert (got.float() - want.float()).abs().le(want.float().abs() * ULP[dtype]).all()
    else:  # the same float32 arithmetic, rounded alike: the same bits
        assert torch.equal(got, want)


@interpreted
@pytest.mark.parametrize("m", [1, 17])
def test_large_m_path_dequantizes_then_multiplies(m):
    x, q, qweight, scales, zeros = _operands(m, 256, 200, 64, torch.float16, seed=4)
    got = w4a16_gemm(x, qweight, scales, zeros, 64, dequant_min_m=1)  # every M takes the prefill path
    assert torch.equal(got, x @ dequantize_int4(qweight, scales, zeros, 64))  # fp16 dequant is exact here


@interpreted
def test_strided_activations_and_empty_batch():
    x, q, qweight, scales, zeros = _operands(6, 256, 72, 32, torch.float32, seed=5)
    w = dequantize_from_layout(q, scales, zeros, 32)
    assert_gemm_within_rounding(w4a16_gemm(x[::2], qweight, scales, zeros, 32), x[::2], w)  # row stride 2K
    assert w4a16_gemm(x[:0], qweight, scales, zeros, 32).shape == (0, 72)
