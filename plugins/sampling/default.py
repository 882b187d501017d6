"""``default``: greedy, temperature, top-k, top-p, min-p and per-request seeds, batched on the device.

Sampling draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per vocabulary entry (equivalent to
drawing from ``probs``). Rows with a seed draw ``E`` from their own generator, so a seeded request
samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from kvforge.request import Request
from kvforge.sampler import Sampler


@dataclass
class SamplingState:
    temperature: torch.Tensor  # [rows] float32 (0 rows set to 1: they take the greedy path)
    greedy: torch.Tensor  # [rows] bool
    top_k: torch.Tensor | None  # [rows] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [rows] float32
    min_p: torch.Tensor | None  # [rows] float32
    all_greedy: bool
    any_greedy: bool
    seeded: list[tuple[int, torch.Generator]]  # (row, generator)


class DefaultSampler(Sampler):
    name = "default"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generators: dict[str, torch.Generator] = {}

    def prepare(self, requests: Sequence[Request]) -> SamplingState:
        params = [r.sampling_params for r in requests]
        dev = self.device
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        if all_greedy:
            return SamplingState(torch.empty(0), torch.empty(0), None, None, None, True, True, [])
        vocab = self.vocab_size
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32)
        top_k = top_p = min_p = None
        if any(0 < p.top_k < vocab for p in params):
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).to(dev)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(dev)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).to(dev)
        seeded = []
        for row, req in enumerate(requests):
            seed = req.sampling_params.seed
            if seed is not None and not greedy[row]:
                gen = self.generators.get(req.request_id)
                if gen is None:
                    gen = torch.Generator(device=dev)
                    gen.manual_seed(seed)
                    self.generators[req.request_id] = gen
                seeded.append((row, gen))
        return SamplingState(temp.to(dev), torch.tensor(greedy).to(dev), top_k, top_p, min_p,
                             False, any(greedy), seeded)

    def sample(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        # logits: [rows, vocab] float32
        greedy_tokens = logits.argmax(dim=-1) if state.any_greedy else None
        if state.all_greedy:
            return greedy_tokens
        logits = logits / state.temperature[:, None]
        logits = apply_top_k_top_p(logits, state.top_k, state.top_p)
        probs = torch.softmax(logits, dim=-1)
        if state.min_p is not None:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < state.min_p[:, None] * top, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in state.seeded:
            noise[row].exponential_(generator=gen)
        tokens = (probs / noise).argmax(dim=-1)
        if greedy_tokens is not None:
            tokens = torch.where(state.greedy, greedy_tokens, tokens)
        return tokens

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k and top-p nucleus. logits: [rows, vocab]."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        remove |= torch.arange(vocab, device=logits.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # mass strictly before each token; the top token is always kept
        before = probs.cumsum(dim=-1) - probs
        remove |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
