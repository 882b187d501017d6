"""Helpers shared by test modules (importable: pytest puts tests/ on sys.path for its conftest.py)."""
import os

import numpy as np
import pytest

from kvforge.attention import BatchLayout

#: this process runs Triton's CPU interpreter (set before triton is first imported)
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
#: a test that runs only inside the run_in_triton_interpreter fixture's subprocess
interpreted = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in test_kernels_in_interpreter's subprocess")


def random_layout(specs, block_size: int, rng: np.random.Generator, num_blocks: int) -> BatchLayout:
    """A BatchLayout for (cached prefix, new tokens) per sequence, whose sequences own random,
    shuffled physical blocks."""
    blocks = rng.permutation(num_blocks)
    tables, slots, used = [], [], 0
    for prefix, q_len in specs:
        n = -(-(prefix + q_len) // block_size)
        tables.append(blocks[used:used + n])
        used += n
        assert used <= num_blocks
        pos = np.arange(prefix, prefix + q_len)
        slots.append(tables[-1][pos // block_size] * block_size + pos % block_size)
    bt = np.zeros((len(specs), max(len(t) for t in tables)), dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    q_lens = np.array([q for _, q in specs])
    return BatchLayout(query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                       seq_lens=np.array([p + q for p, q in specs], dtype=np.int32),
                       block_tables=bt, slot_mapping=np.concatenate(slots).astype(np.int64))
