"""How one rank's forward meets the other ranks': pipeline stages hand their hidden states on, and the
driver's sampled tokens reach every rank.

Each stage runs its layers over the step's tokens: the first embeds them, a later one receives
(hidden, residual) from the same tensor-parallel rank of the stage before, and all but the last send
theirs on (point-to-point over the world group). Placeholder tokens (async scheduling) are the step in
flight's sampled tokens, which only the driver has on its device: it broadcasts them (docs/distributed.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvforge.attention import AttentionMetadata, BatchLayout
from kvforge.rank.input_buffers import HostInputs
from kvforge.rank.model_build import RankModel, hidden_states
from kvforge.rank.parallel_state import RankGroups

if TYPE_CHECKING:
    from kvforge.rank.cuda_graphs import CUDAGraphRunner


def stage_forward(model: RankModel, groups: RankGroups, ids: torch.Tensor, pos: torch.Tensor,
                  kv_caches: list[torch.Tensor], meta: AttentionMetadata, *, hidden_size: int,
                  dtype: torch.dtype) -> torch.Tensor | None:
    """One pipeline stage's forward. Returns the last stage's hidden states [num_tokens, hidden_size],
    None on the other stages."""
    tp, world, rank, stage = groups.tp.size, groups.world.group, groups.rank, groups.stage
    inter = None
    if not stage.is_first:
        inter = (torch.empty((len(ids), hidden_size), dtype=dtype, device=ids.device),
                 torch.empty((len(ids), hidden_size), dtype=dtype, device=ids.device))
        for t in inter:
            world.recv([t], rank - tp, 0).wait()
    out = model(ids, pos, kv_caches, meta, intermediate=inter)
    if stage.is_last:
        return hidden_states(out)
    for t in out:
        world.send([t.contiguous()], rank + tp, 0).wait()
    return None


def stage_replay(graphs: CUDAGraphRunner, groups: RankGroups, layout: BatchLayout, num_tokens: int) -> torch.Tensor | None:
    """One pipeline stage's part of a graph step: receive the previous stage's (hidden, residual) into the
    graph's static inputs, replay the stage's graph, send its (hidden, residual) on. Every row of the
    padded batch travels (both stages pad alike). Returns the last stage's first ``num_tokens`` hidden
    states, None on the other stages."""
    tp, world, rank, stage = groups.tp.size, groups.world.group, groups.rank, groups.stage
    rows = layout.num_tokens
    inputs = graphs.stage_inputs(rows)
    if inputs is not None:
        for t in inputs:
            world.recv([t], rank - tp, 0).wait()
    out = graphs.replay(layout)
    if stage.is_last:
        return hidden_states(out)[:num_tokens]
    if not isinstance(out, tuple):
        raise RuntimeError("a pipeline stage before the last captured no (hidden, residual)")
    for t in out:
        world.send([t[:rows].contiguous()], rank + tp, 0).wait()
    return None


def driver_tokens(groups: RankGroups, n: int, tokens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The step in flight's ``n`` sampled tokens on this rank: the driver's own (``tokens``), broadcast to
    the others."""
    if not groups.is_driver:
        buf = torch.empty(n, dtype=torch.long, device=device)
    elif tokens is None:
        raise RuntimeError("the step fills placeholders, but the driver got no tokens of the step in flight")
    elif groups.world.size == 1:
        return tokens
    else:
        buf = tokens.contiguous()
    groups.world.broadcast(buf, groups.driver_rank)
    return buf


def fill_placeholders(ids: torch.Tensor, buf: HostInputs, fills: int, tokens: torch.Tensor) -> None:
    """``ids[fill_dst] = tokens[fill_src]`` for the step's ``fills`` placeholders (``buf``'s pinned
    ``fill_dst`` / ``fill_src``), on the device: the token never visits the host."""
    dst = buf.tensors["fill_dst"][:fills].to(ids.device, non_blocking=True)
    src = buf.tensors["fill_src"][:fills].to(ids.device, non_blocking=True)
    ids[dst] = tokens[src]
