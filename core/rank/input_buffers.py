"""Pre-allocated host buffers a step's inputs are laid out in (pinned on CUDA), two sets used in turn.

Every per-step host array (token ids, positions, slots, sequence lengths, block tables, sampled rows)
is a numpy view of one of these buffers, so a step allocates nothing on the host, and every copy to
the device starts from pinned memory: truly asynchronous. (A copy from pageable memory makes CUDA
wait for the stream first, which would stall the CPU behind the step the GPU is running.)

Two sets alternate: while the GPU may still read set A's copies for the step in flight, the next
step is written into set B. Set A is reused only after the engine has waited for that step (async
scheduling keeps at most one step in flight). The sets grow, never shrink, if a step outgrows them.
"""
from __future__ import annotations

import numpy as np
import torch

_FIELDS = {  # name -> (dtype, sized by)
    "input_ids": (torch.int64, "tokens"),
    "positions": (torch.int64, "tokens"),
    "slot_mapping": (torch.int64, "tokens"),
    "query_start_loc": (torch.int32, "seqs+1"),
    "seq_lens": (torch.int32, "seqs"),
    "block_tables": (torch.int32, "seqs*blocks"),
    "sample_rows": (torch.int64, "seqs"),
    "fill_dst": (torch.int64, "seqs"),
    "fill_src": (torch.int64, "seqs"),
    "sampled": (torch.int64, "seqs"),  # the step's sampled tokens, copied back from the device
}


class HostInputs:
    """One set of buffers: ``.tensors[name]`` (pinned torch tensors) and ``.np[name]`` (their views)."""

    def __init__(self, tokens: int, seqs: int, blocks: int, pin: bool):
        self.capacity = (tokens, seqs, blocks)
        sizes = {"tokens": tokens, "seqs": seqs, "seqs+1": seqs + 1, "seqs*blocks": seqs * blocks}
        self.tensors = {name: torch.zeros(sizes[by], dtype=dt, pin_memory=pin) for name, (dt, by) in _FIELDS.items()}
        self.np = {name: t.numpy() for name, t in self.tensors.items()}

    def block_tables(self, rows: int, width: int) -> np.ndarray:
        """A contiguous [rows, width] view, zero-filled."""
        view = self.np["block_tables"][:rows * width].reshape(rows, width)
        view.fill(0)
        return view


class StagingBuffers:
    """``num_sets`` sets of host buffers (pinned on CUDA): a worker's steps take two in turn (:meth:`next`);
    a drafter's proposal takes one per forward (:meth:`at`), so each forward's copies may still be
    queued while the next is laid out."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, num_sets: int = 2):
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.sets = [HostInputs(max_tokens, max_seqs, max_blocks, self.pin) for _ in range(num_sets)]
        self.turn = 0

    def next(self, tokens: int, seqs: int, blocks: int) -> HostInputs:
        """The set for the next step, grown if the step needs more room than it has."""
        self.turn = (self.turn + 1) % len(self.sets)
        return self.at(self.turn, tokens, seqs, blocks)

    def at(self, index: int, tokens: int, seqs: int, blocks: int) -> HostInputs:
        """Set ``index``, grown if it has less room than asked for."""
        cur = self.sets[index]
        t, s, b = cur.capacity
        if tokens > t or seqs > s or blocks > b:
            cur = self.sets[index] = HostInputs(max(tokens, t), max(seqs, s), max(blocks, b), self.pin)
        return cur


class StepBuffers:
    """A rank's step inputs: the staging sets on the host, and the eager forward's token ids and
    positions on the device (a CUDA graph step uses the graph's static ones), grown if a step needs more."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.staging = StagingBuffers(max_tokens, max_seqs, max_blocks, device)
        self.device = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)  # [max_tokens] int64
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)  # [max_tokens] int64

    def to_device(self, buf: HostInputs, n: int, static: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the copies of ``buf``'s first ``n`` token ids and positions to the device, into ``static``
        (a CUDA graph's inputs) or views of ours; returns the device views."""
        if static is not None:
            ids, pos = static
        else:
            if n > self.input_ids.shape[0]:
                self.input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
                self.positions = torch.zeros(n, dtype=torch.long, device=self.device)
            ids, pos = self.input_ids[:n], self.positions[:n]
        ids.copy_(buf.tensors["input_ids"][:n], non_blocking=True)
        pos.copy_(buf.tensors["positions"][:n], non_blocking=True)
        return ids, pos


def h2d(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list/array on ``device`` without stalling the CPU: staged through pinned memory on
    CUDA (a copy from pageable memory may wait for the stream)."""
    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def d2h(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's host copy, queued without waiting (into pinned memory on CUDA); read it only
    after the stream has passed this point (an event)."""
    if t.device.type != "cuda":
        return t
    dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    dst.copy_(t, non_blocking=True)
    return dst
