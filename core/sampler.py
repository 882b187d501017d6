"""The sampler contract: logits of the positions to sample -> token ids, vectorised over the batch."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Sequence

import torch

from kvforge.request import Request


class Sampler(ABC):
    """Turns one step's logits into tokens. Built once per engine; ``prepare`` runs once per step."""

    name: str = ""

    def __init__(self, *, vocab_size: int, device: torch.device, **options: Any):
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    @abstractmethod
    def prepare(self, requests: Sequence[Request]) -> Any:
        """Gather the per-request parameters of the rows to sample into device tensors."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, state: Any) -> torch.Tensor:
        """logits: [num_rows, vocab] float32 -> token ids [num_rows] int64 on the same device."""

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget per-request state (random generators...) of requests that ended."""
