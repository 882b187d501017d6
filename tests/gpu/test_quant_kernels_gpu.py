"""The quantized-linear Triton kernels on the GPU at Llama-3-8B shapes (bf16): W4A16 (``kvforge.kernels.int4``)
and FP8 (``kvforge.kernels.fp8``), called through ``int4`` and ``fp8``, against their references, the FP8
quantization bit for bit (the e4m3 store the CPU interpreter cannot check), and CUDA-graph replay equal to
eager, bit for bit.
"""
import pytest
import torch
from quant_reference import assert_gemm_within_rounding, dequantize_from_layout, random_int4_weight

from kvforge.plugins.quantization.fp8 import FP8, FP8_MAX, quantize_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                             reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")

#: Llama-3-8B's linear layers per decoder layer: (K, N) of qkv, o, gate_up, down
LLAMA3_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def _int4(k, n, group_size=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return random_int4_weight(k, n, group_size, torch.bfloat16, g, device="cuda"), g


@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_w4a16_gemm_at_llama3_8b_shapes(layer):
    from kvforge.plugins.quantization.int4 import DEQUANT_MIN_M, w4a16_gemm

    k, n = LLAMA3_8B[layer]
    (q, qweight, scales, zeros), g = _int4(k, n)
    w = dequantize_from_layout(q, scales, zeros, 128)
    # decode (split-K), the buckets up to the threshold, and past it (dequantize + cuBLAS)
    for m in (1, 7, 16, 33, 64, 100, DEQUANT_MIN_M - 1, DEQUANT_MIN_M, 2048):
        x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
        assert_gemm_within_rounding(w4a16_gemm(x, qweight, scales, zeros, 128), x, w)


def test_w4a16_channelwise_and_odd_n():
    from kvforge.plugins.quantization.int4 import w4a16_gemm

    (q, qweight, scales, zeros), g = _int4(4096, 1000, group_size=4096)  # one group; N off every tile
    w = dequantize_from_layout(q, scales, zeros, 4096)
    for m in (1, 40):
        x = torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
        assert_gemm_within_rounding(w4a16_gemm(x, qweight, scales, zeros, 4096), x, w)


def test_dequantize_int4_triton_is_bit_identical():
    from kvforge.plugins.quantization.int4 import dequantize as dequantize_int4
    from kvforge.plugins.quantization.int4 import dequantize_int4_triton

    (_, qweight, scales, zeros), _ = _int4(14336, 4096, group_size=64)
    assert torch.equal(dequantize_int4_triton(qweight, scales, zeros, 64), dequantize_int4(qweight, scales, zeros, 64))


@pytest.mark.parametrize("m", [1, 64, 512])  # split-K, one kernel, dequantize + matmul
def test_w4a16_graph_replay_matches_eager_exactly(m):
    from kvforge.plugins.quantization.int4 import w4a16_gemm

    (_, qweight, scales, zeros), g = _int4(4096, 6144)
    x = torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    w4a16_gemm(x, qweight, scales, zeros, 128)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w4a16_gemm(x, qweight, scales, zeros, 128)
    for _ in range(2):
        x.copy_(torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(y, w4a16_gemm(x, qweight, scales, zeros, 128))


@fp8_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [4096, 14336])  # one block of the row; several
def test_per_token_fp8_is_bit_identical_to_quantize_rows(dtype, k):
    from kvforge.plugins.quantization.fp8 import quantize_per_token_fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, k, generator=g, device="cuda") * torch.logspace(-4, 4, 300, device="cuda").unsqueeze(1)
    x[:, :64] *= 1e-3  # subnormal e4m3 values in every row
    x[7] = 0
    x = x.to(dtype)
    q, scale = quantize_per_token_fp8(x)
    rq, rs = quantize_rows(x)
    assert q.dtype == FP8 and torch.equal(scale, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@fp8_gpu
def test_static_fp8_is_bit_identical():
    from kvforge.plugins.quantization.fp8 import quantize_static_fp8

    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16) * 30  # some values clamp at 448
    scale = torch.tensor([0.05], device="cuda")
    want = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert torch.equal(quantize_static_fp8(x, scale).view(torch.uint8), want.view(torch.uint8))


def _fp8_operands(m, k, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xq, xs = quantize_rows(torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16))
    wq, ws = quantize_rows(torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)
    return xq, xs, wq, ws


def _relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@fp8_gpu
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
def test_fp8_gemm_at_llama3_8b_shapes(layer):
    from kvforge.plugins.quantization.fp8 import fp8_gemm

    k, n = LLAMA3_8B[layer]
    for m in (1, 16, 64, 200, 2048):
        xq, xs, wq, ws = _fp8_operands(m, k, n)
        got = fp8_gemm(xq, xs, wq, ws, torch.bfloat16)
        exact = (xq.double() @ wq.double().t()) * xs.double() * ws.double().t()
        # NOTE: a norm, not an element bound: on Hopper the FP8 tensor cores add with ~14 bits within
        # each 128-long block of K. Rounding to bf16 alone leaves a relative error of ~2**-9 (rms);
        # 2**-8 holds it with the accumulation's share, and a wrong scale or a lost block fails by far
        assert _relative_error(got, exact) < 2 ** -8, (m, _relative_error(got, exact))
        ref = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
        assert _relative_error(got, ref) < 2 ** -7, m  # two bf16 roundings apart at most, in norm


@fp8_gpu
@pytest.mark.parametrize("m", [1, 64, 512])
def test_fp8_quant_and_gemm_graph_replay_matches_eager_exactly(m):
    from kvforge.plugins.quantization.fp8 import fp8_gemm, quantize_per_token_fp8

    k, n = LLAMA3_8B["o"]
    _, _, wq, ws = _fp8_operands(1, k, n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def forward(x):
        xq, xs = quantize_per_token_fp8(x)
        return fp8_gemm(xq, xs, wq, ws, torch.bfloat16)

    forward(x)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = forward(x)
    for _ in range(2):
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(y, forward(x))
