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
from typing import Any

import numpy as np
import torch

from kvforge.attention import BatchLayout
from kvforge.builder import select_attention_backend
from kvforge.drafter import DraftBatch, Drafter, DraftProposal
from kvforge.model_loader import load_model, load_model_config, resolve_model_source
from kvforge.plugin_manager import get_plugin_manager

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


class DraftModelDrafter(Drafter):
    name = "draft_model"
    Options = DraftModelOptions

    def __init__(self, *, model: str | None = None, load_format: str = "auto", attention_backend: str = "auto",
                 enforce_eager: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        DraftModelOptions(model, load_format, attention_backend, enforce_eager)
        src = resolve_model_source(model, load_format)
        mc = self.model_config = load_model_config(src)
        if self.vocab_size and mc.vocab_size != self.vocab_size:
            raise ValueError(f"speculative_config: model: the draft model {src.name!r} has a vocabulary of "
                             f"{mc.vocab_size} tokens and the target {self.vocab_size}; they must share one")
        name, cls = select_attention_backend(get_plugin_manager(), attention_backend, device=self.device,
                                             dtype=self.dtype, head_size=mc.head_dim, block_size=self.block_size)
        self.attn = cls(num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads, head_size=mc.head_dim,
                        scale=mc.head_dim ** -0.5, block_size=self.block_size, dtype=self.dtype, device=self.device)
        self.model = load_model(src, mc, self.attn, self.dtype, self.device)
        self.enforce_eager = enforce_eager
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: Any = None
        self.computed: dict[str, tuple[int, int]] = {}  # request -> (tokens with draft K/V, its preemptions then)
        self.generators: dict[str, torch.Generator] = {}
        logger.info("draft model %s (%d layers) on attention backend %s", src.name, mc.num_hidden_layers, name)

    # -- set-up ----------------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int) -> int:
        shape = self.attn.kv_cache_shape(1)
        return int(np.prod(shape)) * self.dtype.itemsize * self.model_config.num_hidden_layers

    def initialize(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int) -> None:
        self.kv_caches = self.attn.allocate_kv_cache(num_blocks, self.model_config.num_hidden_layers)
        self.max_blocks = -(-max_model_len // block_size)
        if (self.device.type == "cuda" and not self.enforce_eager
                and type(self.attn).capabilities.supports_cuda_graphs):
            from kvforge.cuda_graphs import CUDAGraphRunner

            self.graphs = CUDAGraphRunner(self.model, self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                          max_model_len=max_model_len, device=self.device)
            self.graphs.capture()

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.computed.pop(rid, None)
            self.generators.pop(rid, None)

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
        tables = [batch.block_tables[b] for b in active]
        starts = []
        for r in reqs:
            seen, preempted = self.computed.get(r.request_id, (0, r.num_preemptions))
            # K/V from before a preemption are gone (blocks freed or swapped); past num_tokens - 1 they
            # belong to drafts that may have been rejected
            starts.append(min(seen, r.num_tokens - 1) if preempted == r.num_preemptions else 0)
        # catch up: every token not yet seen, up to the newest; its last row gives draft 1
        chunks = [r.tokens(s, r.num_tokens) for r, s in zip(reqs, starts)]
        lens = np.array([len(c) for c in chunks], dtype=np.int64)
        positions = np.concatenate([np.arange(s, r.num_tokens) for r, s in zip(reqs, starts)])
        seq_lens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
        hidden = self._forward(np.concatenate(chunks), positions, lens, seq_lens, tables, decode=False)
        last_rows = torch.from_numpy(np.cumsum(lens) - 1).to(self.device)
        drafts = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        tok = self._draw(hidden[last_rows], reqs, qs)
        for i, t in enumerate(tok):
            drafts[i].append(t)
        for j in range(1, max(ks)):  # decode steps: draft j at position num_tokens + j - 1
            live = [i for i, k in enumerate(ks) if k > j]
            ids = np.array([drafts[i][-1] for i in live], dtype=np.int64)
            pos = np.array([reqs[i].num_tokens + j - 1 for i in live], dtype=np.int64)
            hidden = self._forward(ids, pos, np.ones(len(live), dtype=np.int64), pos + 1,
                                   [tables[i] for i in live], decode=True)
            sub = [reqs[i] for i in live]
            sub_q: list[list[torch.Tensor]] = [qs[i] for i in live]
            for i, t in zip(live, self._draw(hidden, sub, sub_q)):
                drafts[i].append(t)
        for i, (b, r, k) in enumerate(zip(active, reqs, ks)):
            self.computed[r.request_id] = (r.num_tokens + k - 1, r.num_preemptions)
            token_ids[b] = drafts[i]
            probs[b] = torch.stack(qs[i]) if qs[i] else None
        return DraftProposal(token_ids, probs)

    def _forward(self, ids: np.ndarray, positions: np.ndarray, q_lens: np.ndarray, seq_lens: np.ndarray,
                 tables: list[list[int]], decode: bool) -> torch.Tensor:
        """One draft forward over a varlen batch; returns hidden states [tokens, hidden]."""
        n = len(q_lens)
        bs = self.block_size
        width = self.max_blocks
        size = None
        if decode and self.graphs is not None and n <= self.graphs.sizes[-1]:
            size = next(s for s in self.graphs.sizes if s >= n)
        rows = size or n
        qsl = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:n + 1])
        block_tables = np.zeros((rows, width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t[:width]
        seq_of_token = np.repeat(np.arange(n), q_lens)
        slots = (block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs)
        lens = np.ones(rows, dtype=np.int32)
        lens[:n] = seq_lens
        if size is not None:  # padding rows: one token each, context 1, nothing written
            qsl[n + 1:] = qsl[n] + np.arange(1, rows - n + 1)
            slots = np.concatenate([slots, np.full(rows - n, -1, dtype=np.int64)])
            layout = BatchLayout(qsl, lens, block_tables, slots)
            self.graphs.input_ids[:rows].zero_()
            self.graphs.input_ids[:n].copy_(torch.from_numpy(ids))
            self.graphs.positions[:rows].zero_()
            self.graphs.positions[:n].copy_(torch.from_numpy(positions))
            return self.graphs.replay(layout)[:n]
        layout = BatchLayout(qsl, lens, block_tables, slots)
        meta = self.attn.build_metadata(layout)
        ids_t = torch.from_numpy(ids).to(self.device)
        pos_t = torch.from_numpy(positions).to(self.device)
        return self.model(ids_t, pos_t, self.kv_caches, meta)

    def _draw(self, hidden: torch.Tensor, reqs: list, qs: list[list[torch.Tensor]]) -> list[int]:
        """One draft token per row: the argmax for greedy requests; for sampled ones a token drawn at the
        request's temperature, its distribution appended to ``qs[i]``."""
        logits = self.model.compute_logits(hidden).float()
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if r.sampling_params.temperature > 0]
        if sampled:
            temps = torch.tensor([reqs[i].sampling_params.temperature for i in sampled], device=self.device)
            probs = torch.softmax(logits[sampled] / temps[:, None], dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for row, i in enumerate(sampled):
                gen = self._generator(reqs[i])
                if gen is not None:
                    noise[row].exponential_(generator=gen)
            tokens[sampled] = (probs / noise).argmax(dim=-1)
            for row, i in enumerate(sampled):
                qs[i].append(probs[row])
        return tokens.tolist()

    def _generator(self, req: Any) -> torch.Generator | None:
        """Seeded requests draft from their own stream, so their drafts (and outputs) repeat run to run."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator(device=self.device)
            gen.manual_seed((seed + 0x5EED) % 2 ** 64)
        return gen
