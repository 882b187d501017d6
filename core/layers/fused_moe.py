"""The experts of a mixture-of-experts layer: a torch reference (the CPU path) and a fused Triton path (CUDA).

``out[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ x[t] + w13_bias[e]) + w2_bias[e])`` with
``e = topk_ids[t, j]``. The reference does what transformers' Mixtral, Qwen3-MoE and gpt-oss experts do,
operation for operation: a loop over the experts that received tokens, in expert order, each gathering
its tokens, scaling its output by the routing weight and ``index_add_``-ing it, rounded to the model
dtype, into an accumulator of the model dtype. kvforge's CPU models run it and are compared token for
token with transformers.

The Triton path (its kernels and launchers: ``kvforge.kernels.moe``), for CUDA (and the CPU under
``TRITON_INTERPRET=1``, as the tests run it):

1. :func:`align_pairs` sorts the ``T * k`` (token, slot) pairs by expert and pads each expert's group
   to a multiple of BLOCK_M, so that each BLOCK_M block of the sorted order belongs to one expert:
   one Triton program at decode sizes (torch's sort and friends are ~25 launches, as long as the
   GEMMs at T = 1), torch ops beyond.
2. The gate/up kernel: a program takes one block and BLOCK_N columns of both the gate and the up
   projection (two accumulators over the same x tile), gathers the block's token rows of x and
   applies the activation in its epilogue, writing ``act`` [padded pairs, I] in sorted order.
   NOTE: fusing the activation here, rather than writing ``[pairs, 2I]`` and running an
   activation kernel as vLLM does, saves a launch and the round trip of the gate/up product through
   HBM; the price is a second accumulator (the registers of a 2 * BLOCK_N wide tile).
3. The down kernel: ``act @ w2[e]^T`` (+ bias) times the routing weight, each row written to its
   pair's row of ``[T * k, H]``.
4. A torch sum over the k slots of that ``[T, k, H]`` view.

Both GEMMs accumulate in fp32 on the tensor cores (``tl.dot``; exact fp32 products for float32
inputs) and round where the reference rounds (the projections, the activation, the expert output).

NOTE (CUDA graphs): nothing here synchronises with the host. The sorted buffers have the size of the
worst case, ``T * k + min(E, T * k) * (BLOCK_M - 1)`` rows, which depends on shapes only; the real
number of padded rows stays on the device (``ExpertBlocks.num_padded``), and the programs of blocks
past it return at once. Tile sizes depend on shapes only too, so a captured graph replays for any
routing.

NOTE (H100, bf16, in CUDA graphs, ``benchmarks/fused_moe.py``): Qwen3-30B-A3B's experts (E 128, k 8,
H 2048, I 768) take 40 us at T = 1 (56% of the HBM roofline of the experts touched), 432 us at
T = 64 (83%) and 952 us at T = 4096 (325 TFLOP/s); gpt-oss-20b's (E 32, k 4, H 2880, I 2880) 84 us
at T = 1 (71%), 564 us at T = 64 (84%) and 1.9 ms at T = 4096 (429 TFLOP/s).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.kernels import runs_on

#: activation name -> the code the gate/up kernel's ACTIVATION constexpr takes
ACTIVATIONS = {"silu": 0, "swigluoai": 1}


# ---- the torch reference ----------------------------------------------------------------------------

def _activate(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":  # Mixtral, Qwen-MoE: ACT2FN["silu"](gate) * up
        return F.silu(gate) * up
    # gpt-oss (GptOssExperts._apply_gate)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None, swiglu_alpha: float = 1.702,
                      swiglu_limit: float = 7.0) -> torch.Tensor:
    """The torch reference of :func:`fused_experts` (same arguments), as transformers computes it."""
    _check_args(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    # NOTE: pairs ordered as transformers' torch.where(expert_mask[e]) lists them (slot-major, then
    # token), so each expert's GEMM sees its rows in the same order
    slot_major = topk_ids.t().reshape(-1)
    order = torch.argsort(slot_major, stable=True)
    counts = torch.bincount(slot_major, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        slots, tokens = pairs // num_tokens, pairs % num_tokens
        gate_up = F.linear(x[tokens], w13[expert])
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert]
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(_activate(gate, up, activation, swiglu_alpha, swiglu_limit), w2[expert])
        if w2_bias is not None:
            y = y + w2_bias[expert]
        y = y * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _check_args(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_experts expects x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got x "
                         f"{tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    experts, two_inter, hidden = w13.shape
    if hidden != x.shape[1] or two_inter % 2 or tuple(w2.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"fused_experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"[E, 2I, H] and [E, H, I] with H = {x.shape[1]} (x {tuple(x.shape)})")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_experts: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T, k] with T = {x.shape[0]}")
    for name, bias, shape in (("w13_bias", w13_bias, (experts, two_inter)), ("w2_bias", w2_bias, (experts, hidden))):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"fused_experts: {name} has shape {tuple(bias.shape)}, expected {shape}")


# ---- dispatch ---------------------------------------------------------------------------------------

def use_triton(x: torch.Tensor) -> bool:
    """Whether :func:`fused_experts` runs the Triton kernels for ``x``: on CUDA, or on the CPU under
    TRITON_INTERPRET=1, wherever triton imports."""
    return runs_on(x)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0) -> torch.Tensor:
    """The routed experts' outputs summed per token, [T, H] in ``x.dtype``.

    x: [T, H]; w13: [E, 2I, H], each expert's gate rows (0..I-1) then its up rows; w2: [E, H, I];
    topk_weights: [T, k] float32; topk_ids: [T, k] int32/int64, values in 0..E-1; w13_bias [E, 2I],
    w2_bias [E, H] optional. ``activation``: "silu" (``silu(gate) * up``) or "swigluoai" (gpt-oss:
    gate and up clamped to ``swiglu_limit``, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``).
    The Triton kernels where :func:`use_triton`, else :func:`fused_experts_ref`.
    """
    if not use_triton(x):
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, activation=activation, w13_bias=w13_bias,
                                 w2_bias=w2_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    _check_args(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    return _fused_experts_triton(x, w13, w2, topk_weights, topk_ids, activation=activation, w13_bias=w13_bias,
                                 w2_bias=w2_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


# ---- alignment: pairs sorted by expert, in blocks of one expert ------------------------------------

@dataclass(frozen=True)
class ExpertBlocks:
    """The ``T * k`` (token, slot) pairs sorted by expert, each expert's group padded to whole blocks
    of ``block_m`` rows. A pair is ``t * k + j`` (its index in the flattened topk_ids)."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: a pair, or T * k for a padding row
    block_expert: torch.Tensor  # [num_blocks] int32: each block's expert (E for blocks past num_padded)
    num_padded: torch.Tensor  # [1] int32: rows in use, a multiple of block_m (the rest is the worst case's)
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


#: up to this many pairs, :func:`align_pairs` is one Triton program (a stable order); beyond, three
#: kernels over chunks of pairs (``kvforge.kernels.moe.align_pairs_parallel``); torch's sort and ~25 small kernels
#: only off the GPU. Measured in CUDA graphs (benchmarks/fused_moe.py): torch's ops take 36-78 us at
#: any size; the one program 4-6 us up to 64 pairs but 40 us at 1024 with E = 128, so past 128 pairs
#: the parallel kernels take over: on the H200 they cut Qwen3-30B-A3B's whole call at 256 tokens
#: (2,048 pairs) from 371 to 312 us, and its W1 from 6,725 to 7,392 tok/s.
ALIGN_KERNEL_MAX_PAIRS = 128


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                use_kernel: bool | None = None) -> ExpertBlocks:
    """Sort the pairs of ``topk_ids`` [T, k] by expert into blocks of ``block_m`` (device-side work
    only: no host synchronisation, so it can be captured in a CUDA graph). ``use_kernel``: the Triton
    program or torch ops (the same result); None chooses by the pair count where triton runs."""
    num_pairs = topk_ids.numel()
    # each expert that has pairs wastes at most block_m - 1 rows, and at most min(E, pairs) have any
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-worst // block_m)
    if use_kernel is None:
        use_kernel = num_pairs > 0 and use_triton(topk_ids)
    if use_kernel:
        from kvforge.kernels import moe

        align = moe.align_pairs if num_pairs <= ALIGN_KERNEL_MAX_PAIRS else moe.align_pairs_parallel
        return ExpertBlocks(*align(topk_ids, num_experts, block_m, num_blocks), block_m)
    device = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32)
    sorted_ids, order = torch.sort(ids, stable=True)
    # first[e]: where expert e's pairs start in the sorted order (first[E] = num_pairs)
    first = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, dtype=torch.int32, device=device),
                               out_int32=True)
    padded = (first[1:] - first[:-1] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0, dtype=torch.int32)
    expert_of = sorted_ids.long()
    rank = torch.arange(num_pairs, dtype=torch.int32, device=device) - first[expert_of]
    dest = ((padded_end - padded)[expert_of] + rank).long()
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, dtype=torch.int32, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True, out_int32=True)
    return ExpertBlocks(sorted_pairs, block_expert, padded_end[-1:], block_m)


# ---- tile sizes -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoeTiles:
    """One launch's tiles: ``block_m`` sorted pairs; ``block_n_up`` columns of each of gate and up
    (the gate/up kernel), ``block_n_down`` of H (the down kernel); K stepped by ``block_k``;
    ``group_m`` blocks of M share a sweep over N (L2 reuse of the x rows and the weight tiles)."""

    block_m: int
    block_n_up: int
    block_n_down: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


#: largest average number of pairs per expert (T * k / E) -> tiles. BLOCK_M follows the pairs an
#: expert gets rather than T: Qwen3-30B-A3B (E = 128, k = 8) at T = 64 gives an expert 4 tokens, so a
#: 64-row block would be 94% padding. At decode the weights are the bytes that matter: small N tiles
#: put more programs on the SMs to stream them. ``benchmarks/fused_moe.py --sweep`` on the H100 (6-8
#: candidates a bucket, both shapes): every candidate came within 4% of these, i.e. the tiles are not
#: what bounds the kernels (decode streams the weights at 2.2-2.7 TB/s).
MOE_TILES: dict[int, MoeTiles] = {
    8: MoeTiles(block_m=16, block_n_up=32, block_n_down=64, block_k=128, group_m=1, num_warps=4, num_stages=4),
    24: MoeTiles(block_m=32, block_n_up=64, block_n_down=128, block_k=128, group_m=1, num_warps=4, num_stages=3),
    48: MoeTiles(block_m=64, block_n_up=64, block_n_down=128, block_k=64, group_m=8, num_warps=4, num_stages=3),
    1 << 30: MoeTiles(block_m=128, block_n_up=64, block_n_down=128, block_k=64, group_m=8, num_warps=8,
                      num_stages=3),
}


def pick_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """The tiles for ``num_pairs`` pairs spread over ``num_experts`` experts (shapes only: graph-safe)."""
    average = num_pairs / num_experts
    return next(tiles for bound, tiles in MOE_TILES.items() if average <= bound)


# ---- the Triton path --------------------------------------------------------------------------------

def route(router_logits: torch.Tensor, top_k: int, softmax_first: bool, renormalize: bool,
          round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kvforge.layers.moe.select_experts in one Triton kernel (a program per token): (weights [T, k]
    float32, ids [T, k] int64). torch's softmax, top-k, division and casts are 5-8 launches, a few
    percent of an MoE decode step."""
    from kvforge.kernels import moe

    return moe.route(router_logits, top_k, softmax_first, renormalize, round_weights)


def _fused_experts_triton(x, w13, w2, topk_weights, topk_ids, *, activation, w13_bias, w2_bias, swiglu_alpha,
                          swiglu_limit) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_experts: the weights' dtypes (w13 {w13.dtype}, w2 {w2.dtype}) must be x's ({x.dtype})")
    tiles = pick_tiles(num_pairs, num_experts)
    blocks = align_pairs(topk_ids, num_experts, tiles.block_m)
    # per_pair: [T * k, H], row t * k + j = topk_weights[t, j] * expert topk_ids[t, j]'s output for t
    from kvforge.kernels import moe

    per_pair = moe.experts(x, w13, w2, topk_weights, blocks, tiles, activation=ACTIVATIONS[activation],
                           w13_bias=w13_bias, w2_bias=w2_bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    if top_k == 1:
        return per_pair
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)  # fp32 accumulation, one rounding
