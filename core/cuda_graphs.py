"""CUDA graphs for decode-only steps: capture once per padded batch size, replay every step.

A decode step (every sequence computes one token) runs the same kernels each time, only on other
data; replaying a captured graph removes the per-kernel launch cost (hundreds of launches per step
for a 32-layer model). Inputs live in static buffers: token ids, positions, and the attention
metadata, which the backend refreshes in place (``AttentionBackend.update_graph_metadata``).
A batch of n sequences replays the graph of the smallest captured size >= n; the padding rows
compute a throw-away token (slot -1: nothing is written to the cache).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from kvforge.attention import AttentionBackend, BatchLayout

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to ``max_num_seqs`` (at most ``limit``)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def decode_layout(n: int, max_blocks: int, seq_lens: np.ndarray | None = None,
                  block_tables: np.ndarray | None = None, slots: np.ndarray | None = None) -> BatchLayout:
    """A decode-only layout of n rows (defaults: context 1, block 0, slot -1 = no write)."""
    return BatchLayout(
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=np.ones(n, dtype=np.int32) if seq_lens is None else seq_lens,
        block_tables=np.zeros((n, max_blocks), dtype=np.int32) if block_tables is None else block_tables,
        slot_mapping=np.full(n, -1, dtype=np.int64) if slots is None else slots,
    )


class CUDAGraphRunner:
    """Holds one captured graph per batch size, with their static inputs and outputs."""

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, kv_caches: list[torch.Tensor], *,
                 max_num_seqs: int, max_model_len: int, device: torch.device):
        self.model, self.attn, self.kv_caches = model, attn, kv_caches
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // attn.block_size)
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any, torch.Tensor]] = {}
        self.pool = None

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (so smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        for n in reversed(self.sizes):
            meta = self.attn.build_graph_metadata(decode_layout(n, self.max_blocks))
            ids, pos = self.input_ids[:n], self.positions[:n]
            for _ in range(2):  # warm up: autotuning, lazy allocations
                self.model(ids, pos, self.kv_caches, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model(ids, pos, self.kv_caches, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[n] = (graph, meta, hidden)
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.sizes), self.sizes[0],
                    self.sizes[-1], elapsed)
        return elapsed

    def padded_size(self, out: Any) -> int | None:
        """The captured size to replay for a scheduled step, or None: not decode-only, or too large."""
        n = len(out.scheduled)
        if n > self.sizes[-1] or out.total_num_scheduled_tokens != n:
            return None
        return next(s for s in self.sizes if s >= n)

    def replay(self, layout: BatchLayout) -> torch.Tensor:
        """Replay the graph of ``layout.num_seqs`` rows (already padded to a captured size, its inputs
        already in ``input_ids`` / ``positions``); returns hidden states [size, hidden] (a view)."""
        graph, meta, hidden = self.graphs[layout.num_seqs]
        self.attn.update_graph_metadata(meta, layout)
        graph.replay()
        return hidden
