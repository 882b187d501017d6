"""The batch layout (``kvforge.rank.batch_layout``), against a per-token reference: every token's row,
position and slot, the padding of a CUDA graph step, and the persistent batch a rank keeps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge.rank.batch_layout import (
    PersistentBatch,
    lay_out_batch,
    lay_out_step,
    prefill_layout,
    slot_mapping,
    write_block_tables,
)
from kvforge.rank.input_buffers import HostInputs, StagingBuffers
from kvforge.rank.step_input import StepInput

BS = 4


def reference(starts, q_lens, tables, block_size, rows=None, q=0):
    """Per token, in Python: rows, positions, context lengths and slots (padding as the docstring says)."""
    positions, slots, qsl = [], [], [0]
    for start, n, table in zip(starts, q_lens, tables):
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
    seq_lens = [s + n for s, n in zip(starts, q_lens)]
    for _ in range((rows or len(q_lens)) - len(q_lens)):  # graph padding: q tokens each, nothing written
        positions += [0] * q
        slots += [-1] * q
        qsl.append(qsl[-1] + q)
        seq_lens.append(q)
    return qsl, positions, seq_lens, slots


def random_batch(rng, n, max_len=40):
    starts = rng.integers(0, max_len, n)
    q_lens = rng.integers(1, 9, n)
    blocks = rng.permutation(1000)
    tables, used = [], 0
    for s, q in zip(starts, q_lens):
        k = -(-(s + q) // BS) + int(rng.integers(0, 3))  # some tables hold blocks past the step
        tables.append([int(b) for b in blocks[used:used + k]])
        used += k
    return starts.astype(np.int64), q_lens.astype(np.int64), tables


@pytest.mark.parametrize("seed", range(5))
def test_lay_out_batch_places_every_token_as_the_reference_does(seed):
    rng = np.random.default_rng(seed)
    starts, q_lens, tables = random_batch(rng, int(rng.integers(1, 7)))
    width = max(len(t) for t in tables)
    buf = HostInputs(200, 16, width, pin=False)
    layout = lay_out_batch(buf, starts, q_lens, int(q_lens.sum()), tables, block_size=BS, width=width)
    qsl, positions, seq_lens, slots = reference(starts, q_lens, tables, BS)
    assert layout.query_start_loc.tolist() == qsl
    assert buf.np["positions"][:layout.num_tokens].tolist() == positions
    assert layout.seq_lens.tolist() == seq_lens
    assert layout.slot_mapping.tolist() == slots
    for i, t in enumerate(tables):
        assert layout.block_tables[i, :len(t)].tolist() == t and not layout.block_tables[i, len(t):].any()


@pytest.mark.parametrize("q", [1, 2, 3])
def test_a_graph_step_is_laid_out_at_the_padded_size(q):
    rng = np.random.default_rng(q)
    starts, _, tables = random_batch(rng, 3)
    q_lens = np.full(3, q, dtype=np.int64)
    tables = [t + [7] * 4 for t in tables]  # room for the q tokens
    buf = HostInputs(64, 16, 24, pin=False)
    layout = lay_out_batch(buf, starts, q_lens, 3 * q, tables, block_size=BS, width=24, graph_key=(8, q))
    qsl, positions, seq_lens, slots = reference(starts, q_lens, tables, BS, rows=8, q=q)
    assert (layout.num_seqs, layout.num_tokens, layout.block_tables.shape) == (8, 8 * q, (8, 24))
    assert layout.query_start_loc.tolist() == qsl
    assert buf.np["positions"][:8 * q].tolist() == positions
    assert layout.seq_lens.tolist() == seq_lens
    assert layout.slot_mapping.tolist() == slots
    assert not layout.block_tables[3:].any()  # padding sequences read block 0


def test_lay_out_step_writes_ids_fills_and_sampled_rows_and_alternates_sets():
    batch = PersistentBatch()
    step = StepInput(req_ids=["a", "b"], num_computed=np.array([5, 0]), query_lens=np.array([1, 3]),
                     input_ids=np.array([9, 1, 2, 3]), table_updates=[("a", 0, [4, 6]), ("b", 0, [8])],
                     sample_rows=np.array([0, 3]), num_sample_rows=2, fill_dst=np.array([0]), fill_src=np.array([1]),
                     num_prev_tokens=2)
    batch.apply(step)
    staging = StagingBuffers(8, 4, 2, torch.device("cpu"))
    buf, layout = lay_out_step(step, batch.tables_of(step.req_ids), staging, block_size=BS)
    assert buf.np["input_ids"][:4].tolist() == [9, 1, 2, 3]
    assert (buf.np["fill_dst"][:1].tolist(), buf.np["fill_src"][:1].tolist()) == ([0], [1])
    assert buf.np["sample_rows"][:2].tolist() == [0, 3]
    assert layout.slot_mapping.tolist() == [6 * BS + 1, 8 * BS, 8 * BS + 1, 8 * BS + 2]
    other, _ = lay_out_step(step, batch.tables_of(step.req_ids), staging, block_size=BS)
    assert other is not buf and lay_out_step(step, batch.tables_of(step.req_ids), staging, block_size=BS)[0] is buf


def test_a_graph_step_pads_its_token_ids_with_zeros():
    step = StepInput(req_ids=["a"], num_computed=np.array([2]), query_lens=np.array([1]), input_ids=np.array([5]),
                     graph_key=(4, 1))
    staging = StagingBuffers(8, 4, 3, torch.device("cpu"))
    staging.sets[1].np["input_ids"][:] = 77  # stale ids from an earlier step
    buf, layout = lay_out_step(step, [[3]], staging, block_size=BS, graph_width=3)
    assert buf.np["input_ids"][:4].tolist() == [5, 0, 0, 0]
    assert layout.block_tables.shape == (4, 3) and layout.slot_mapping.tolist() == [3 * BS + 2, -1, -1, -1]


def test_block_tables_are_cut_at_the_width_and_null_blocks_read_as_block_0():
    out = write_block_tables(np.zeros((2, 3), dtype=np.int32), [[1, 2, 3, 4, 5], [-1, -1, 9]], null_blocks=True)
    assert out.tolist() == [[1, 2, 3], [0, 0, 9]]
    kept = write_block_tables(np.zeros((1, 3), dtype=np.int32), [[-1, 2]])
    assert kept.tolist() == [[-1, 2, 0]]


def test_prefill_layout_and_slot_mapping_agree_with_the_reference():
    layout = prefill_layout([5, 3], blocks_per_seq=2, block_size=BS)
    qsl, _, seq_lens, slots = reference([0, 0], [5, 3], [[0, 1], [2, 3]], BS)
    assert (layout.query_start_loc.tolist(), layout.seq_lens.tolist(), layout.slot_mapping.tolist()) == (
        qsl, seq_lens, slots)
    tables = np.array([[3, 1]], dtype=np.int32)
    assert slot_mapping(tables, np.array([3]), np.array([3, 4, 5]), BS).tolist() == [15, 4, 5]


def test_the_persistent_batch_applies_table_changes_and_forgets():
    batch = PersistentBatch()
    batch.apply(StepInput(table_updates=[("a", 0, [1, 2]), ("b", 0, [3])]))
    batch.apply(StepInput(table_updates=[("a", 1, [7, 8])], dropped=["b", "gone"]))
    assert batch.tables == {"a": [1, 7, 8]}
    assert batch.state() == {"requests": 1, "blocks": 3}


def test_staging_sets_grow_when_asked_for_more_room():
    staging = StagingBuffers(4, 2, 2, torch.device("cpu"), num_sets=3)
    first = staging.at(2, 4, 2, 2)
    assert staging.at(2, 4, 2, 2) is first
    grown = staging.at(2, 10, 1, 5)
    assert grown is not first and grown.capacity == (10, 2, 5) and staging.sets[0].capacity == (4, 2, 2)
