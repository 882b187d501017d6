"""The speculative-drafter contract: propose draft tokens that the target model verifies in one pass.

A drafter is selected by ``speculative_config["method"]`` among those registered through the
``register_drafters`` hook (docs/speculative.md). The engine calls :meth:`Drafter.propose` once per
step, after it applied the step's tokens, for the running requests that will decode next; the
drafts go into ``Request.draft_token_ids`` and the next step verifies them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from kvforge.request import Request


@dataclass
class DraftBatch:
    """What a drafter gets each step.

    ``requests``: host state (``all_token_ids``, ``sampling_params``, ``num_computed_tokens``...).
    ``num_draft_tokens``: the most drafts wanted per request (the policy's k, cut so that a request
    never drafts past its ``max_tokens`` or the context length); 0 means none.
    ``block_tables``: each request's KV block ids (a model-based drafter with its own KV group
    shares the target's block ids; see ``Drafter.kv_bytes_per_block``).
    """

    requests: Sequence[Request]
    num_draft_tokens: list[int]
    block_tables: list[list[int]] | None = None


@dataclass
class DraftProposal:
    """Drafts per request (each at most its ``num_draft_tokens``, possibly empty), and optionally
    their draft distributions q: ``draft_probs[b]`` is ``[len(token_ids[b]), vocab]`` float32 on the
    device, or None for a request whose drafts are q = one-hot. Without ``draft_probs`` the rejection
    sampler treats each draft as q = one-hot."""

    token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None] | None = None


class Drafter(ABC):
    """Proposes up to ``num_speculative_tokens`` tokens per running sequence each step.

    The engine verifies the drafts with one target forward and rejection sampling that preserves the
    target distribution exactly (greedy: identical output), so a drafter only affects speed.
    Options other than ``num_speculative_tokens`` come from the rest of ``speculative_config``,
    validated by the drafter's ``Options`` dataclass when it has one.
    """

    name: str = ""

    def __init__(self, *, num_speculative_tokens: int, vocab_size: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int = 16, **options: Any):
        """The engine passes the target's ``vocab_size``, ``device``, ``dtype`` and KV ``block_size``."""
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of the drafter's own KV cache per block of ``block_size`` tokens (0: it keeps none).
        The engine sizes the block pool with it counted, so target and drafter share block ids."""
        return 0

    def initialize(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int) -> None:  # noqa: B027
        """Allocate what the drafter needs once the number of KV blocks is known. Default: nothing."""

    @abstractmethod
    def propose(self, batch: DraftBatch) -> DraftProposal:
        """Drafts for each request of ``batch``, in order."""

    def release(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional: a no-op by default
        """Forget per-request state of requests that ended."""

    def shutdown(self) -> None:  # noqa: B027 - optional: a no-op by default
        """Give back what the drafter holds on the device (its model, KV cache, graphs): the engine is
        shutting down and never proposes again."""
