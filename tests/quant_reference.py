"""References for the quantized-kernel tests (tests/plugins/quantization, tests/gpu), written from the
layout definitions rather than from the code under test, and the rounding bounds they are held to.

Bounds, not tolerances: for ``got ~ x @ w`` in a dtype with unit roundoff ``u_out``, accumulated in
float32 (``u = 2**-24``) in any order, the error of each output is at most

    (w_rel + 2 * (K + 1) * u) * (|x| @ |w|)  +  out_rel * |x @ w|

``2 (K + 1) u``: a float32 sum of K products in any order (K u, doubled for tensor cores, which
truncate rather than round when they align addends), plus one rounding per product (bf16 and fp16
products are exact in float32; float32 products are not). ``w_rel``: how far the kernel's
dequantized weights may be from the reference's (0 where both round to nearest; one bf16 ulp,
2**-7, where Triton's CPU interpreter truncates float32 to bf16). ``out_rel``: the rounding of the
output to its dtype (a full ulp, as the interpreter truncates bf16).
"""
from __future__ import annotations

import torch

#: relative size of one ulp of each output dtype (an upper bound on one rounding or truncation)
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] (0..15) -> int32 [K // 8, N]: bits 4j..4j+3 of row r hold q[8r + j]."""
    q = q.to(torch.int32)
    packed = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int32, device=q.device)
    for j in range(8):
        packed |= q[j::8] << (4 * j)  # NOTE: j = 7 sets the sign bit for q >= 8: int32 wraps, as the layout wants
    return packed


def random_int4_weight(k: int, n: int, group_size: int, dtype: torch.dtype, generator: torch.Generator,
                       device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """(q [K, N], qweight [K // 8, N], scales, zeros [K // G, N]) with random values: zero points
    integers and half-integers (exact in every dtype), scales 0.25..0.75 / sqrt(K) (outputs of order 1
    for standard-normal x)."""
    q = torch.randint(0, 16, (k, n), generator=generator, device=device, dtype=torch.int32)
    groups = k // group_size
    scales = ((0.5 + torch.rand(groups, n, generator=generator, device=device)) * 0.5 / k ** 0.5).to(dtype)
    zeros = (torch.randint(0, 16, (groups, n), generator=generator, device=device)
             + 0.5 * torch.randint(0, 2, (groups, n), generator=generator, device=device)).to(dtype)
    return q, pack_int4(q), scales, zeros


def dequantize_from_layout(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n] in float32, rounded to scales' dtype."""
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return ((q.float() - zeros.float()[g]) * scales.float()[g]).to(scales.dtype)


def assert_gemm_within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, w_rel: float = 0.0,
                                out_rel: float | None = None) -> None:
    """``got ~ x [M, K] @ w [K, N]`` within the bound of the module docstring (float64 reference)."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64
    magnitude = x64.abs() @ w64.abs()
    out_rel = ULP[got.dtype] if out_rel is None else out_rel
    bound = (w_rel + 2 * (x.shape[1] + 1) * 2.0 ** -24) * magnitude + out_rel * ref.abs()
    err = (got.double() - ref).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{int((err > bound).sum())} of {err.numel()} outputs outside the bound; worst "
                                  f"at {divmod(int(worst), err.shape[1])}: err {err.flatten()[worst].item():.3g} "
                                  f"> bound {bound.flatten()[worst].item():.3g}")
