"""What the Triton kernel modules share: loading triton lazily, and fitting tile sizes to small dimensions.

Importing a kernel module never imports triton: its kernels are built on first use through
:func:`kernel_loader`, and a missing or broken triton means the caller's torch reference runs instead.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable


def kernel_loader(build: str) -> Callable[[], tuple[Any, Any] | None]:
    """A cached loader of ``(triton, build(triton, tl))``, or None when triton does not import. ``build`` is
    ``"module:function"``, imported only when the loader first runs."""
    module, _, name = build.partition(":")

    @functools.lru_cache(maxsize=1)
    def load() -> tuple[Any, Any] | None:
        try:
            import triton
            import triton.language as tl
        except Exception:  # noqa: BLE001 - a missing or broken triton means the torch reference
            return None
        return triton, getattr(importlib.import_module(module), name)(triton, tl)

    return load


def fit_block(block: int, dim: int) -> int:
    """``block`` shrunk to the dimension: a power of two >= 16 (tl.dot's minimum), for small ranks and tests."""
    return min(block, max(16, 1 << max(dim - 1, 0).bit_length()))
