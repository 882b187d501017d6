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
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from kvforge.keyed_random import keyed_draw, row_keys
from kvforge.model.loader import load_model_config, resolve_model_source
from kvforge.plugin_manager import get_plugin_manager
from kvforge.rank.batch_layout import lay_out_batch
from kvforge.rank.cuda_graphs import CUDAGraphRunner
from kvforge.rank.input_buffers import StagingBuffers, h2d
from kvforge.rank.kv_sizing import bytes_per_block
from kvforge.rank.model_build import RankModel, build_model, checkpoint_quantization, hidden_states, quantization_method
from kvforge.request import Request
from kvforge.spec_decode.drafter import DraftBatch, Drafter, DraftProposal

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
        pm = get_plugin_manager()
        # the same build as the engine's worker: unsharded, the KV cache in the model dtype, the
        # quantization its checkpoint declares (kvforge.rank.model_build)
        built = build_model(pm, src, mc, attention_backend=attention_backend, device=self.device, dtype=self.dtype,
                            block_size=self.block_size,
                            quant=quantization_method(pm, checkpoint_quantization(pm, mc), mc))
        self.attn = built.attn
        self.model: RankModel | None = built.model
        self.enforce_eager = enforce_eager
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CUDAGraphRunner | None = None
        self.staging: StagingBuffers | None = None  # one set per forward of a proposal (its k forwards)
        self.max_blocks = 0
        self.computed: dict[str, tuple[int, int]] = {}  # request -> (tokens with draft K/V, its preemptions then)
        logger.info("draft model %s (%d layers) on attention backend %s", src.name, mc.num_hidden_layers,
                    built.attn_name)

    # -- set-up ----------------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.attn, self.model_config.num_hidden_layers)

    def initialize(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int) -> None:
        self.kv_caches = self.attn.allocate_kv_cache(num_blocks, self.model_config.num_hidden_layers)
        self.max_blocks = -(-max_model_len // block_size)
        top = max_num_seqs
        if (self.device.type == "cuda" and not self.enforce_eager
                and type(self.attn).capabilities.supports_cuda_graphs):
            # q=1: the decode steps, and a catch-up of one new token; q=2: a catch-up after a fully
            # accepted run (the last draft and the target's bonus token)
            self.graphs = CUDAGraphRunner(self._model(), self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                          max_model_len=max_model_len, device=self.device, query_lens=(1, 2))
            self.graphs.capture()
            top = self.graphs.sizes[-1]
        # pinned host buffers, one set per forward of a proposal (catch-up, then k - 1 decode steps): their
        # copies to the device stay queued while the next forward is laid out (grown for a long catch-up)
        self.staging = StagingBuffers(2 * top, top, self.max_blocks, self.device, num_sets=self.num_speculative_tokens)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.computed.pop(rid, None)

    def shutdown(self) -> None:
        self.graphs = self.model = None  # the graphs (and their memory pool) first: they hold the model's tensors
        self.kv_caches = []
        self.staging = None

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
        # the drafts stay on the device until the last step (one copy back): each decode step reads
        # the previous step's tokens there, so the host queues the steps without waiting for them
        tok = self._draw(last, reqs, qs)
        steps: list[tuple[list[int], torch.Tensor]] = [(list(range(len(reqs))), tok)]
        for j in range(1, max(ks)):  # decode steps: draft j at position num_tokens + j - 1
            prev = steps[-1][0]
            live = [i for i in prev if ks[i] > j]
            if len(live) < len(prev):
                keep = [n for n, i in enumerate(prev) if ks[i] > j]
                tok = tok[h2d(keep, torch.long, self.device)]
            hidden = self._forward(tok, num_tokens[live] + j - 1, np.ones(len(live), dtype=np.int64),
                                   [tables[i] for i in live], stage=j)
            tok = self._draw(hidden, [reqs[i] for i in live], [qs[i] for i in live])
            steps.append((live, tok))
        flat = torch.cat([t for _, t in steps]).tolist()
        drafts: list[list[int]] = [[] for _ in reqs]
        at = 0
        for live, _ in steps:
            for i in live:
                drafts[i].append(flat[at])
                at += 1
        for i, (b, r, k) in enumerate(zip(active, reqs, ks)):
            self.computed[r.request_id] = (r.num_tokens + k - 1, r.num_preemptions)
            token_ids[b] = drafts[i]
            probs[b] = torch.stack(qs[i]) if qs[i] else None
        return DraftProposal(token_ids, probs)

    def _forward(self, ids: np.ndarray | torch.Tensor, starts: np.ndarray, q_lens: np.ndarray,
                 tables: Sequence[Sequence[int]], stage: int) -> torch.Tensor:
        """One draft forward over a varlen batch, request i's ``q_lens[i]`` tokens from position
        ``starts[i]`` (``ids`` on the host or the device); returns hidden states [tokens, hidden]. Laid
        out as the worker lays out a step (``kvforge.rank.batch_layout.lay_out_batch``) in the pinned
        buffers of ``stage``; a uniform batch of a captured query length replays a CUDA graph."""
        n, q = len(q_lens), int(q_lens[0])
        g = self.graphs
        sizes = g.sizes_for.get(q) if g is not None else None
        graph_key = None
        if sizes and n <= sizes[-1] and not (q_lens != q).any():
            graph_key = (next(s for s in sizes if s >= n), q)  # padding rows: context q, nothing written
        num_tokens = n * q if graph_key is not None else int(q_lens.sum())
        rows = graph_key[0] if graph_key is not None else n
        buf = self._staging().at(stage, rows * q if graph_key is not None else num_tokens, rows, self.max_blocks)
        layout = lay_out_batch(buf, starts, q_lens, num_tokens, tables, block_size=self.block_size,
                               width=self.max_blocks, graph_key=graph_key)
        pinned = buf.tensors
        if not isinstance(ids, torch.Tensor):
            buf.np["input_ids"][:num_tokens] = ids
        if g is None or graph_key is None:
            ids_t = ids if isinstance(ids, torch.Tensor) else pinned["input_ids"][:num_tokens].to(self.device, non_blocking=True)
            pos_t = pinned["positions"][:num_tokens].to(self.device, non_blocking=True)
            return hidden_states(self._model()(ids_t, pos_t, self.kv_caches, self.attn.build_metadata(layout)))
        g.positions[:layout.num_tokens].copy_(pinned["positions"][:layout.num_tokens], non_blocking=True)
        if isinstance(ids, torch.Tensor):
            g.input_ids[:num_tokens].copy_(ids)
        else:
            g.input_ids[:num_tokens].copy_(pinned["input_ids"][:num_tokens], non_blocking=True)
        return hidden_states(g.replay(layout))[:num_tokens]

    def _model(self) -> RankModel:
        if self.model is None:
            raise RuntimeError("draft_model: the drafter was shut down")
        return self.model

    def _staging(self) -> StagingBuffers:
        if self.staging is None:
            raise RuntimeError("draft_model: propose before initialize (or after shutdown)")
        return self.staging

    def _draw(self, hidden: torch.Tensor, reqs: list[Request], qs: list[list[torch.Tensor]]) -> torch.Tensor:
        """One draft token per row, on the device: the argmax for greedy requests; for sampled ones a
        token drawn at the request's temperature, its distribution appended to ``qs[i]``."""
        logits = self._model().compute_logits(hidden).float()
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if r.sampling_params.temperature > 0]
        if sampled:
            rows = h2d(sampled, torch.long, self.device)
            temps = h2d([reqs[i].sampling_params.temperature for i in sampled], torch.float32, self.device)
            probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)
            tokens[rows] = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
            seeded = [n for n, i in enumerate(sampled) if reqs[i].sampling_params.seed is not None]
            if seeded:
                # NOTE: a seeded request drafts with the target's own keyed noise at the draft's output
                # position (kvforge.keyed_random): the draft then couples with the token the target draws
                # there, which verification accepts (docs/speculative.md, coupled verification)
                keys = row_keys([reqs[sampled[n]].sampling_params.seed or 0 for n in seeded],
                                [len(reqs[sampled[n]].output_token_ids) + len(qs[sampled[n]]) for n in seeded])
                at = h2d(seeded, torch.long, self.device)
                tokens[rows[at]] = keyed_draw(probs[at], h2d(keys, torch.long, self.device))
            for row, i in enumerate(sampled):
                qs[i].append(probs[row])
        return tokens
