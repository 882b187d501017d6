"""Fused elementwise kernels of the model plugins and their launchers: RMSNorm (with the residual add;
Gemma's ``1 + w`` variant), per-head q/k RMSNorm, RoPE, SiLU-and-mul.

``kvforge.plugins.models.fused_ops`` holds the torch references and decides which path runs (it says
why these exist and how they round); the launchers here take tensors it has already checked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.kernels import launcher

# ---- shared code ----------------------------------------------------------------------------------------


@triton.jit
def _weighted(normed, w, in_ptr, out_ptr, OFFSET: tl.constexpr):
    """``normed`` (x / rms(x), float32) times the weight, rounded where Hugging Face rounds: Gemma
    (OFFSET) times ``1 + w`` in float32, one rounding to out's dtype; otherwise rounded to the input's
    dtype, then times ``w``, then rounded to out's."""
    if OFFSET:
        y = normed * (1.0 + w)
    else:
        y = normed.to(in_ptr.dtype.element_ty).to(tl.float32) * w
    return y.to(out_ptr.dtype.element_ty)


@triton.jit
def _norm_heads(base, w_ptr, tok, stride_t, stride_h, num_heads, head_dim, eps,
                OFFSET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """In place: RMSNorm over head_dim of every head of one token of ``base``."""
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ptr = base + tok * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    mask = (heads[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    xf = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / head_dim + eps)
    w = tl.load(w_ptr + offs_d, mask=offs_d < head_dim, other=0.0).to(tl.float32)
    tl.store(ptr, _weighted(xf * inv[:, None], w[None, :], base, base, OFFSET), mask=mask)


@triton.jit
def _rotate_heads(base, tok, stride_t, stride_h, num_heads, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """In place: neox RoPE of every head of one token of ``base`` (c, s: [HALF] float32, rounded to the
    model dtype)."""
    dt = base.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)
    ptr = base + tok * stride_t + heads[:, None] * stride_h + tl.arange(0, HALF)[None, :]
    mask = heads[:, None] < num_heads
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    # q * cos + rotate_half(q) * sin, every product rounded to the model dtype as in eager torch
    o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    tl.store(ptr, o1, mask=mask)
    tl.store(ptr + HALF, o2, mask=mask)


# ---- kernels --------------------------------------------------------------------------------------------

@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)  # rounded as torch's add
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, _weighted(xf * tl.math.rsqrt(var + eps), w, x_ptr, out_ptr, OFFSET),
             mask=mask)


@triton.jit
def qk_norm_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   num_q_heads, num_k_heads, head_dim, eps, OFFSET: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """In place, one program per token: RMSNorm over head_dim of every q head and every k head."""
    tok = tl.program_id(0)
    _norm_heads(q_ptr, qw_ptr, tok, stride_qt, stride_qh, num_q_heads, head_dim, eps, OFFSET, BLOCK_H, BLOCK_D)
    _norm_heads(k_ptr, kw_ptr, tok, stride_kt, stride_kh, num_k_heads, head_dim, eps, OFFSET, BLOCK_H, BLOCK_D)


@triton.jit
def rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_c, num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    offs_d = tl.arange(0, HALF)
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_c + offs_d).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + offs_d).to(dt).to(tl.float32)
    _rotate_heads(q_ptr, tok, stride_qt, stride_qh, num_q_heads, c, s, HALF, BLOCK_H)
    _rotate_heads(k_ptr, tok, stride_kt, stride_kh, num_k_heads, c, s, HALF, BLOCK_H)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * u).to(dt), mask=mask)


# ---- launchers ------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
             offset: bool) -> torch.Tensor:
    """``norm(x)`` (``residual``: ``residual += x`` in place first, and ``norm(residual)``); x, residual
    [rows, dim] with contiguous rows. Returns the norm only."""
    rows, dim = x.shape
    dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((rows, dim), dtype=dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(dim)
        res = residual if residual is not None else x
        launcher(rms_norm_kernel, (rows,))(x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), dim, eps,
                                 HAS_RESIDUAL=residual is not None, OFFSET=offset, BLOCK=block,
                                 num_warps=min(16, max(1, block // 256)))
    return out


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                offset: bool) -> None:
    """Per-head RMSNorm of q [T, heads, D] and k [T, kv_heads, D] (one dtype, contiguous heads), in place."""
    n, d = q.shape[0], q.shape[-1]
    if n:
        launcher(qk_norm_kernel, (n,))(q, k, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             q.shape[1], k.shape[1], d, eps, OFFSET=offset,
                             BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
                             BLOCK_D=triton.next_power_of_2(d), num_warps=4)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox RoPE of q [T, heads, D] and k [T, kv_heads, D] in place (D / 2 a power of two); cos, sin:
    float32 [max_pos, D] with contiguous rows."""
    n = q.shape[0]
    if n:
        launcher(rope_kernel, (n,))(q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                          cos.stride(0), q.shape[1], k.shape[1], HALF=q.shape[-1] // 2,
                          BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])), num_warps=4)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * I] (gate | up), contiguous rows -> silu(gate) * up, [rows, I]."""
    rows, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        launcher(silu_and_mul_kernel, (rows, triton.cdiv(inter, block)))(x, out, x.stride(0), out.stride(0), inter,
                                                              BLOCK=block, num_warps=4)
    return out
