"""Helpers shared by test modules (importable: pytest puts tests/ on sys.path for its conftest.py)."""
import contextlib
import os
from collections.abc import Iterator

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


# -- sliding windows: blocks the KV manager gave back (their table entries read as block 0) -------------
def first_visible(specs, window: int | None) -> list[int]:
    """The lowest position any query of each (cached prefix, new tokens) sequence sees: its first query
    sits at the prefix and sees ``window`` positions back to it (0 without a window)."""
    return [0 if window is None else max(0, prefix - window + 1) for prefix, _ in specs]


def give_back_blocks(layout: BatchLayout, first: list[int], block_size: int) -> BatchLayout:
    """``layout`` after the KV manager gave back every block wholly before each sequence's window
    (``first``: from :func:`first_visible`): their block-table entries become 0. Block ids move up by one
    first, so that block 0 is nobody's in this batch (the cache needs one more block) and the caller
    chooses what it holds."""
    used = np.arange(layout.block_tables.shape[1])[None, :] < -(-layout.seq_lens[:, None] // block_size)
    tables = np.where(used, layout.block_tables + 1, 0).astype(np.int32)
    for i, lo in enumerate(first):
        tables[i, :lo // block_size] = 0
    return BatchLayout(query_start_loc=layout.query_start_loc, seq_lens=layout.seq_lens, block_tables=tables,
                       slot_mapping=layout.slot_mapping + block_size)


# -- transformers' GGUF loading ------------------------------------------------------------------------
@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within it, transformers' GGUF loading builds each of gguf-py's read-only helpers once and hands
    it out again, where one ``from_pretrained(gguf_file=...)`` builds them over and over:

    - ``GGUFReader(path)``: two per load (the config's, then the weights'), and a reader parses every
      metadata value in Python: 10 s of CPU for Gemma 3's 262,144-token vocabulary, 2 s for the default
      model's. It only reads its memory-mapped file.
    - ``get_tensor_name_map(arch, n_blocks)``: one per module of the model (about 400, 10 ms each); a
      table of names that is only looked up.

    What transformers builds is the same (the reference the tests compare with); only the repeats go."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}
    name_maps: dict[tuple[gguf.MODEL_ARCH, int], gguf.TensorNameMap] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)  # type: ignore[arg-type]  # (gguf-py types mode as a Literal)
        return readers[key]

    def name_map(arch: gguf.MODEL_ARCH, n_blocks: int) -> gguf.TensorNameMap:
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = real_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    # transformers imports both from the package inside each call
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


def doc_field_table(doc, marker: str) -> list[str]:
    """The field names (backquoted words of the first column) of the table after ``<!-- fields: marker -->``
    in the Markdown file ``doc``: what the docs-hold-the-code tests compare with the request models."""
    import re

    lines = doc.read_text().splitlines()
    rows = []
    for line in lines[lines.index(f"<!-- fields: {marker} -->") + 1:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return [name for row in rows[2:] for name in re.findall(r"`(\w+)`", row.split("|")[1])]
