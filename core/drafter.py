"""The speculative-drafter contract: propose draft tokens that the target model verifies in one pass."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from kvforge.request import Request


class Drafter(ABC):
    """Proposes up to ``num_speculative_tokens`` tokens per running sequence each step.

    The engine verifies the drafts with one target forward and rejection sampling that preserves the
    target distribution exactly (greedy: identical output), so a drafter only affects speed.
    """

    name: str = ""

    def __init__(self, *, num_speculative_tokens: int, **options: Any):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens

    @abstractmethod
    def propose(self, requests: Sequence[Request]) -> list[list[int]]:
        """One list of draft token ids (possibly empty) per request, in order."""
