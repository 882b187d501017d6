"""How many KV blocks a rank can hold: the sizing rules, and the profiled forward they may need.

The rules, first that applies (docs/architecture.md, "KV-cache sizing"): an explicit block count; a
KV cache memory budget; on the CPU, every sequence at full length (capped at 4 GiB); on CUDA, what one
profiled peak forward of a full token budget leaves of ``gpu_memory_utilization`` of the device
(``kvforge.rank.memory_budget`` measures it against the memory in use before the engine started). The
engine takes the minimum over its ranks, since every rank holds every block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from kvforge.attention import AttentionBackend
from kvforge.rank.batch_layout import prefill_layout
from kvforge.rank.memory_budget import MemoryBaseline, kv_cache_budget
from kvforge.rank.model_build import RankModel, hidden_states
from kvforge.rank.parallel_state import PPStage
from kvforge.rank.step_handle import logprob_tensors

GiB = 1 << 30


def bytes_per_block(attn: AttentionBackend, num_layers: int) -> int:
    """Bytes of one KV block over ``num_layers`` layers: ``prod(kv_cache_shape(1)) * itemsize * layers``
    (``itemsize`` of the KV cache's element type: 1 for FP8)."""
    return math.prod(attn.kv_cache_shape(1)) * attn.kv_cache_dtype.itemsize * num_layers


@dataclass(frozen=True)
class KVCacheRequest:
    """What the engine asks a rank to size its KV cache for (``Worker.determine_num_blocks``'s arguments)."""

    num_blocks_override: int | None
    kv_cache_memory_gib: float | None
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


def num_kv_blocks(want: KVCacheRequest, per_block: int, block_size: int, device: torch.device,
                  baseline: MemoryBaseline | None, profile_peak: Callable[[], int], rank: int) -> int:
    """KV blocks of ``per_block`` bytes this rank can hold, by the first rule that applies.
    ``profile_peak()`` (called only on CUDA, without an override or a budget) gives the peak bytes of a
    profiled forward; ``baseline`` is the device's memory before the engine (None off CUDA)."""
    if want.num_blocks_override is not None:
        return want.num_blocks_override
    if want.kv_cache_memory_gib is not None:
        return max(1, int(want.kv_cache_memory_gib * GiB) // per_block)
    if device.type != "cuda" or baseline is None:
        # CPU default: enough for every sequence at full length, capped at 4 GiB.
        blocks = want.max_num_seqs * -(-want.max_model_len // block_size)
        return max(1, min(blocks, (4 * GiB) // per_block))
    peak = profile_peak()
    budget = kv_cache_budget(device, baseline, peak, want.gpu_memory_utilization, rank)
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        own = (peak - baseline.allocated) / GiB
        raise ValueError(
            f"gpu_memory_utilization={want.gpu_memory_utilization} leaves no memory for the KV cache on rank "
            f"{rank} (this engine's model and peak activations take {own:.2f} GiB; "
            f"{torch.cuda.mem_get_info(device)[0] / GiB:.2f} GiB of the device is free)")
    return num_blocks


@dataclass(frozen=True)
class ProfiledRank:
    """The parts of a rank a profiled forward runs: its model, backend and stage's layers."""

    model: RankModel
    attn: AttentionBackend
    stage: PPStage
    first_layer: int
    num_layers: int  # the stage's layers: its KV cache holds only theirs
    hidden_size: int
    dtype: torch.dtype
    device: torch.device


@torch.inference_mode()
def profile_peak_memory(rank: ProfiledRank, max_num_batched_tokens: int, max_model_len: int, logits_rows: int,
                        encode: Callable[[], Any] | None = None, extra_bytes: int = 0) -> int:
    """Peak bytes the process allocated during one forward of a full token budget (as prefills of
    ``max_model_len`` at most) plus, on the last stage, sampling of ``logits_rows`` rows, the profile's
    own KV cache excluded (other engines' tensors in this process included: ``kvforge.rank.memory_budget``
    subtracts them). ``encode()``: a multimodal model's encoder work of one step, run first and its result
    held through the forward (``kvforge.multimodal.profile``); ``extra_bytes`` are added (the encoder
    cache's rows beyond those)."""
    device, bs = rank.device, rank.attn.block_size
    seq_len = min(max_num_batched_tokens, max_model_len)
    num_seqs = -(-max_num_batched_tokens // seq_len)
    blocks_per_seq = -(-seq_len // bs)
    caches = rank.attn.allocate_kv_cache(num_seqs * blocks_per_seq, rank.num_layers, rank.first_layer)
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    lens = [seq_len] * (num_seqs - 1) + [max_num_batched_tokens - seq_len * (num_seqs - 1)]
    layout = prefill_layout(lens, blocks_per_seq, bs)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    encoded = encode() if encode is not None else None  # (held: a step's images stay cached while it runs)
    meta = rank.attn.build_metadata(layout)
    n = layout.num_tokens
    ids = torch.zeros(n, dtype=torch.long, device=device)
    pos = torch.from_numpy(np.concatenate([np.arange(x) for x in lens])).to(device)
    inter = None
    if not rank.stage.is_first:  # a stage's input is the stage before's (hidden, residual)
        inter = (torch.zeros((n, rank.hidden_size), dtype=rank.dtype, device=device),
                 torch.zeros((n, rank.hidden_size), dtype=rank.dtype, device=device))
    out = rank.model(ids, pos, caches, meta, **({"intermediate": inter} if inter else {}))
    if rank.stage.is_last:
        rows = min(logits_rows, n)  # sampling, or a prompt-logprobs slice
        logits = rank.model.compute_logits(hidden_states(out)[:rows]).float()
        torch.softmax(logits, dim=-1).sort(dim=-1)
        logprob_tensors(logits, torch.zeros(rows, dtype=torch.long, device=device), 20)
        del logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes + extra_bytes
    del caches, out, meta, encoded
    torch.cuda.empty_cache()
    return peak
