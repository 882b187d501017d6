"""Fused elementwise kernels for the model plugins: RMSNorm (with the residual add; Gemma's ``1 + w``
variant), per-head q/k RMSNorm, RoPE, SiLU-and-mul.

Unfused, these are ~30 small torch kernels per layer: a third of a prefill step's GPU time and a
quarter of a decode step's on the H200 (``benchmarks/kernel_profile.py``). Each kernel here does one
pass over its tensor and rounds exactly where Hugging Face's eager code rounds (RMSNorm statistics in
float32, the result cast to the model dtype before the weight multiply; RoPE's cos/sin cast to the
model dtype, each product rounded, then the sum), so the fused model computes the same values as the
torch path up to the order of a float32 reduction.

Every op has a torch reference, used on the CPU, when triton is missing, or with
``KVFORGE_FUSED_OPS=0``; ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (the tests do). The
kernels and their launchers: ``kvforge.kernels.model_ops``, imported on first use.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kvforge.kernels import triton_imports


@functools.lru_cache(maxsize=1)
def _enabled() -> bool:
    """The kernels may run: triton imports and KVFORGE_FUSED_OPS is not 0 (read once)."""
    return os.environ.get("KVFORGE_FUSED_OPS", "1") != "0" and triton_imports()


def use_fused(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for this tensor (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    if x.is_cuda:
        return _enabled()
    return os.environ.get("TRITON_INTERPRET") == "1" and _enabled()


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
    from kvforge.kernels import model_ops

    out = model_ops.rms_norm(x, weight, eps, residual, offset)
    return out if residual is None else (out, residual)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, heads, D] and k [T, kv_heads, D] (Qwen3's and Gemma 3's q/k norms):
    in place on the fused path (views of the QKV projection are fine), one kernel for both."""
    if (not use_fused(q) or q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1
            or q.dtype != k.dtype):
        return rms_norm_ref(q, q_weight, eps, offset), rms_norm_ref(k, k_weight, eps, offset)
    from kvforge.kernels import model_ops

    model_ops.qk_rms_norm(q, k, q_weight, k_weight, eps, offset)
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
    from kvforge.kernels import model_ops

    model_ops.rope(positions, q, k, cos, sin)
    return q, k


# ---- SiLU and mul -------------------------------------------------------------------------------------

def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * I] (gate | up) -> silu(gate) * up, [rows, I]."""
    if not use_fused(x) or x.dim() != 2 or x.stride(-1) != 1:
        return silu_and_mul_ref(x)
    from kvforge.kernels import model_ops

    return model_ops.silu_and_mul(x)
