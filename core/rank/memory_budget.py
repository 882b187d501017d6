"""How much device memory an engine's KV cache may take, when other engines share the GPU.

``gpu_memory_utilization`` is this engine's share of the device (vLLM's meaning): two engines at 0.45
each fit on one GPU, in one process (several models behind one server) or in two. So an engine
counts only what it added itself: a :class:`MemoryBaseline` is taken when its worker starts, before
it loads anything, and the profiled peak and the memory outside torch's allocator are measured
against it. Memory other processes take later is not foreseen; memory that is not free at all is:
the budget never exceeds what is free now (blocks torch's allocator caches unused count as free), less
the activations a step still needs.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryBaseline:
    """The device's memory before this engine's worker allocated anything."""

    used: int  # bytes in use on the device (every process)
    allocated: int  # bytes this process's torch allocator had handed out (other engines' tensors)
    reserved: int  # bytes this process's torch allocator held

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(used=total - free, allocated=torch.cuda.memory_allocated(device),
                   reserved=torch.cuda.memory_reserved(device))


def kv_cache_budget(device: torch.device, baseline: MemoryBaseline, peak_allocated: int,
                    gpu_memory_utilization: float, rank: int) -> int:
    """Bytes for the KV cache: ``utilization x total`` less this engine's own profiled peak
    (``peak_allocated``: the process's peak allocation in the profile, KV cache excluded) and its own
    memory outside torch's allocator (CUDA context, NCCL, cuBLAS workspaces), capped by the free memory
    less the activations still to come. May be <= 0 (the caller refuses that)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = peak_allocated - baseline.allocated  # this engine's weights and peak activations
    own_used = (total - free) - baseline.used
    non_torch = max(own_used - (torch.cuda.memory_reserved(device) - baseline.reserved), 0)
    budget = total * gpu_memory_utilization - peak - non_torch
    activations = max(peak - (torch.cuda.memory_allocated(device) - baseline.allocated), 0)
    # NOTE: blocks torch's allocator caches but no tensor uses (a dropped engine's, not yet emptied) are
    # free to this engine too: an allocation that needs them makes the allocator give them back first
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    room = free + cached - activations
    logger.info("rank %d KV cache: peak forward %.2f GiB, non-torch %.2f GiB, %.2f GiB of %.2f GiB (share %.2f); "
                "%.2f GiB free now", rank, peak / GiB, non_torch / GiB, max(budget, 0) / GiB, total / GiB,
                gpu_memory_utilization, free / GiB)
    if room < budget:
        logger.warning("rank %d: gpu_memory_utilization=%.2f asks for %.2f GiB of KV cache, but only %.2f GiB is "
                       "free beside the activations (the device held %.2f GiB when this engine started): the cache gets that",
                       rank, gpu_memory_utilization, budget / GiB, max(room, 0) / GiB, baseline.used / GiB)
        budget = room
    return int(budget)


#: seconds :func:`release_device_memory` waits for the device's queued work
RELEASE_WAIT_S = 5.0


def release_device_memory(device: torch.device, wait_s: float = RELEASE_WAIT_S) -> bool:
    """Return the caching allocator's free blocks to the device once the last references are gone (a
    reference cycle can hold a tensor until the next collection, so one is run first) and the work
    queued on the device has ended. Waits at most ``wait_s``: a step whose collective waits for a dead
    rank never ends, and a blocking synchronize would hang the shutdown; False then (the blocks go back
    at the process's exit)."""
    gc.collect()
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return True
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + wait_s
    while not done.query():
        if time.monotonic() >= deadline:
            logger.warning("%s still runs queued work after %.0f s (a collective waiting for a rank that is gone?): "
                           "its cached memory goes back when the process exits", device, wait_s)
            return False
        time.sleep(0.001)
    torch.cuda.empty_cache()
    return True
