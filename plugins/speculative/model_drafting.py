"""What every drafter that runs a model of its own shares (``draft_model``, ``eagle``/``eagle3``).

Such a drafter keeps a paged KV cache of its own, tensors indexed by the target's block ids (the engine
sizes the pool with ``kv_bytes_per_block`` counted and allocates lookahead slots before each proposal).
A proposal ends in a chain of one-token decode steps: each step's drafts stay on the device as the next
step's input ids, laid out in pinned staging buffers (one set per forward, so their copies stay queued
while the next forward is laid out) and replayed as CUDA graphs of query length 1 on CUDA; the host
copies the drafts back once. Greedy requests get the argmax (q one-hot); sampled ones a token drawn at
the request's temperature and its distribution q (over the target's vocabulary), so verification stays
exact; a seeded request draws with the target's keyed noise at the draft's position, so its drafts
repeat run to run and couple with the target's draws (``kvforge.keyed_random``).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from kvforge.attention import AttentionBackend
from kvforge.keyed_random import keyed_draw, row_keys
from kvforge.rank.batch_layout import lay_out_batch
from kvforge.rank.cuda_graphs import CUDAGraphRunner
from kvforge.rank.input_buffers import StagingBuffers, h2d
from kvforge.rank.kv_sizing import bytes_per_block
from kvforge.rank.model_build import RankModel, hidden_states
from kvforge.request import Request
from kvforge.spec_decode.drafter import Drafter


class ModelDrafter(Drafter):
    """A drafter with a model, a KV cache of ``num_kv_layers`` layers on ``attn``, decode-step graphs
    (``graphs``) and staging buffers. A subclass builds ``attn`` and says what its forwards run
    (:meth:`_model`) and, when its vocabulary is not the target's, how its logits map (:meth:`_logits`,
    :meth:`_target_ids`, :meth:`_target_probs`)."""

    name = ""
    attn: AttentionBackend
    num_kv_layers: int = 1
    #: query lengths of the decode graphs (a subclass adds what its other forwards replay)
    graph_query_lens: tuple[int, ...] = (1,)

    def __init__(self, *, enforce_eager: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.enforce_eager = enforce_eager
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CUDAGraphRunner | None = None
        self.staging: StagingBuffers | None = None  # one set per forward of a proposal
        self.max_blocks = 0

    # -- set-up ----------------------------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.attn, self.num_kv_layers)

    def uses_graphs(self) -> bool:
        """CUDA graphs for the drafter's forwards: on CUDA, unless eager, where its backend has them."""
        return (self.device.type == "cuda" and not self.enforce_eager
                and type(self.attn).capabilities.supports_cuda_graphs)

    def graph_lens(self, query_lens: Sequence[int]) -> tuple[int, ...]:
        """Those of ``query_lens`` the backend's graphs replay (as the engine filters the target's)."""
        allowed = type(self.attn).capabilities.cuda_graph_query_lens
        return tuple(q for q in query_lens if allowed is None or q in allowed)

    def initialize(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int) -> None:
        self.kv_caches = self.attn.allocate_kv_cache(num_blocks, self.num_kv_layers)
        self.max_blocks = -(-max_model_len // block_size)
        top = max_num_seqs
        if self.uses_graphs():
            self.graphs = CUDAGraphRunner(self._model(), self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                          max_model_len=max_model_len, device=self.device,
                                          query_lens=self.graph_lens(self.graph_query_lens))
            self.graphs.capture()
            top = self.graphs.sizes[-1]
        # (grown for a longer forward: a draft model's catch-up of a whole prompt)
        self.staging = StagingBuffers(2 * top, top, self.max_blocks, self.device, num_sets=self.num_speculative_tokens)

    def shutdown(self) -> None:
        self.graphs = None  # the graphs (and their memory pool) first: they hold the model's tensors
        self.kv_caches = []
        self.staging = None

    # -- the parts a subclass provides -----------------------------------------------------------
    def _model(self) -> RankModel:
        """What the decode steps run: (input ids, positions, KV caches, metadata) -> hidden states."""
        raise NotImplementedError

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> float32 logits [n, the drafter's vocabulary]."""
        return self._model().compute_logits(hidden).float()

    def _target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """The drafter's token ids as the target's (the same vocabulary by default)."""
        return tokens

    def _target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[n, the drafter's vocabulary] -> [n, the target's vocabulary]."""
        return probs

    def _keep_rows(self, keep: torch.Tensor) -> None:  # noqa: B027 - optional
        """The chain drops the requests that have all their drafts: ``keep`` indexes the rows left."""

    # -- the chain of decode steps ---------------------------------------------------------------
    def _chain(self, tok: torch.Tensor, reqs: Sequence[Request], ks: Sequence[int], tables: Sequence[Sequence[int]],
               first: np.ndarray, qs: list[list[torch.Tensor]]) -> list[list[int]]:
        """Each request's drafts: ``tok`` ([len(reqs)] on the device) is draft 1; decode step j (1 ..
        k - 1) reads draft j at position ``first[i] + j - 1`` and draws draft j + 1."""
        steps: list[tuple[list[int], torch.Tensor]] = [(list(range(len(reqs))), tok)]
        for j in range(1, max(ks)):
            prev = steps[-1][0]
            live = [i for i in prev if ks[i] > j]
            if len(live) < len(prev):
                keep = h2d([n for n, i in enumerate(prev) if ks[i] > j], torch.long, self.device)
                tok = tok[keep]
                self._keep_rows(keep)
            hidden = self._forward(tok, first[live] + j - 1, np.ones(len(live), dtype=np.int64),
                                   [tables[i] for i in live], stage=j)
            tok = self._draw(hidden, [reqs[i] for i in live], [qs[i] for i in live])
            steps.append((live, tok))
        flat = torch.cat([t for _, t in steps]).tolist()  # the one copy back
        drafts: list[list[int]] = [[] for _ in reqs]
        at = 0
        for live, _ in steps:
            for i in live:
                drafts[i].append(flat[at])
                at += 1
        return drafts

    def _forward(self, ids: np.ndarray | torch.Tensor, starts: np.ndarray, q_lens: np.ndarray,
                 tables: Sequence[Sequence[int]], stage: int) -> torch.Tensor:
        """One forward of :meth:`_model` over a varlen batch, request i's ``q_lens[i]`` tokens from
        position ``starts[i]`` (``ids`` on the host or the device); returns hidden states [tokens, hidden].
        Laid out as the worker lays out a step (``kvforge.rank.batch_layout.lay_out_batch``) in the pinned
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

    def _staging(self) -> StagingBuffers:
        if self.staging is None:
            raise RuntimeError(f"{self.name}: propose before initialize (or after shutdown)")
        return self.staging

    def _draw(self, hidden: torch.Tensor, reqs: Sequence[Request], qs: list[list[torch.Tensor]]) -> torch.Tensor:
        """One draft token per row (target ids, on the device): the argmax for greedy requests; for
        sampled ones a token drawn at the request's temperature, its distribution appended to ``qs[i]``."""
        logits = self._logits(hidden)  # [n, the drafter's vocabulary]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(reqs) if r.sampling_params.temperature > 0]
        keyed: tuple[torch.Tensor, torch.Tensor] | None = None  # the seeded rows and their drafts (target ids)
        if sampled:
            rows = h2d(sampled, torch.long, self.device)
            temps = h2d([reqs[i].sampling_params.temperature for i in sampled], torch.float32, self.device)
            probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)
            tokens[rows] = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
            target = self._target_probs(probs)
            seeded = [n for n, i in enumerate(sampled) if reqs[i].sampling_params.seed is not None]
            if seeded:
                # NOTE: a seeded request drafts with the target's own keyed noise at the draft's output
                # position, over the target's vocabulary (kvforge.keyed_random): the draft then couples
                # with the token the target draws there, which verification accepts (docs/speculative.md)
                keys = row_keys([reqs[sampled[n]].sampling_params.seed or 0 for n in seeded],
                                [len(reqs[sampled[n]].output_token_ids) + len(qs[sampled[n]]) for n in seeded])
                at = h2d(seeded, torch.long, self.device)
                keyed = (rows[at], keyed_draw(target[at], h2d(keys, torch.long, self.device)))
            for row, i in enumerate(sampled):
                qs[i].append(target[row])
        tokens = self._target_ids(tokens)
        return tokens if keyed is None else tokens.index_copy(0, *keyed)
