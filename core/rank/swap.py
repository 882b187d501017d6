"""The CPU swap pool: where the KV blocks of requests preempted by swapping wait.

One tensor per layer with the layer cache's shape and element type (the attention backend's
``kv_cache_shape`` and ``kv_cache_dtype``; an FP8 block moves as its bytes, its layer's scales stay
with the backend) but ``num_cpu_blocks`` blocks, pinned when the cache is on CUDA so the copies run
asynchronously on the current stream. A block is index ``[:, block]`` of a layer's tensor, on the
device as in the pool.
The pool is allocated on the first swap, so an engine that never swaps holds no host memory for it.

NOTE: the scheduler frees a swapped-out request's device blocks at once and may hand them to
another request (or a swap-in) in the same step, and a CPU block released by a swap-in may take a
swap-out of the same step. ``swap`` is therefore run before any other cache write of the step and
reads every source first: swap-in sources are staged on the device, then the swap-outs are copied,
then the staged blocks are written. A request must not be swapped both in and out in one step.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvforge.attention import AttentionBackend, as_bytes

Pairs = Sequence[tuple[int, int]]


class CPUSwapSpace:
    """``num_cpu_blocks`` blocks of every layer in host memory, and the copies in and out of it."""

    def __init__(self, attn: AttentionBackend, num_layers: int, num_cpu_blocks: int):
        self.attn = attn
        self.num_layers = num_layers
        self.num_cpu_blocks = num_cpu_blocks
        self.caches: list[torch.Tensor] = []  # per layer: kv_cache_shape(num_cpu_blocks), on the CPU

    def _allocate(self) -> None:
        pin = self.attn.device.type == "cuda" and torch.cuda.is_available()
        shape = self.attn.kv_cache_shape(self.num_cpu_blocks)
        # NOTE: empty, not zeros: pages of a large pool are only touched when a block is swapped
        self.caches = [torch.empty(shape, dtype=self.attn.kv_cache_dtype, pin_memory=pin)
                       for _ in range(self.num_layers)]

    def swap(self, device_caches: list[torch.Tensor], swap_out: Pairs = (), swap_in: Pairs = ()) -> None:
        """Copy ``(device, cpu)`` blocks out to the pool and ``(cpu, device)`` blocks back, every layer."""
        transfer(device_caches, [(self, swap_out, swap_in)])

    def ready(self) -> list[torch.Tensor]:
        """The pool's per-layer tensors, allocated on first use."""
        if not self.caches:
            if not self.num_cpu_blocks:
                raise ValueError("swap: the CPU swap pool is empty (swap_space=0)")
            self._allocate()
        return self.caches


def transfer(device_caches: list[torch.Tensor], pools: Sequence[tuple[CPUSwapSpace, Pairs, Pairs]]) -> None:
    """One step's copies between the device cache and host pools (the swap pool, a KV tier): for each
    pool its ``(device, cpu)`` outs and ``(cpu, device)`` ins. Every source is read before any block is
    written, layer by layer: the ins are staged on the device, the outs copied, then the staged ins
    written. So a device block that one pool reads and another writes in the same step (a block evicted
    from the prefix cache and refilled), or a host block released and retaken, is right."""
    pools = [(p, list(outs), list(ins)) for p, outs, ins in pools if outs or ins]
    if not pools:
        return
    hosts = [p.ready() for p, _, _ in pools]
    for i, dev in enumerate(device_caches):
        dev = as_bytes(dev)  # FP8: copied as bytes (PyTorch lacks float8 kernels)
        staged = []
        for (_, _, ins), host in zip(pools, hosts):  # read before an out may overwrite a host block
            if ins:
                block = dev.new_empty((dev.shape[0], len(ins), *dev.shape[2:]))
                copy_blocks(block, range(len(ins)), as_bytes(host[i]), [c for c, _ in ins])
                staged.append((block, [d for _, d in ins]))
        for (_, outs, _), host in zip(pools, hosts):
            if outs:
                copy_blocks(as_bytes(host[i]), [c for _, c in outs], dev, [d for d, _ in outs])
        for block, targets in staged:
            dev[:, torch.tensor(targets, device=dev.device)] = block


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
    """``dst[:, dst_ids[i]] = src[:, src_ids[i]]`` for tensors of the layer-cache layout.

    On one device: one gather and one scatter. Between the host and CUDA: one asynchronous copy per
    block and leading index (each ``[j, block]`` slice is contiguous), as vLLM's ``swap_blocks``.
    """
    if dst.device == src.device:
        dst[:, torch.tensor(list(dst_ids), device=dst.device)] = src[:, torch.tensor(list(src_ids), device=src.device)]
        return
    copy_blocks_each(dst, dst_ids, src, src_ids)


def copy_blocks_each(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
    """The per-block form of :func:`copy_blocks` (non-blocking from and to pinned memory)."""
    for d, s in zip(dst_ids, src_ids):
        for j in range(dst.shape[0]):
            dst[j, d].copy_(src[j, s], non_blocking=True)
