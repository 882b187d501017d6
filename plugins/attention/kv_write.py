"""The K/V write of the backends that call a library for attention (``flashinfer``, ``flash_attn``).

On CUDA it is kvforge's Triton ``reshape_and_cache``: one launch for K and V, and a slot of -1 (a CUDA
graph's padding row) writes nothing, which ``index_copy_`` cannot do. Elsewhere (the CPU tests of these
backends, with a stand-in library) two ``index_copy_``: no graphs run there, so every slot is real.
"""
from __future__ import annotations

import torch


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, kv_heads, head_size]; kv_cache: [2, blocks, block_size, kv_heads, head_size]."""
    if kv_cache.device.type == "cuda":
        from kvforge.plugins.attention import triton_kernels

        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        triton_kernels.reshape_and_cache(k, v, kv_cache, slot_mapping)
        return
    hkv, d = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, hkv, d).index_copy_(0, slot_mapping, v)
