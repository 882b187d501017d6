"""The K/V write of the backends that call a library for attention (``flashinfer``, ``flash_attn``), and
the PyTorch write (the ``torch`` backend, and the others' CPU path).

On CUDA it is kvforge's Triton ``reshape_and_cache`` (``kvforge.kernels.attention``): one launch for K
and V, and a slot of -1 (a CUDA graph's padding row) writes nothing, which ``index_copy_`` cannot do.
Elsewhere (the CPU tests of these backends, with a stand-in library) two ``index_copy_``: no graphs run
there, so every slot is real.

An FP8 cache stores ``clamp(x / scale, -448, 448)`` rounded to e4m3 (round to nearest even; the clamp
makes the cast saturate, never NaN), computed in float32 on both paths.
"""
from __future__ import annotations

import torch

from kvforge.attention import FP8_E4M3_MAX, as_bytes


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [..] stored as FP8 ``dtype`` under ``scale`` ([1] float32): saturated, rounded to nearest."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_scales: torch.Tensor | None = None) -> None:
    """``write_kv`` in PyTorch ops; every slot must be real (>= 0). ``kv_scales``: [2] float32 (k, v)
    for an FP8 cache."""
    hkv, d = k.shape[1], k.shape[2]
    if kv_scales is not None:
        k = quantize_kv(k, kv_scales[0:1], kv_cache.dtype)
        v = quantize_kv(v, kv_scales[1:2], kv_cache.dtype)
    # FP8: index_copy_ through bytes (no float8 index_copy_ on the CPU)
    cache, k, v = as_bytes(kv_cache), as_bytes(k), as_bytes(v)
    cache[0].view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    cache[1].view(-1, hkv, d).index_copy_(0, slot_mapping, v)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """k, v: [num_tokens, kv_heads, head_size]; kv_cache: [2, blocks, block_size, kv_heads, head_size];
    kv_scales: [2] float32 (k, v) on the cache's device for an FP8 cache, else None."""
    if kv_cache.device.type == "cuda":
        from kvforge.kernels import attention

        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        attention.reshape_and_cache(k, v, kv_cache, slot_mapping, kv_scales)
        return
    write_kv_torch(k, v, kv_cache, slot_mapping, kv_scales)
