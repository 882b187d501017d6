"""Fused elementwise kernels for the model plugins: RMSNorm (with the residual add; Gemma's ``1 + w``
variant), per-head q/k RMSNorm, RoPE, SiLU-and-mul.

Unfused, these are ~30 small torch kernels per layer: a third of a prefill step's GPU time and a
quarter of a decode step's on the H200 (``benchmarks/kernel_profile.py``). Each kernel here does one
pass over its tensor and rounds exactly where Hugging Face's eager code rounds (RMSNorm statistics in
float32, the result cast to the model dtype before the weight multiply; RoPE's cos/sin cast to the
model dtype, each product rounded, then the sum), so the fused model computes the same values as the
torch path up to the order of a float32 reduction.

Every op has a torch reference, used on the CPU, when triton is missing, or with
``KVFORGE_FUSED_OPS=0``; ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (the tests do).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def _triton():
    if os.environ.get("KVFORGE_FUSED_OPS", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - a missing or broken triton means the torch path
        return None
    return triton, tl, _build_kernels(triton, tl)


def use_fused(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for this tensor (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if x.is_cuda:
        return _triton() is not None
    return os.environ.get("TRITON_INTERPRET") == "1" and _triton() is not None


def _build_kernels(triton, tl):
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
        if OFFSET:  # Gemma: times (1 + w) in float32, one rounding
            y = (xf * tl.math.rsqrt(var + eps) * (1.0 + w)).to(out_ptr.dtype.element_ty)
        else:  # rounded to the input dtype, then times w
            y = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
            y = (y.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)

    @triton.jit
    def qk_norm_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                       num_q_heads, num_k_heads, head_dim, eps, OFFSET: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        """In place, one program per token: RMSNorm over head_dim of every q head and every k head."""
        tok = tl.program_id(0)
        heads = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        dt = q_ptr.dtype.element_ty
        for which in tl.static_range(2):
            if which == 0:
                base, w_ptr, stride_t, stride_h, nh = q_ptr, qw_ptr, stride_qt, stride_qh, num_q_heads
            else:
                base, w_ptr, stride_t, stride_h, nh = k_ptr, kw_ptr, stride_kt, stride_kh, num_k_heads
            ptr = base + tok * stride_t + heads[:, None] * stride_h + offs_d[None, :]
            mask = (heads[:, None] < nh) & (offs_d[None, :] < head_dim)
            xf = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / head_dim + eps)
            w = tl.load(w_ptr + offs_d, mask=offs_d < head_dim, other=0.0).to(tl.float32)
            if OFFSET:
                y = (xf * inv[:, None] * (1.0 + w[None, :])).to(dt)
            else:
                y = ((xf * inv[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt)
            tl.store(ptr, y, mask=mask)

    @triton.jit
    def rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                    stride_c, num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        tok = tl.program_id(0)
        pos = tl.load(pos_ptr + tok)
        offs_d = tl.arange(0, HALF)
        dt = q_ptr.dtype.element_ty
        c = tl.load(cos_ptr + pos * stride_c + offs_d).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_c + offs_d).to(dt).to(tl.float32)
        heads = tl.arange(0, BLOCK_H)
        for which in tl.static_range(2):
            if which == 0:
                base, stride_t, stride_h, nh = q_ptr, stride_qt, stride_qh, num_q_heads
            else:
                base, stride_t, stride_h, nh = k_ptr, stride_kt, stride_kh, num_k_heads
            ptr = base + tok * stride_t + heads[:, None] * stride_h + offs_d[None, :]
            mask = heads[:, None] < nh
            x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
            # q * cos + rotate_half(q) * sin, every product rounded to the model dtype as in eager torch
            o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
            o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
            tl.store(ptr, o1, mask=mask)
            tl.store(ptr + HALF, o2, mask=mask)

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

    return {"rms_norm": rms_norm_kernel, "qk_norm": qk_norm_kernel, "rope": rope_kernel,
            "silu_and_mul": silu_and_mul_kernel}


# ---- RMSNorm ---------------------------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             offset: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``; with ``residual``: ``residual += x`` (in place) and returns ``(norm(residual), residual)``.
    ``offset``: Gemma's norm, ``x / rms(x) * (1 + weight)`` in float32 then cast.

    x, residual: [rows, dim], rows contiguous in the last dimension.
    """
    if not use_fused(x) or x.dim() != 2 or x.stride(-1) != 1:
        if residual is None:
            return rms_norm_ref(x, weight, eps, offset)
        residual.add_(x)
        return rms_norm_ref(residual, weight, eps, offset), residual
    triton, _, kernels = _triton()
    rows, dim = x.shape
    dtype = x.dtype if offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((rows, dim), dtype=dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(dim)
        res = residual if residual is not None else x
        kernels["rms_norm"][(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), dim, eps,
                                     HAS_RESIDUAL=residual is not None, OFFSET=offset, BLOCK=block,
                                     num_warps=min(16, max(1, block // 256)))
    return out if residual is None else (out, residual)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, heads, D] and k [T, kv_heads, D] (Qwen3's and Gemma 3's q/k norms):
    in place on the fused path (views of the QKV projection are fine), one kernel for both."""
    if (not use_fused(q) or q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1
            or q.dtype != k.dtype):
        return rms_norm_ref(q, q_weight, eps, offset), rms_norm_ref(k, k_weight, eps, offset)
    triton, _, kernels = _triton()
    n, d = q.shape[0], q.shape[-1]
    if n:
        kernels["qk_norm"][(n,)](q, k, q_weight, k_weight, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                 q.shape[1], k.shape[1], d, eps, OFFSET=offset,
                                 BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
                                 BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    return q, k


# ---- RoPE ------------------------------------------------------------------------------------------

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's cos/sin rows for ``positions``, cast to ``dtype``: [T, 1, head_dim] each."""
    return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)


def rope_with_tables(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor,
                     s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_with_tables(q, k, *rope_tables(positions, cos, sin, q.dtype))


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. q: [T, heads, D], k: [T, kv_heads, D] (views are fine: rotated in place on the
    fused path); cos, sin: float32 [max_pos, D] caches (the two halves equal)."""
    d = q.shape[-1]
    if (not use_fused(q) or q.stride(-1) != 1 or k.stride(-1) != 1 or d % 2 or (d // 2) & (d // 2 - 1)
            or cos.stride(-1) != 1):
        return rope_ref(positions, q, k, cos, sin)
    triton, _, kernels = _triton()
    n = q.shape[0]
    if n:
        kernels["rope"][(n,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              cos.stride(0), q.shape[1], k.shape[1], HALF=d // 2,
                              BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])), num_warps=4)
    return q, k


# ---- SiLU and mul -------------------------------------------------------------------------------------

def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * I] (gate | up) -> silu(gate) * up, [rows, I]."""
    if not use_fused(x) or x.dim() != 2 or x.stride(-1) != 1:
        return silu_and_mul_ref(x)
    triton, _, kernels = _triton()
    rows, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        kernels["silu_and_mul"][(rows, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter,
                                                                  BLOCK=block, num_warps=4)
    return out
