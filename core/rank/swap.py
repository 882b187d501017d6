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

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from kvforge.attention import AttentionBackend, as_bytes
from kvforge.kv_connector import TierStore
from kvforge.kv_tier import TierTransfers

Pairs = Sequence[tuple[int, int]]


class CPUSwapSpace(TierStore):
    """``num_cpu_blocks`` blocks of every layer in host memory, and the copies in and out of it (also the
    store of the ``cpu`` KV tier: its keys are blocks of this pool)."""

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
        transfer(device_caches, [StoreCopies(self, outs=swap_out, ins=swap_in)])

    def read(self, layer: int, keys: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        block = like.new_empty((like.shape[0], len(keys), *like.shape[2:]))
        copy_blocks(block, range(len(keys)), as_bytes(self.ready()[layer]), keys)
        return block

    def write(self, layer: int, keys: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
        copy_blocks(as_bytes(self.ready()[layer]), keys, src, src_ids)

    def ready(self) -> list[torch.Tensor]:
        """The pool's per-layer tensors, allocated on first use."""
        if not self.caches:
            if not self.num_cpu_blocks:
                raise ValueError("swap: the CPU swap pool is empty (swap_space=0)")
            self._allocate()
        return self.caches


@dataclass
class StoreCopies:
    """One store's copies of a step: ``outs`` ``(device block, key)`` into it, ``ins`` ``(key, device block)``
    out of it, ``moves`` ``(key, key in to)`` from it into the store ``to``, ``drops`` the keys it forgets,
    ``tokens`` those of the blocks it gets (a persistent tier's)."""

    store: TierStore
    outs: Pairs = ()
    ins: Pairs = ()
    moves: Pairs = ()
    to: TierStore | None = None
    drops: Sequence[int] = ()
    tokens: Mapping[int, Sequence[int]] = field(default_factory=dict)


def tier_copies(stores: Sequence[TierStore | None], step: TierTransfers) -> list[StoreCopies]:
    """A step's tier copies (``kvforge.kv_tier.TierTransfers``) as each store's, in chain order: a store
    with nothing to do is left out, one that only receives moves is not."""
    outs: list[list[tuple[int, int]]] = [[] for _ in stores]
    ins: list[list[tuple[int, int]]] = [[] for _ in stores]
    moves: list[list[tuple[int, int]]] = [[] for _ in stores]
    drops: list[list[int]] = [[] for _ in stores]
    tokens: list[dict[int, Sequence[int]]] = [{} for _ in stores]
    for level, device_block, key in step.saves:
        outs[level].append((device_block, key))
    for level, key, device_block in step.loads:
        ins[level].append((key, device_block))
    for level, key, new_key in step.moves:
        moves[level].append((key, new_key))
    for level, key in step.drops:
        drops[level].append(key)
    for level, key, block_tokens in step.tokens:
        tokens[level][key] = block_tokens
    copies = []
    for level, store in enumerate(stores):
        into = level > 0 and bool(moves[level - 1])
        if not (outs[level] or ins[level] or moves[level] or drops[level] or into):
            continue
        if store is None:
            raise ValueError(f"kv tier: level {level} has no store on this rank, but the step copies to it")
        to = stores[level + 1] if moves[level] else None
        copies.append(StoreCopies(store, outs[level], ins[level], moves[level], to, drops[level], tokens[level]))
    return copies


def transfer(device_caches: list[torch.Tensor], copies: Sequence[StoreCopies]) -> None:
    """One step's copies between the device cache and the stores (the swap pool, the KV tiers). Every source
    is read before any block is written, layer by layer: the ins and the moves' sources are staged on the
    device, the outs and the staged moves written to their stores, then the staged ins written to the
    device. So a device block that one store reads and another writes in the same step (a block evicted from
    the prefix cache and refilled), or a slot dropped and retaken, is right."""
    copies = [c for c in copies if c.outs or c.ins or c.moves or c.drops or c.tokens or any(
        d.to is c.store for d in copies)]
    if not copies:
        return
    for c in copies:
        c.store.begin([k for k, _ in c.ins] + [k for k, _ in c.moves], c.tokens)
    for i, dev in enumerate(device_caches):
        dev = as_bytes(dev)  # FP8: copied as bytes (PyTorch lacks float8 kernels)
        staged, moving = [], []
        for c in copies:  # read before an out may overwrite a block
            if c.ins:
                staged.append((c.store.read(i, [k for k, _ in c.ins], dev), [d for _, d in c.ins]))
            if c.moves and c.to is not None:
                moving.append((c.to, [k for _, k in c.moves], c.store.read(i, [k for k, _ in c.moves], dev)))
        for c in copies:
            if c.outs:
                c.store.write(i, [k for _, k in c.outs], dev, [d for d, _ in c.outs])
        for to, keys, blocks in moving:
            to.write(i, keys, blocks, range(len(keys)))
        for blocks, targets in staged:
            dev[:, torch.tensor(targets, device=dev.device)] = blocks
    for c in copies:
        c.store.end(c.drops)


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
