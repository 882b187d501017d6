"""Prompt log-probabilities' logits, a bounded slice at a time.

NOTE: [rows, vocab] float32 logits for a whole prompt chunk could take gigabytes: they are computed
``prompt_logprobs_rows`` positions at a time, and handed to a sink (the driver's ``ModelRunner`` turns each
slice into log-probabilities at once). The KV sizing profile runs one slice of this size.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from kvforge.rank.input_buffers import h2d
from kvforge.rank.model_build import RankModel

#: device memory for one slice of prompt log-probabilities (logits, log-softmax and rank mask)
PROMPT_LOGPROBS_SLICE_BYTES = 256 << 20


def prompt_logprobs_rows(vocab_size: int) -> int:
    """Prompt positions whose log-probabilities are computed at once: about
    ``PROMPT_LOGPROBS_SLICE_BYTES`` of float32 logits and their temporaries."""
    return max(1, PROMPT_LOGPROBS_SLICE_BYTES // (vocab_size * 12))


def prompt_logits(model: RankModel, hidden: torch.Tensor, rows: np.ndarray, vocab_size: int,
                  sink: Callable[[int, torch.Tensor], None] | None) -> None:
    """``sink(start, logits)`` for each slice of ``hidden[rows]``'s float32 logits, ``start`` its first
    index in ``rows``."""
    rows_dev = h2d(rows, torch.long, hidden.device)
    step = prompt_logprobs_rows(vocab_size)
    for i in range(0, len(rows), step):
        logits = model.compute_logits(hidden[rows_dev[i:i + step]]).float()
        if sink is not None:
            sink(i, logits)
