import numpy as np

from kvforge.rank.cuda_graphs import capture_sizes, decode_layout


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(4096)[-1] == 512


def test_padding_rows_write_nothing():
    layout = decode_layout(4, 8)
    assert layout.num_tokens == 4 and (layout.slot_mapping == -1).all() and (layout.seq_lens == 1).all()
    assert layout.block_tables.shape == (4, 8) and np.array_equal(layout.query_start_loc, np.arange(5))
