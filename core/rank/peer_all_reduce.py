"""``PeerAllReduce``: the all-reduce of small messages over the GPUs' peer memory (NVLink), for a
tensor-parallel group on one node; NCCL keeps the large ones.

A decode step of a 32-layer model all-reduces 64 times a step, each a few KB to 2 MB (batch x
hidden, bf16). NCCL's ring costs about 23 us a call there even replayed in a CUDA graph, 1.5 ms of a
few-ms step (docs/distributed.md). Here every rank copies its part into a buffer of PyTorch's
symmetric memory (mapped into every rank of the group), and one kernel reads all ranks' parts and sums
them: ``torch.ops.symm_mem.one_shot_all_reduce_out`` (each rank reads everything: fewest steps, the
choice for small messages), or ``two_shot_all_reduce_`` (reduce-scatter then all-gather through the
same memory: less traffic, for messages from 256 KB). A producer can write its message straight into
the buffer (:meth:`PeerAllReduce.staging`), which saves the copy in. Both synchronise through signal pads
that reset themselves, so they replay inside CUDA graphs. Neither uses NVLink multicast
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` leaves it off; the ``multimem_*`` ops, which need it, are never
called).

Which path a call takes depends only on its size and dtype, the same on every rank (two ranks on two
paths would wait for each other forever): bf16 or float32, contiguous, at most ``max_bytes``; other
calls go to NCCL. The sums are in the tensor's dtype in a fixed rank order, so every rank gets the same
bits (bf16 adds in bf16, as NCCL's ring does).

The symmetric buffer is allocated once and kept for the process's life (PyTorch's symmetric-memory
pool can hand ranks mismatched slots when one is freed and reused): ``max_bytes`` of device memory.
"""
from __future__ import annotations

import logging
import math
from typing import Any, cast

import torch

logger = logging.getLogger(__name__)

#: the largest message that goes over peer memory: a decode step of 256 sequences of a 4096-wide bf16
#: hidden state is 2 MiB; prefill steps are larger and go to NCCL
MAX_BYTES = 4 << 20
#: messages of at least this many bytes take the two-shot kernel, at any number of ranks: its kernel was
#: faster than one-shot's at every size measured on H100s (2 and 4 GPUs, docs/distributed.md), but it
#: adds a copy out of the buffer (a few us), which pays from some hundreds of KB
TWO_SHOT_BYTES = 256 << 10
WORLD_SIZES = (2, 4, 8)  # the sizes PyTorch's kernels are built for
DTYPES = (torch.bfloat16, torch.float32)


class PeerAllReduce:
    """One tensor-parallel group's peer-memory all-reduce (build it on every rank of the group, in the
    same order)."""

    def __init__(self, name: str, backend: Any, store: Any, rank: int, size: int, device: torch.device,
                 max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem
        from torch.distributed import ProcessGroup

        if size not in WORLD_SIZES:
            raise ValueError(f"peer all-reduce: {size} ranks (PyTorch's kernels take {WORLD_SIZES})")
        # NOTE: symmetric memory finds its group by name in c10d's registry: register one that wraps the
        # engine's private NCCL backend (its store carries the rendezvous), as vLLM does for its groups
        group = ProcessGroup(store, rank, size)
        group._set_default_backend(ProcessGroup.BackendType.NCCL)
        group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, backend)
        group._set_group_name(cast(Any, name))  # (a GroupName is a str)
        torch._C._distributed_c10d._register_process_group(name, group)  # pyright: ignore[reportAttributeAccessIssue]
        self.name, self.size, self.max_bytes, self._group = name, size, max_bytes, group
        with torch.cuda.device(device):
            self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(self.buffer, cast(Any, name))
        if getattr(handle, "multicast_ptr", 0):
            logger.warning("peer all-reduce: the buffer has a multicast address; only peer reads are used")
        self.calls = 0  # all-reduces that took this path (eager calls; a graph's replays do not count)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes over peer memory (a function of its size and dtype only)."""
        return x.dtype in DTYPES and x.is_contiguous() and 0 < x.numel() * x.element_size() <= self.max_bytes

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The buffer itself as a tensor of ``shape`` and ``dtype``, for a producer to write a message
        into (``RowParallelLinear``'s matmul), saving the copy in; None if such a message does not take
        this path. Pass it to :meth:`__call__` before anything else is reduced."""
        numel = math.prod(shape)
        if dtype not in DTYPES or not 0 < numel * dtype.itemsize <= self.max_bytes:
            return None
        return self.buffer.view(dtype)[:numel].view(shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group; returns the sum: ``x`` itself (in place), or a new tensor if ``x``
        is :meth:`staging`'s view of the buffer (the buffer is the next message's)."""
        flat = x.view(-1)
        staged = self.buffer.view(x.dtype)[:flat.numel()]
        in_buffer = flat.data_ptr() == staged.data_ptr()
        out = torch.empty_like(flat) if in_buffer else flat
        if not in_buffer:
            staged.copy_(flat)
        if flat.numel() * x.element_size() < TWO_SHOT_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.name, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.name)
            out.copy_(staged)
        self.calls += 1
        return out.view(x.shape)

    def close(self) -> None:
        """Leave c10d's registry (the buffer stays: see the module's note)."""
        try:
            torch._C._distributed_c10d._unregister_process_group(self.name)  # pyright: ignore[reportAttributeAccessIssue]
        except Exception:  # already gone
            pass


def peer_all_reduce(name: str, backend: Any, store: Any, rank: int, size: int,
                    device: torch.device) -> PeerAllReduce | None:
    """The group's peer all-reduce where this node allows it (CUDA, 2/4/8 ranks, every pair of GPUs peers,
    PyTorch's symmetric memory present), else None (every all-reduce then goes to NCCL), with the reason
    logged."""
    why = None
    if device.type != "cuda":
        why = "not on CUDA"
    elif size not in WORLD_SIZES:
        why = f"{size} ranks"
    else:
        n = torch.cuda.device_count()
        if not all(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b):
            why = "the GPUs are not all peers"
    if why is None:
        try:
            return PeerAllReduce(name, backend, store, rank, size, device)
        except Exception as exc:  # an older PyTorch, a driver without the needed calls: NCCL does it all
            why = f"{type(exc).__name__}: {exc}"
    logger.info("peer all-reduce off (%s): NCCL takes every all-reduce", why)
    return None
