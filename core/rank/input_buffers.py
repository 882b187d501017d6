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
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.sets = [HostInputs(max_tokens, max_seqs, max_blocks, self.pin) for _ in range(2)]
        self.turn = 0

    def next(self, tokens: int, seqs: int, blocks: int) -> HostInputs:
        """The set for the next step, grown if the step needs more room than it has."""
        self.turn ^= 1
        cur = self.sets[self.turn]
        t, s, b = cur.capacity
        if tokens > t or seqs > s or blocks > b:
            cur = self.sets[self.turn] = HostInputs(max(tokens, t), max(seqs, s), max(blocks, b), self.pin)
        return cur


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
