"""Every Triton kernel of kvforge, one module per subject, each kernel a module-level ``@triton.jit``
next to the host-side launchers that take torch tensors, compute the grid and launch it:

- ``moe``: the fused mixture-of-experts GEMMs, the routing and the pair alignment (``kvforge.layers.fused_moe``);
- ``lora``: the segmented (Punica-style) LoRA GEMM and its split-K sum (``kvforge.lora.ops``);
- ``attention``: the ``triton`` backend's paged attention and the K/V cache write;
- ``quant_gemm``: what the quantized GEMMs share (block-size configs, split-K, the partials' sum);
- ``int4``: the W4A16 GEMM and the INT4 dequantization; ``fp8``: FP8 activation quantization and GEMM;
- ``model_ops``: the model plugins' fused RMSNorm, q/k norm, RoPE and SiLU-and-mul.

The kernel modules import triton at their top. Nothing else in kvforge imports them at its own top: a
caller asks :func:`runs_on` (or :func:`triton_imports`) whether the kernels can run, and imports the
kernel module inside the function that launches it, so importing kvforge and discovering its plugins
never imports triton (nor needs CUDA), and a missing or broken triton means the caller's torch
reference runs instead. This package's ``__init__`` imports neither triton nor torch.

Module level, not built in a function: Triton's CPU interpreter (TRITON_INTERPRET=1, the tests) runs a
kernel's source in its module's globals, where a helper ``@triton.jit`` held in a closure would not be
found; at module level the kernels share helpers (a tile order, a split-K prologue and epilogue) instead
of writing them out again.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Protocol

__all__ = ["Launch", "fit_block", "launcher", "runs_on", "triton_imports"]


class Launch(Protocol):
    """A kernel bound to its grid: called with the kernel's arguments, its constexpr values and triton's
    launch options (``num_warps``, ``num_stages``)."""

    def __call__(self, *args: object, **kwargs: object) -> object: ...


def launcher(kernel: object, grid: object) -> Launch:
    """``kernel[grid]``, typed as the launch it is. Triton types a ``@triton.jit`` function as the function
    it wraps, so ``kernel[grid](..., num_warps=4)`` reads as a call with unknown keywords and ints passed
    as ``tl.constexpr``; every launch in this package goes through here, the one place that says so."""
    return kernel[grid]  # pyright: ignore[reportIndexIssue] - a JITFunction, typed as its wrapped function


@functools.lru_cache(maxsize=1)
def triton_imports() -> bool:
    """Whether triton (and triton.language) imports here; a missing or broken triton means the callers'
    torch references run instead."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a missing or broken triton means the torch reference
        return False
    return True


def runs_on(x: Any) -> bool:
    """Whether the Triton kernels run for the tensor ``x``: on CUDA, or on the CPU under TRITON_INTERPRET=1
    (Triton's interpreter, as the tests run them), wherever triton imports."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return triton_imports()


def fit_block(block: int, dim: int) -> int:
    """``block`` shrunk to the dimension: a power of two >= 16 (tl.dot's minimum), for small ranks and tests."""
    return min(block, max(16, 1 << max(dim - 1, 0).bit_length()))
