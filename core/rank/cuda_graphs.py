"""CUDA graphs for uniform steps: capture once per (padded batch size, query tokens per sequence),
replay every step.

A decode step (every sequence computes one token) runs the same kernels each time, only on other
data; replaying a captured graph removes the per-kernel launch cost (hundreds of launches per step
for a 32-layer model). Speculative decoding's verification steps are uniform too: every sequence
computes 1 + k tokens (its own token and k drafts, padded to k by the engine), so they get graphs
of their own, keyed by the query length q. Inputs live in static buffers: token ids, positions, and
the attention metadata, which the backend refreshes in place (``AttentionBackend.update_graph_metadata``).
A batch of n sequences replays the graph of the smallest captured size >= n; the padding rows
compute throw-away tokens (slot -1: nothing is written to the cache).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from kvforge.attention import AttentionBackend, AttentionMetadata, BatchLayout
from kvforge.rank.model_build import RankModel, hidden_states
from kvforge.rank.parallel_state import WHOLE, PPStage

if TYPE_CHECKING:
    from kvforge.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

#: verification graphs (q > 1) are captured only for batches of at most this many query tokens: past
#: it a step is compute-bound, launches are a small part of it, and the speculation policy turns
#: drafting off anyway
MAX_SPEC_GRAPH_TOKENS = 1024
#: verification graphs of at most this many query tokens also capture the greedy verification head
#: (float32 logits of every row live in the graph's memory pool: 256 x vocab x 4 bytes)
MAX_VERIFY_HEAD_TOKENS = 256


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to ``max_num_seqs`` (at most ``limit``)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def uniform_layout(n: int, q: int, max_blocks: int, seq_lens: np.ndarray | None = None,
                   block_tables: np.ndarray | None = None, slots: np.ndarray | None = None) -> BatchLayout:
    """A layout of n sequences of q query tokens each (defaults: context q, block 0, slot -1 = no write)."""
    return BatchLayout(
        query_start_loc=np.arange(n + 1, dtype=np.int32) * q,
        seq_lens=np.full(n, q, dtype=np.int32) if seq_lens is None else seq_lens,
        block_tables=np.zeros((n, max_blocks), dtype=np.int32) if block_tables is None else block_tables,
        slot_mapping=np.full(n * q, -1, dtype=np.int64) if slots is None else slots,
    )


def decode_layout(n: int, max_blocks: int, seq_lens: np.ndarray | None = None,
                  block_tables: np.ndarray | None = None, slots: np.ndarray | None = None) -> BatchLayout:
    """A decode-only layout of n rows (defaults: context 1, block 0, slot -1 = no write)."""
    return uniform_layout(n, 1, max_blocks, seq_lens, block_tables, slots)


class CUDAGraphRunner:
    """Holds one captured graph per (batch size, query length), with their static inputs and outputs."""

    def __init__(self, model: RankModel, attn: AttentionBackend, kv_caches: list[torch.Tensor], *,
                 max_num_seqs: int, max_model_len: int, device: torch.device, query_lens: Sequence[int] = (1,),
                 verify_head: bool = False, before_capture: Callable[[int], None] | None = None,
                 stage: PPStage = WHOLE, hidden_size: int = 0, dtype: torch.dtype = torch.bfloat16):
        """``verify_head``: verification graphs (q > 1, at most ``MAX_VERIFY_HEAD_TOKENS`` tokens) also
        compute the logits and verify the drafts greedily (:meth:`head`). ``before_capture(rows)``:
        called before each graph of ``rows`` rows is warmed up and captured (LoRA sizes its kernels).

        A pipeline ``stage`` captures its own layers only: a stage after the first reads the previous
        stage's (hidden, residual) from static buffers (:meth:`stage_inputs`, ``hidden_size`` wide, of
        ``dtype``), and one before the last leaves its own (hidden, residual) as the graph's output. The
        hand-over between stages (``stage_forward.stage_replay``) stays outside the graphs."""
        self.before_capture = before_capture
        self.model, self.attn, self.kv_caches = model, attn, kv_caches
        self.stage = stage
        self.verify_head = verify_head and stage.is_last
        self.device = device
        # NOTE: torch.cuda.graph's default capture stream is one per process, made on the device current
        # at its first use: a second engine on another GPU (a pipeline's driver is on cuda:1) would
        # capture on it, and Triton then refuses this device's pointers
        self.stream = torch.cuda.Stream(device=device)
        self.sizes = capture_sizes(max_num_seqs)
        self.query_lens = sorted(set(query_lens) | {1})
        # sizes per query length: every size for decode, verification only up to MAX_SPEC_GRAPH_TOKENS
        self.sizes_for = {q: [s for s in self.sizes if q == 1 or s * q <= MAX_SPEC_GRAPH_TOKENS]
                          for q in self.query_lens}
        self.max_blocks = -(-max_model_len // attn.block_size)
        top = max(s * q for q, sizes in self.sizes_for.items() for s in sizes)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.inter = None if stage.is_first else (torch.zeros(top, hidden_size, dtype=dtype, device=device),
                                                  torch.zeros(top, hidden_size, dtype=dtype, device=device))
        # (size, q) -> the graph, its metadata, and its output: hidden states (the last stage), else
        # (hidden, residual)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, AttentionMetadata,
                                                 torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = {}
        self.heads: dict[tuple[int, int], torch.Tensor] = {}  # (size, q) -> [size, q + 1] greedy verification
        self.replays: dict[tuple[int, int], int] = {}  # (size, q) -> replays so far
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every (size, q), largest first (so smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        keys = sorted(((s, q) for q, sizes in self.sizes_for.items() for s in sizes), key=lambda k: -k[0] * k[1])
        for n, q in keys:
            meta = self.attn.build_graph_metadata(uniform_layout(n, q, self.max_blocks))
            ids, pos = self.input_ids[:n * q], self.positions[:n * q]
            with_head = self.verify_head and q > 1 and n * q <= MAX_VERIFY_HEAD_TOKENS
            if self.before_capture is not None:
                self.before_capture(n * q)
            for _ in range(2):  # warm up: autotuning, lazy allocations
                out = self._forward(ids, pos, meta, n * q)
                if with_head:
                    greedy_verify_head(self.model, hidden_states(out), ids, n, q)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = self._forward(ids, pos, meta, n * q)
                if with_head:
                    self.heads[(n, q)] = greedy_verify_head(self.model, hidden_states(out), ids, n, q)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(n, q)] = (graph, meta, out)
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch sizes %d..%d, query lengths %s) in %.1f s", len(self.graphs),
                    self.sizes[0], self.sizes[-1], self.query_lens, elapsed)
        return elapsed

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                 rows: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.stage.size == 1:
            return hidden_states(self.model(ids, pos, self.kv_caches, meta))
        out = self.model(ids, pos, self.kv_caches, meta, intermediate=self.stage_inputs(rows))
        return hidden_states(out) if self.stage.is_last else out

    def stage_inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The static (hidden, residual) a stage after the first reads its first ``rows`` rows from
        (None on the first stage)."""
        return None if self.inter is None else (self.inter[0][:rows], self.inter[1][:rows])

    def padded_size(self, out: SchedulerOutput) -> tuple[int, int] | None:
        """The captured (size, q) to replay for a scheduled step, or None: not uniform (every sequence
        q tokens, q captured), or too large."""
        n = len(out.scheduled)
        if not n:
            return None
        total = out.total_num_scheduled_tokens
        q = total // n
        sizes = self.sizes_for.get(q)
        if not sizes or total != n * q or n > sizes[-1]:
            return None
        if q > 1 and any(v != q for v in out.num_scheduled_tokens.values()):
            return None
        return next(s for s in sizes if s >= n), q

    def head(self, key: tuple[int, int]) -> torch.Tensor | None:
        """The greedy verification of the graph ``key`` (after its replay), or None if it has none:
        row b is sequence b's emitted tokens (NO_TOKEN past them), then how many it emitted."""
        return self.heads.get(key)

    def replay(self, layout: BatchLayout) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of ``layout`` (already padded to a captured size, its inputs already in
        ``input_ids`` / ``positions``, and a later stage's in :meth:`stage_inputs`); returns hidden
        states [size * q, hidden] (a view), or a stage before the last's (hidden, residual)."""
        key = (layout.num_seqs, layout.num_tokens // layout.num_seqs)
        graph, meta, hidden = self.graphs[key]
        self.attn.update_graph_metadata(meta, layout)
        graph.replay()
        self.replays[key] = self.replays.get(key, 0) + 1
        return hidden


def greedy_verify_head(model: RankModel, hidden: torch.Tensor, ids: torch.Tensor, n: int, q: int) -> torch.Tensor:
    """Greedy verification of a uniform step, as tensor ops of static shapes (captured in the graph):
    every sequence's q input ids are its own token and q - 1 drafts. Returns [n, q + 1] int64: the
    emitted tokens (``kvforge.spec_decode.rejection_sampler`` semantics: NO_TOKEN padding), then their count."""
    from kvforge.spec_decode.rejection_sampler import TargetDistribution, rejection_sample

    top, greedy = model.compute_logits(hidden).max(dim=-1)
    return rejection_sample(TargetDistribution(greedy, top > float("-inf")), ids.view(n, q)[:, 1:]).packed()
