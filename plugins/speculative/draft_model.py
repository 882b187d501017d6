"""``draft_model``: a second, smaller model with the target's vocabulary proposes k tokens per step.

Its paged KV cache is its own tensors indexed by the target's block ids (the engine sizes the block
pool with ``kv_bytes_per_block`` counted and allocates lookahead slots before each proposal), so it
needs no block manager of its own. Each step it first catches up on the tokens it has not seen (a
new request's whole context, or the accepted drafts and the target's token since its last proposal;
K/V it wrote for rejected drafts are overwritten), then runs k - 1 one-token decode steps, replayed
as CUDA graphs on CUDA. Greedy requests get the draft's argmax (q one-hot); sampled ones get a token
drawn at the request's temperature and its distribution q, so verification stays exact.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from kvforge.model.loader import load_model_config, resolve_model_source
from kvforge.plugin_manager import get_plugin_manager
from kvforge.plugins.speculative.model_drafting import ModelDrafter
from kvforge.rank.input_buffers import h2d
from kvforge.rank.model_build import RankModel, build_model, checkpoint_quantization, quantization_method
from kvforge.spec_decode.drafter import DraftBatch, DraftProposal

logger = logging.getLogger(__name__)


@dataclass
class DraftModelOptions:
    #: the draft model: an HF directory, a .gguf file, a hub id or dummy:<preset>
    model: str | None = None
    load_format: str = "auto"
    #: attention backend of the draft model (auto: as the engine would pick)
    attention_backend: str = "auto"
    #: never capture CUDA graphs for the draft's decode steps
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("draft_model: 'model' (the draft model's path or preset) is required")


class DraftModelDrafter(ModelDrafter):
    name = "draft_model"
    Options = DraftModelOptions
    # q=1: the decode steps, and a catch-up of one new token; q=2: a catch-up after a fully accepted
    # run (the last draft and the target's bonus token)
    graph_query_lens = (1, 2)

    def __init__(self, *, model: str | None = None, load_format: str = "auto", attention_backend: str = "auto",
                 enforce_eager: bool = False, **kwargs: Any):
        super().__init__(enforce_eager=enforce_eager, **kwargs)
        DraftModelOptions(model, load_format, attention_backend, enforce_eager)
        src = resolve_model_source(model, load_format)
        mc = self.model_config = load_model_config(src)
        if self.vocab_size and mc.vocab_size != self.vocab_size:
            raise ValueError(f"speculative_config: model: the draft model {src.name!r} has a vocabulary of "
                             f"{mc.vocab_size} tokens and the target {self.vocab_size}; they must share one")
        pm = get_plugin_manager()
        # the same build as the engine's worker: unsharded, the KV cache in the model dtype, the
        # quantization its checkpoint declares (kvforge.rank.model_build)
        built = build_model(pm, src, mc, attention_backend=attention_backend, device=self.device, dtype=self.dtype,
                            block_size=self.block_size,
                            quant=quantization_method(pm, checkpoint_quantization(pm, mc), mc))
        self.attn = built.attn
        self.num_kv_layers = mc.num_hidden_layers
        self.model: RankModel | None = built.model
        self.computed: dict[str, tuple[int, int]] = {}  # request -> (tokens with draft K/V, its preemptions then)
        logger.info("draft model %s (%d layers) on attention backend %s", src.name, mc.num_hidden_layers,
                    built.attn_name)

    def release(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        super().release(ids)
        for rid in ids:
            self.computed.pop(rid, None)

    def shutdown(self) -> None:
        super().shutdown()
        self.model = None

    def _model(self) -> RankModel:
        if self.model is None:
            raise RuntimeError("draft_model: the drafter was shut down")
        return self.model

    # -- one proposal ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DraftProposal:
        active = [b for b, k in enumerate(batch.num_draft_tokens) if k > 0]
        token_ids: list[list[int]] = [[] for _ in batch.requests]
        probs: list[torch.Tensor | None] = [None] * len(batch.requests)
        if not active:
            return DraftProposal(token_ids, probs)
        reqs = [batch.requests[b] for b in active]
        ks = [batch.num_draft_tokens[b] for b in active]
        if batch.block_tables is None:
            raise ValueError("draft_model: the batch has no block tables (its KV cache shares the target's blocks)")
        tables = [batch.block_tables[b] for b in active]
        starts = []
        for r in reqs:
            seen, preempted = self.computed.get(r.request_id, (0, r.num_preemptions))
            # K/V from before a preemption are gone (blocks freed or swapped); past num_tokens - 1 they
            # belong to drafts that may have been rejected
            starts.append(min(seen, r.num_tokens - 1) if preempted == r.num_preemptions else 0)
        num_tokens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
        lens = num_tokens - np.array(starts, dtype=np.int64)
        if self.graphs is not None and lens.max() == 2 and lens.min() == 1:
            lens[:] = 2  # one catch-up graph for all: a 1-token catch-up recomputes the token before it
        # catch up: every token not yet seen, up to the newest; its last row gives draft 1
        starts = num_tokens - lens
        chunks = [r.tokens(int(s), r.num_tokens) for r, s in zip(reqs, starts)]
        hidden = self._forward(np.concatenate(chunks), starts, lens, tables, stage=0)
        if lens.max() == lens.min():  # uniform: the last row of each is every q-th
            last = hidden.view(len(reqs), int(lens[0]), -1)[:, -1]
        else:
            last = hidden[h2d(np.cumsum(lens) - 1, torch.long, self.device)]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # then the decode steps: draft j at position num_tokens + j - 1
        drafts = self._chain(self._draw(last, reqs, qs), reqs, ks, tables, num_tokens, qs)
        for i, (b, r, k) in enumerate(zip(active, reqs, ks)):
            self.computed[r.request_id] = (r.num_tokens + k - 1, r.num_preemptions)
            token_ids[b] = drafts[i]
            probs[b] = torch.stack(qs[i]) if qs[i] else None
        return DraftProposal(token_ids, probs)
