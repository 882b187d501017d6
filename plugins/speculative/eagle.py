"""``eagle`` / ``eagle3``: an EAGLE-1 or EAGLE-3 head drafts k tokens from the target's hidden states.

No second model runs: the head (``kvforge.plugins.speculative.eagle_head``) is one decoder layer (or a
few) beside the target, with its own KV cache group indexed by the target's block ids, like a draft
model's (``kvforge.plugins.speculative.model_drafting``).

- **Every target step** (:meth:`EagleDrafter.observe`, queued right after the step's forward and
  sampling, whether the policy drafts or not, so that the head's KV cache never has holes): the head
  runs over all the step's rows, row t reading the target's captured state at t and the token at t + 1
  (``TargetHiddenStates.next_token_ids``), and writes its K/V at the step's own slots. A uniform step
  replays the head's graph of the same (size, q) as the target's, its inputs copied from the target's
  static buffers; any other step runs the head eagerly. K/V written past a request's accepted run are
  rewritten when those positions are computed again.
- **A proposal** (after the step's tokens reached the host): the head's output at each request's last
  accepted position (the one whose next token is the newest) gives draft 1 without another forward;
  then k - 1 one-token decode steps, each reading the previous draft and the head's own previous
  output (``ModelDrafter._chain``, replayed as graphs on CUDA).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch

from kvforge.builder import select_attention_backend
from kvforge.model.loader import iter_weights, resolve_model_source
from kvforge.plugin_manager import get_plugin_manager
from kvforge.plugins.speculative.eagle_head import EagleHead, checkpoint_tensors, read_head_config
from kvforge.plugins.speculative.model_drafting import ModelDrafter
from kvforge.rank.cuda_graphs import CUDAGraphRunner
from kvforge.rank.input_buffers import h2d
from kvforge.rank.model_build import RankModel, hidden_states, make_attention
from kvforge.spec_decode.drafter import DraftBatch, DraftProposal, TargetHiddenStates, TargetModel

logger = logging.getLogger(__name__)


@dataclass
class EagleOptions:
    #: the head's checkpoint: a directory with config.json and *.safetensors (or pytorch_model*.bin)
    model: str | None = None
    #: attention backend of the head (auto: as the engine would pick)
    attention_backend: str = "auto"
    #: never capture CUDA graphs for the head's forwards
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("eagle: 'model' (the EAGLE head's checkpoint directory) is required")


@dataclass
class FilledRows:
    """The head's outputs of the last target step: request id -> (first row, first position, rows)."""

    rows: dict[str, tuple[int, int, int]]
    out: torch.Tensor  # [rows, hidden] pre-norm outputs (a graph's static output until the next fill)


class HeadForward:
    """The head as the graph runner calls a model, (input ids, positions, caches, metadata) -> hidden, its
    hidden input read from a static buffer (the target's copied states, or the previous draft step's output)."""

    def __init__(self, head: EagleHead, hidden_in: torch.Tensor, from_target: bool):
        self.head, self.hidden_in, self.from_target = head, hidden_in, from_target

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 attn_meta: Any, intermediate: Any = None) -> torch.Tensor:
        return self.head(input_ids, positions, self.hidden_in[:len(input_ids)], kv_caches, attn_meta, self.from_target)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)


class EagleDrafter(ModelDrafter):
    """An EAGLE-1 head (``eagle3``: :class:`Eagle3Drafter`); the head is built in :meth:`bind_target`,
    once the target's embeddings and context length are known."""

    name = "eagle"
    Options = EagleOptions
    version = 1

    def __init__(self, *, model: str | None = None, attention_backend: str = "auto", enforce_eager: bool = False,
                 **kwargs: Any):
        super().__init__(enforce_eager=enforce_eager, **kwargs)
        EagleOptions(model, attention_backend, enforce_eager)
        src = resolve_model_source(model)
        if src.kind != "hf_dir" or src.path is None:
            raise ValueError(f"speculative_config: model: an EAGLE head is a checkpoint directory, got {model!r}")
        self.source = src
        hc = self.head_config = read_head_config(src.path, self.version)
        #: the head's layer config (the engine keeps blocks behind a sliding window for a drafter that has one)
        self.model_config = hc.layer
        self.num_kv_layers = hc.num_layers
        pm = get_plugin_manager()
        attn_name, cls = select_attention_backend(pm, attention_backend, device=self.device, dtype=self.dtype,
                                                  head_size=hc.layer.head_dim, block_size=self.block_size)
        self.attn = make_attention(cls, hc.layer, device=self.device, dtype=self.dtype, block_size=self.block_size)
        self.head: EagleHead | None = None  # built by bind_target (its RoPE reaches the target's context)
        self.fill_graphs: CUDAGraphRunner | None = None
        self.target_in: torch.Tensor | None = None  # [rows, width] the fill graphs' copy of the target's states
        self.step_in: torch.Tensor | None = None  # [rows, hidden] the decode steps' hidden input
        self.filled: FilledRows | None = None
        self._carry: torch.Tensor | None = None  # the chain's hidden states, one row per live request
        self._step_model: HeadForward | None = None
        logger.info("EAGLE-%d head %s (%d layer(s), draft vocabulary %d) on attention backend %s", hc.version,
                    src.name, hc.num_layers, hc.draft_vocab_size, attn_name)

    # -- set-up ----------------------------------------------------------------------------------
    def bind_target(self, target: TargetModel) -> Sequence[int]:
        hc, tc = self.head_config, target.config
        if target.tensor_parallel_size != 1 or target.pipeline_parallel_size != 1:
            raise ValueError(f"speculative_config: method {self.name!r} needs tensor_parallel_size and "
                             f"pipeline_parallel_size 1 (got {target.tensor_parallel_size} and "
                             f"{target.pipeline_parallel_size}): the head shares the target's embeddings on one rank")
        if hc.target_hidden_size != tc.hidden_size or (hc.version == 1 and hc.layer.hidden_size != tc.hidden_size):
            raise ValueError(f"speculative_config: model: the head reads hidden states of width {hc.target_hidden_size}, "
                             f"the target's are {tc.hidden_size}")
        if hc.layer.vocab_size != tc.vocab_size:
            raise ValueError(f"speculative_config: model: the head's vocab_size is {hc.layer.vocab_size}, the target's "
                             f"{tc.vocab_size}; they must share one")
        layers = hc.target_layers(tc.num_hidden_layers)
        weights = checkpoint_tensors(dict(iter_weights(self.source)))
        config = dataclasses.replace(hc.layer, max_position_embeddings=max(hc.layer.max_position_embeddings,
                                                                           tc.max_position_embeddings))
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                head = EagleHead(dataclasses.replace(hc, layer=config), self.attn, "embed_tokens.weight" in weights)
        finally:
            torch.set_default_dtype(old)
        head.load(weights, tc.vocab_size)
        embed = getattr(getattr(target.module, "model", None), "embed_tokens", None)
        if embed is None and head.embed_tokens is None:
            raise ValueError("speculative_config: model: the head has no embed_tokens and the target exposes none "
                             "(model.embed_tokens)")
        head.share(embed, cast("Callable[[torch.Tensor], torch.Tensor]", target.module.compute_logits))
        self.head = head.eval()
        return layers

    def initialize(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int) -> None:
        head, hc = self._head(), self.head_config
        # [max_num_seqs, hidden]: a decode step's rows, a captured size at most (capture_sizes)
        self.step_in = torch.zeros(max_num_seqs, hc.layer.hidden_size, dtype=self.dtype, device=self.device)
        self._step_model = HeadForward(head, self.step_in, from_target=False)
        super().initialize(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len)
        if self.graphs is None:
            return
        # the fill: a graph for each of the target's (decode, and verification of 1 + k tokens per request)
        fill = HeadForward(head, torch.empty(0), from_target=True)
        self.fill_graphs = CUDAGraphRunner(fill, self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                           max_model_len=max_model_len, device=self.device,
                                           query_lens=self.graph_lens((1, 1 + self.num_speculative_tokens)))
        top = max(s * q for q, sizes in self.fill_graphs.sizes_for.items() for s in sizes)
        width = (3 if hc.version == 3 else 1) * hc.target_hidden_size
        # [top, width]: the target's states of the largest graph step, copied in before each replay
        self.target_in = fill.hidden_in = torch.zeros(top, width, dtype=self.dtype, device=self.device)
        self.fill_graphs.capture()

    def shutdown(self) -> None:
        self.fill_graphs = None
        super().shutdown()
        self.head = self._step_model = None
        self.filled = self._carry = None
        self.step_in = self.target_in = None

    def _head(self) -> EagleHead:
        if self.head is None:
            raise RuntimeError(f"{self.name}: the head is not built (bind_target was not called, or it was shut down)")
        return self.head

    def _model(self) -> RankModel:
        if self._step_model is None:
            raise RuntimeError(f"{self.name}: propose before initialize (or after shutdown)")
        return self._step_model

    # -- every target step -----------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, states: TargetHiddenStates) -> None:
        head = self._head()
        if states.blocks_to_copy:  # the target's copy-on-write copies, in the head's cache too
            self.attn.copy_blocks(self.kv_caches, states.blocks_to_copy)
        T = states.layout.num_tokens
        g = self.fill_graphs
        if g is not None and states.graph_key in g.graphs and self.target_in is not None:
            self.target_in[:T].copy_(states.hidden)
            g.input_ids[:T].copy_(states.next_token_ids)
            g.positions[:T].copy_(states.positions)
            out = hidden_states(g.replay(states.layout))
        else:
            out = head(states.next_token_ids, states.positions, states.hidden, self.kv_caches,
                       self.attn.build_metadata(states.layout), from_target=True)
        starts, firsts = states.query_start.tolist(), states.first_positions.tolist()
        self.filled = FilledRows({rid: (starts[i], firsts[i], starts[i + 1] - starts[i])
                                  for i, rid in enumerate(states.req_ids)}, out)

    # -- one proposal ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DraftProposal:
        token_ids: list[list[int]] = [[] for _ in batch.requests]
        probs: list[torch.Tensor | None] = [None] * len(batch.requests)
        filled = self.filled
        if filled is None or batch.block_tables is None:
            return DraftProposal(token_ids, probs)
        active, rows = [], []
        for b, (r, k) in enumerate(zip(batch.requests, batch.num_draft_tokens)):
            # the last accepted position: the one whose next token is the request's newest
            at = filled.rows.get(r.request_id)
            if k > 0 and at is not None and 0 <= r.num_tokens - 2 - at[1] < at[2]:
                active.append(b)
                rows.append(at[0] + r.num_tokens - 2 - at[1])
        if not active:
            return DraftProposal(token_ids, probs)
        reqs = [batch.requests[b] for b in active]
        ks = [batch.num_draft_tokens[b] for b in active]
        tables = [batch.block_tables[b] for b in active]
        self._carry = filled.out[h2d(rows, torch.long, self.device)]  # [B, hidden]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        tok = self._draw(self._carry, reqs, qs)  # draft 1, from the fill's output
        # decode step j reads draft j at position num_tokens - 2 + j (the head's rows trail the tokens by one)
        first = np.array([r.num_tokens - 1 for r in reqs], dtype=np.int64)
        drafts = self._chain(tok, reqs, ks, tables, first, qs)
        for i, b in enumerate(active):
            token_ids[b] = drafts[i]
            probs[b] = torch.stack(qs[i]) if qs[i] else None
        return DraftProposal(token_ids, probs)

    def _forward(self, ids: np.ndarray | torch.Tensor, starts: np.ndarray, q_lens: np.ndarray,
                 tables: Sequence[Sequence[int]], stage: int) -> torch.Tensor:
        """A decode step: the previous step's head outputs go in as its hidden input."""
        if self.step_in is None or self._carry is None:
            raise RuntimeError(f"{self.name}: a decode step without the head's previous output")
        self.step_in[:len(self._carry)].copy_(self._carry)
        out = super()._forward(ids, starts, q_lens, tables, stage)
        self._carry = out
        return out

    def _keep_rows(self, keep: torch.Tensor) -> None:
        if self._carry is not None:
            self._carry = self._carry[keep]

    # -- the draft vocabulary (EAGLE-3) ----------------------------------------------------------
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head().compute_logits(hidden).float()

    def _target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._head().draft_to_target[tokens] if self.version == 3 else tokens

    def _target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        if self.version == 1:
            return probs
        out = probs.new_zeros(probs.shape[0], self.head_config.layer.vocab_size)  # [n, target vocabulary]
        out[:, self._head().draft_to_target] = probs
        return out


class Eagle3Drafter(EagleDrafter):
    name = "eagle3"
    version = 3
