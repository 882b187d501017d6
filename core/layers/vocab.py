"""Vocabulary-parallel embedding and LM head.

The vocabulary splits into equal slices of ``ceil(vocab / size)`` rows (the last padded with zero
rows): an embedding rank looks up the ids of its slice and zeros for the others, summed over the
ranks (one all-reduce); an LM-head rank computes the logits of its slice, gathered along the
vocabulary (one all-gather; equal slices make it a single collective), padding cut off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.weights import ShardId, check_shape, full_shape, set_loader
from kvforge.rank import parallel_state


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = parallel_state.current()
        self.vocab_size = vocab_size
        per = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * per
        self.count = max(0, min(per, vocab_size - self.start))  # real rows of this slice
        self.weight = set_loader(nn.Parameter(torch.empty(per, hidden_size), requires_grad=False),
                                 self.weight_loader, (vocab_size, hidden_size))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        check_shape("the tensor", loaded, full_shape(param))
        param.data[:self.count].copy_(loaded.narrow(0, self.start, self.count))
        param.data[self.count:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's weight, split like the embedding; :func:`vocab_parallel_logits` applies it."""


_fp32_mm = [True]  # torch.mm(..., out_dtype=float32) is available (CUDA, recent torch)


def vocab_parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """hidden [n, hidden_size] -> float32 logits [n, vocab_size], every rank of the group getting all."""
    weight = head.weight
    logits = None
    if hidden.is_cuda and hidden.dtype != torch.float32 and _fp32_mm[0]:
        # bf16 inputs, fp32 output straight from the matmul's accumulator: rounding logits to bf16
        # would create exact ties between top tokens (a step of 0.06-0.25 at typical sizes)
        try:
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _fp32_mm[0] = False
    if logits is None:
        logits = F.linear(hidden, weight).float()
    if head.tp.size == 1:
        return logits
    return head.tp.all_gather(logits)[:, :head.vocab_size]
