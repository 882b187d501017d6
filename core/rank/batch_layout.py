"""The batch layout: where each token of a step sits in the flat batch and which KV slot it writes.

Request i computes ``query_lens[i]`` tokens from position ``num_computed[i]``: its rows are
``query_start_loc[i] .. query_start_loc[i + 1]``, its context after the step ``num_computed[i] +
query_lens[i]``, and its token at position p writes slot ``block_table[p // block_size] * block_size +
p % block_size`` (:func:`slot_mapping`: the one place that formula is written). A CUDA graph step is
laid out at the graph's padded size: the padding sequences compute q throw-away tokens each (context q,
block 0, slot -1: nothing is written).

The worker lays out each step with :func:`lay_out_step`; a drafter that runs a model of its own over
the target's block ids (``draft_model``) lays out its forwards with :func:`lay_out_batch`. Everything
is vectorised numpy written into views of the pinned staging buffers (``kvforge.rank.input_buffers``):
the only per-request Python is copying each block table's row.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvforge.attention import BatchLayout
from kvforge.rank.input_buffers import HostInputs, StagingBuffers
from kvforge.rank.step_input import StepInput


class PersistentBatch:
    """The block tables a rank holds (request id -> block ids), changed only by what each step sends."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, step: StepInput) -> None:
        """Forget the step's dropped requests; apply its table changes (``table[:start] + ids``)."""
        tables = self.tables
        for rid in step.dropped:
            tables.pop(rid, None)
        for rid, start, ids in step.table_updates:
            if start == 0:
                tables[rid] = list(ids)
            else:
                table = tables[rid]
                del table[start:]
                table.extend(ids)

    def tables_of(self, req_ids: Sequence[str]) -> list[list[int]]:
        return [self.tables[rid] for rid in req_ids]

    def state(self) -> dict[str, int]:
        """The requests held, and their blocks."""
        return {"requests": len(self.tables), "blocks": sum(len(t) for t in self.tables.values())}


def slot_mapping(block_tables: np.ndarray, query_lens: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """int64 [num_tokens]: the KV slot each token writes, for the tokens of sequence i (``query_lens[i]``
    of them, in order) at ``positions`` with block table row i.

    NOTE: the one slot formula, ``block_table[pos // block_size] * block_size + pos % block_size``; the
    attention backends read K/V back at the same place."""
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    return block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size


def write_block_tables(out: np.ndarray, tables: Sequence[Sequence[int]], null_blocks: bool = False) -> np.ndarray:
    """Row i of ``out`` (zero-filled, [rows, width]) takes ``tables[i]``, cut at the width (blocks past
    it hold no position the step reads). ``null_blocks``: the KV manager may have given blocks behind a
    sliding window back (``kvforge.kv_cache.NULL_BLOCK`` entries): they read as block 0."""
    width = out.shape[1]
    for i, t in enumerate(tables):
        if len(t) <= width:
            out[i, :len(t)] = t
        else:
            out[i] = t[:width]
    if null_blocks:
        np.maximum(out, 0, out=out)
    return out


def prefill_layout(lens: list[int], blocks_per_seq: int, block_size: int) -> BatchLayout:
    """Layout of fresh prefills (fresh arrays), sequence i owning blocks [i*blocks_per_seq, (i+1)*blocks_per_seq)."""
    q_lens = np.array(lens, dtype=np.int64)
    query_starts = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_starts[1:])
    tables = np.arange(len(lens) * blocks_per_seq, dtype=np.int32).reshape(len(lens), blocks_per_seq)
    positions = np.concatenate([np.arange(n) for n in lens])
    return BatchLayout(query_starts, q_lens.astype(np.int32), tables, slot_mapping(tables, q_lens, positions, block_size))


def lay_out_batch(buf: HostInputs, num_computed: np.ndarray, query_lens: np.ndarray, num_tokens: int,
                  tables: Sequence[Sequence[int]], *, block_size: int, width: int,
                  graph_key: tuple[int, int] | None = None, null_blocks: bool = False) -> BatchLayout:
    """Write the layout of a batch into ``buf``: query starts, positions, context lengths, block tables
    ``width`` blocks wide, slots. ``num_tokens`` is ``query_lens.sum()``. With ``graph_key`` = (rows, q)
    (a uniform batch of q tokens each, replayed as the CUDA graph of ``rows`` sequences) the sequences
    past the batch are padding. Token ids are the caller's (``buf.np["input_ids"]``)."""
    n = len(query_lens)
    rows, q = graph_key if graph_key is not None else (n, 0)
    num_rows = num_tokens if graph_key is None else rows * q
    b = buf.np
    query_starts = b["query_start_loc"][:rows + 1]
    query_starts[0] = 0
    np.cumsum(query_lens, out=query_starts[1:n + 1])
    positions = b["positions"][:num_rows]
    # token j of request i sits at num_computed[i] + j: its row minus (its first row - its first position)
    np.subtract(np.arange(num_tokens), np.repeat(query_starts[:n] - num_computed, query_lens),
                out=positions[:num_tokens])
    seq_lens = b["seq_lens"][:rows]
    seq_lens[:n] = num_computed + query_lens
    block_tables = write_block_tables(buf.block_tables(rows, width), tables, null_blocks)
    slots = b["slot_mapping"][:num_rows]
    slots[:num_tokens] = slot_mapping(block_tables, query_lens, positions[:num_tokens], block_size)
    if num_rows > num_tokens:  # graph padding sequences: q tokens each
        query_starts[n + 1:] = num_tokens + np.arange(1, rows - n + 1) * q
        positions[num_tokens:] = 0
        seq_lens[n:] = q
        slots[num_tokens:] = -1
    return BatchLayout(query_starts, seq_lens, block_tables, slots)


def lay_out_step(step: StepInput, tables: Sequence[Sequence[int]], staging: StagingBuffers, *, block_size: int,
                 graph_width: int | None = None, null_blocks: bool = False) -> tuple[HostInputs, BatchLayout]:
    """Lay a step out in the next set of staging buffers: its layout (:func:`lay_out_batch`), token ids,
    placeholder fills and sampled rows. ``tables``: the step's requests' block tables; ``graph_width``:
    the captured graphs' block-table width, for a step with a ``graph_key`` (else the widest table's)."""
    n = len(step.req_ids)
    total = step.num_tokens
    rows, q = step.graph_key if step.graph_key is not None else (n, 0)
    num_rows = total if step.graph_key is None else rows * q
    width = graph_width if step.graph_key is not None and graph_width is not None else max(len(t) for t in tables)
    fills = 0 if step.fill_dst is None else len(step.fill_dst)
    buf = staging.next(num_rows, max(rows, step.num_sample_rows, fills), width)
    layout = lay_out_batch(buf, step.num_computed, step.query_lens, total, tables, block_size=block_size,
                           width=width, graph_key=step.graph_key, null_blocks=null_blocks)
    b = buf.np
    ids = b["input_ids"][:num_rows]
    ids[:total] = step.input_ids
    if num_rows > total:
        ids[total:] = 0
    if step.fill_dst is not None and step.fill_src is not None:
        b["fill_dst"][:fills] = step.fill_dst
        b["fill_src"][:fills] = step.fill_src
    if step.sample_rows is not None:
        b["sample_rows"][:step.num_sample_rows] = step.sample_rows
    return buf, layout
