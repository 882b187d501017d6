"""The FP8 kernels (``kvforge.kernels.fp8``, through ``fp8``'s launchers) in Triton's CPU interpreter:
per-token and static activation quantization against ``fp8.quantize_rows``'s arithmetic / the static
formula, and the scaled FP8 GEMM against the exact products of the same e4m3 operands.

The per-token kernel reproduces quantize_rows as it runs on CUDA, where torch divides ``amax`` by the
Python number 448 as a multiplication by its float32 reciprocal; on the CPU torch divides, which
rounds differently for some amax. So here the kernel is compared with that CUDA arithmetic written
out in torch (``quantize_rows_as_on_cuda``), and with quantize_rows itself on the GPU.

What runs where: Triton 3.9's interpreter rounds float32 to e4m3 wrongly (the mantissa's carry into
the exponent is dropped: 0.0306 becomes 0.0156; ties go up; subnormals are lost), so here the quantize
kernels write into a float32 ``out`` and the test compares the values before that rounding, bit for
bit, then rounds them with torch; the e4m3 store itself is compared bit for bit with quantize_rows on
the GPU (tests/gpu/test_quant_kernels_gpu.py). The GEMM's e4m3 operands are made by torch and widened
exactly by the interpreter, so the GEMM is tested here on e4m3 inputs.
"""
import importlib.util

import pytest
import torch
from quant_reference import assert_gemm_within_rounding

from kvforge.plugins.quantization.fp8 import (
    FP8,
    FP8_MAX,
    MIN_SCALE,
    fp8_gemm,
    fp8_gemm_reference,
    quantize_per_token_fp8,
    quantize_rows,
    quantize_static_fp8,
)
from testing_support import IN_INTERPRETER, interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from kvforge.kernels.quant_gemm import GemmConfig  # imports triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _activations(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of magnitudes 1e-4 .. 1e4 (subnormal e4m3 values in every row), two of them all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 4, m).unsqueeze(1)
    x[:, :8] *= 1e-3  # far below the row's amax: subnormal or zero after scaling
    x[1] = 0
    x[-1] = 0
    return x.to(dtype)


def quantize_rows_as_on_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows' float32 operations as torch runs them on CUDA: (values before the e4m3
    rounding, scale [rows, 1])."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX), scale


def _gemm_operands(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xq, xs = quantize_rows(torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1))
    wq, ws = quantize_rows(torch.randn(n, k, generator=g) * 0.02)
    return xq, xs, wq, ws


def _assert_gemm(got: torch.Tensor, xq, xs, wq, ws) -> None:
    """Within the bound of quant_reference (the scales folded into float64 operands: their two float32
    multiplications add 2 u, inside the bound's per-product term)."""
    assert_gemm_within_rounding(got, xq.double() * xs.double(), (wq.double() * ws.double()).t())


@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the interpreter")
def test_kernels_in_interpreter(run_in_triton_interpreter):
    run_in_triton_interpreter(__file__)


@pytest.mark.skipif(IN_INTERPRETER, reason="outside the interpreter only")
def test_cpu_uses_the_references():
    x = _activations(5, 64, torch.bfloat16)
    q, s = quantize_per_token_fp8(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    scale = torch.tensor([0.5])
    assert torch.equal(quantize_static_fp8(x, scale).view(torch.uint8),
                       (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8))
    xq, xs, wq, ws = _gemm_operands(3, 64, 24)
    assert torch.equal(fp8_gemm(xq, xs, wq, ws, torch.bfloat16), fp8_gemm_reference(xq, xs, wq, ws, torch.bfloat16))


def test_bad_operands_are_refused_by_name():
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="out must be"):
        quantize_per_token_fp8(x, out=torch.empty(2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="scale must be one float32 value"):
        quantize_static_fp8(x, torch.ones(2))
    xq, xs, wq, ws = _gemm_operands(2, 32, 8)
    with pytest.raises(ValueError, match="the same K"):
        fp8_gemm(xq, xs, wq[:, :16], ws, torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_scale must be float32 \[8, 1\]"):
        fp8_gemm(xq, xs, wq, ws.t(), torch.bfloat16)


# ---- in the interpreter -------------------------------------------------------------------------------

@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [300, 4096 + 904])  # one masked block; two blocks of QUANT_BLOCK = 4096
def test_per_token_quantization_matches_quantize_rows_arithmetic(dtype, k):
    x = _activations(9, k, dtype)
    want_values, want_scale = quantize_rows_as_on_cuda(x)
    values = torch.empty(x.shape, dtype=torch.float32)
    q, scale = quantize_per_token_fp8(x, out=values)
    assert q is values and scale.shape == (9, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, want_scale)  # same bits
    assert torch.equal(values, want_values)  # same bits before the e4m3 rounding
    assert values[1].eq(0).all() and scale[1].item() == torch.tensor(MIN_SCALE).item()  # an all-zero row


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_static_quantization(dtype):
    x = _activations(5, 300, dtype)[:, ::2]  # a row stride twice the row: the launcher copies it
    scale = torch.tensor([0.37])
    values = quantize_static_fp8(x, scale, out=torch.empty(x.shape, dtype=torch.float32))
    assert torch.equal(values, (x.float() / scale).clamp(-FP8_MAX, FP8_MAX))


@interpreted
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(256, 200), (384, 64), (200, 72)])  # N off the tile; a masked K tail
@pytest.mark.parametrize("m", [1, 3, 17])
def test_fp8_gemm_matches_the_exact_products(m, k, n, out_dtype):
    xq, xs, wq, ws = _gemm_operands(m, k, n)
    got = fp8_gemm(xq, xs, wq, ws, out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    _assert_gemm(got, xq, xs, wq, ws)


@interpreted
@pytest.mark.parametrize("config", [
    GemmConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=2, split_k=2),
    GemmConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=2, split_k=5),
], ids=["split2", "split5"])
def test_fp8_gemm_split_k(config):
    xq, xs, wq, ws = _gemm_operands(17, 640, 200, seed=1)
    _assert_gemm(fp8_gemm(xq, xs, wq, ws, torch.float32, config=config), xq, xs, wq, ws)
