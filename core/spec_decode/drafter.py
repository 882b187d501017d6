"""The speculative-drafter contract: propose draft tokens that the target model verifies in one pass.

A drafter is selected by ``speculative_config["method"]`` among those registered through the
``register_drafters`` hook (docs/speculative.md). The engine calls :meth:`Drafter.propose` once per
step, after it applied the step's tokens, for the running requests that will decode next; the
drafts go into ``Request.draft_token_ids`` and the next step verifies them.

A drafter that reads the target's hidden states (EAGLE) gets the target model once, through
:meth:`Drafter.bind_target`, which returns the layers it reads; the engine then makes the target's
forward capture them (``kvforge.model.hidden_capture``) and hands every step's states to
:meth:`Drafter.observe`, right after the step's forward and sampling are queued.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch

from kvforge.request import Request

if TYPE_CHECKING:
    from kvforge.attention import BatchLayout
    from kvforge.model.config import ModelConfig


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


@dataclass
class TargetModel:
    """The target model as the driver rank holds it, for a drafter that shares its weights (an EAGLE
    head's embeddings and LM head) or reads its hidden states."""

    module: torch.nn.Module  # the driver's ``kvforge.model.interface.CausalLM``
    config: ModelConfig
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class TargetHiddenStates:
    """One target step as a drafter that reads hidden states sees it (:meth:`Drafter.observe`).

    Request ``req_ids[i]`` owns rows ``query_start[i] .. query_start[i + 1]``, at positions
    ``first_positions[i]`` on. Device tensors have ``layout.num_tokens`` rows (a CUDA-graph step's
    layout is padded: rows past ``query_start[-1]`` are padding, written to slot -1). ``hidden`` is a
    view of the capture buffer, which the next target step overwrites: queue the work that reads it
    in ``observe``, never keep the view."""

    req_ids: list[str]
    first_positions: np.ndarray  # [num_reqs] int64: each request's first position in the step
    query_start: np.ndarray  # [num_reqs + 1] int64: each request's first row (the last entry: the step's rows)
    #: the step's layout (slots, block tables, context lengths): a drafter with its own KV group writes
    #: its K/V at the same positions by the same slots
    layout: BatchLayout
    graph_key: tuple[int, int] | None  # the (padded size, q) CUDA graph the step replayed, or None
    hidden: torch.Tensor  # [rows, len(layers) * hidden_size] the captured layers' states (bind_target's order)
    positions: torch.Tensor  # [rows] int64 each row's position
    #: [rows] int64 the token after each row's position: the next row's input; a row the step samples
    #: gets its sampled token (a verifying request's rows their verified tokens: past its accepted run
    #: they are junk, rewritten when those positions are computed again); a prompt chunk's last row
    #: the prompt's next token; 0 for padding
    next_token_ids: torch.Tensor
    #: (source, destination) block copies the step made in the target's cache before its forward
    #: (copy-on-write): a drafter with a KV group of its own makes them in its cache too, before writing
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)


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

    def bind_target(self, target: TargetModel) -> Sequence[int]:
        """Called once on the driver, after the drafter is built and before the KV pool is sized, with
        the target model. Returns the target layer ids whose hidden states the drafter reads every
        step (ids as transformers' ``output_hidden_states``: 0 embeddings, i the output of layer i - 1,
        ``config.num_hidden_layers`` the final normed states; ``kvforge.model.hidden_capture``); the
        default, none, means :meth:`observe` is never called. ``ValueError`` refuses a target the
        drafter cannot serve (naming the field)."""
        return ()

    def observe(self, states: TargetHiddenStates) -> None:  # noqa: B027 - optional: a no-op by default
        """Every target step that ran a forward, on the driver, right after its forward and sampling
        were queued (before the next step is launched, whether the policy drafts or not, and before the
        step's tokens reach the host): the captured hidden states of every row the step computed. A
        drafter keeping per-position state (an EAGLE head's KV cache) queues its work on them here;
        it must not wait for the device."""

    @abstractmethod
    def propose(self, batch: DraftBatch) -> DraftProposal:
        """Drafts for each request of ``batch``, in order."""

    def release(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - optional: a no-op by default
        """Forget per-request state of requests that ended."""

    def shutdown(self) -> None:  # noqa: B027 - optional: a no-op by default
        """Give back what the drafter holds on the device (its model, KV cache, graphs): the engine is
        shutting down and never proposes again."""
