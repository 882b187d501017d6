"""A target step's hidden states as a drafter sees them (``Drafter.observe``): which rows are whose, and
the token after each row's position, built on the device right after the step's sampling is queued.

An EAGLE head's row at position t reads the target's state at t and the token at t + 1. Inside a
request's rows that token is the next row's input; a row the step samples gets its sampled token
(still on the device: the step's tokens have not reached the host, and with async scheduling they
will not before the next step is launched); the last row of a prompt chunk gets the prompt's next
token, known on the host. So the ids are the step's input ids shifted by one row, with two scatters:
one copy to the device for the host's part, no wait.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvforge.model.hidden_capture import HiddenStateCapture
from kvforge.rank.input_buffers import h2d
from kvforge.rank.step_handle import StepHandle
from kvforge.rank.step_input import ForwardOutput, StepInput, StepPlan
from kvforge.request import Request
from kvforge.spec_decode.drafter import TargetHiddenStates


def target_hidden_states(step: StepInput, plan: StepPlan, reqs: Sequence[Request], fwd: ForwardOutput,
                         handle: StepHandle, capture: HiddenStateCapture) -> TargetHiddenStates | None:
    """The view of a step the driver just queued (``reqs``: the scheduled requests, in the step's order);
    None when the driver's output carries no layout (a step with nothing to compute)."""
    layout, positions = fwd.layout, fwd.positions
    if layout is None or positions is None:
        return None
    rows = layout.num_tokens  # with graph padding
    total = step.num_tokens
    device = fwd.input_ids.device
    query_start = np.zeros(len(step.req_ids) + 1, dtype=np.int64)
    np.cumsum(step.query_lens, out=query_start[1:])
    nxt = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
    nxt[:total - 1] = fwd.input_ids[1:total]
    # the host's part: each prompt chunk's last row takes the request's next known token
    ends_pos = step.num_computed + step.query_lens
    chunk = [i for i, r in enumerate(reqs) if ends_pos[i] < r.num_tokens]
    tail_rows = query_start[1:][chunk] - 1
    tail_ids = np.fromiter((max(reqs[i].all_token_ids[int(ends_pos[i])], 0) for i in chunk), dtype=np.int64,
                           count=len(chunk))  # (never a placeholder: an in-flight token is a request's last)
    sampled_rows = (step.sample_rows if step.sample_rows is not None
                    else np.arange(step.num_sample_rows, dtype=np.int64))
    verified = handle.verified is not None and plan.row_counts is not None
    if verified:  # row j of request b's 1 + k rows: its j-th emitted token (NO_TOKEN past the run)
        counts = np.asarray(plan.row_counts, dtype=np.int64)
        b = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        j = np.arange(len(b), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        host = np.concatenate([tail_rows, tail_ids, sampled_rows, b, j])
    else:
        host = np.concatenate([tail_rows, tail_ids, sampled_rows])
    packed = h2d(host, torch.long, device)  # one copy
    n_tail, n_sampled = len(chunk), len(sampled_rows)
    if n_tail:
        nxt[packed[:n_tail]] = packed[n_tail:2 * n_tail]
    at = 2 * n_tail
    sampled_dev = packed[at:at + n_sampled]
    if n_sampled and verified and handle.verified is not None:
        b_dev, j_dev = packed[at + n_sampled:at + 2 * n_sampled], packed[at + 2 * n_sampled:]
        nxt[sampled_dev] = handle.verified[b_dev, j_dev].clamp_min(0)
    elif n_sampled and handle.tokens is not None:
        nxt[sampled_dev] = handle.tokens[:n_sampled]
    pos = positions if positions.dim() == 1 else positions[0]  # (M-RoPE's [3, T]: the text positions)
    return TargetHiddenStates(req_ids=list(step.req_ids), first_positions=step.num_computed, query_start=query_start,
                              layout=layout, graph_key=step.graph_key, hidden=capture.rows(rows),
                              positions=pos[:rows], next_token_ids=nxt, blocks_to_copy=list(step.blocks_to_copy))
