"""What the quantized GEMMs of ``int4`` and ``fp8`` share: their block-size configs and the M buckets that
pick one, the split-K choice, the tile code of a split-K GEMM program, and the kernel that sums split-K
partials.

No autotuning at run time: ``triton.autotune`` times candidate kernels on first use, which breaks
CUDA-graph capture and costs seconds per new shape. Each GEMM instead has a small table from M bucket
to :class:`GemmConfig`, set from ``benchmarks/quant_kernels.py --sweep`` on the GPU.

Split-K: at decode sizes (M <= 64) one tile of M covers the whole batch, so the grid has only
N / BLOCK_N programs (32 for N = 4096, BLOCK_N = 128) on a GPU of 132 SMs: most SMs would idle while
the weights stream. Splitting K gives each (M, N) tile several programs, each writing an fp32 partial
product to ``[split, M, N]``; one small kernel sums them and casts to the output dtype. Summing in a
kernel rather than with fp32 atomics keeps results deterministic (a CUDA graph replays bit-identically
to eager) and needs no zero-fill. Everything here is asynchronous (no host synchronisation), so it
can be captured in a CUDA graph.

The GEMMs do not specialise on M (Triton would compile apart for M == 1 and M % 16 == 0; M only
masks rows), so one compilation serves every batch size of a bucket. Addresses along M (and along K of
a dequantized weight) are int64: an 8192-token prefill through a 28672-wide layer has 2**28 outputs,
and a larger batch would overflow int32 offsets.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvforge.kernels import launcher

#: a split shorter than this (8 iterations at BLOCK_K = 64, 4 at 128) hardly fills a 4-stage
#: pipeline; at M = 1 the measured best split never went below it (benchmarks/quant_kernels.py --sweep)
MIN_K_PER_SPLIT = 512
#: the most splits tried: the best measured for down (K = 14336, int4) at M = 1
MAX_SPLIT_K = 16
#: SMs assumed under TRITON_INTERPRET=1 (an H100/H200 has 132), so the CPU takes the GPU's decisions
INTERPRETER_NUM_SMS = 132


@dataclass(frozen=True)
class GemmConfig:
    """Block sizes of one GEMM launch: a tile of ``block_m x block_n`` outputs, K stepped by
    ``block_k``; ``split_k`` 0 lets :func:`choose_split_k` decide from the shape and the GPU."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16 (tl.dot's minimum), got {value}")
        if self.split_k < 0:
            raise ValueError(f"GemmConfig.split_k must be >= 0 (0: chosen from the shape), got {self.split_k}")


def pick_config(table: dict[int, GemmConfig], m: int) -> GemmConfig:
    """The config of the smallest bucket holding ``m`` (keys are the buckets' largest M, ascending)."""
    for max_m, config in table.items():
        if m <= max_m:
            return config
    return table[max(table)]


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (read once per device: no synchronisation)."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_split_k(tiles: int, k: int, sms: int, programs_per_sm: int) -> int:
    """How many ways to split K for a grid of ``tiles`` output tiles: doubling until there are
    ``programs_per_sm`` programs per SM (each GEMM's own, measured), while each split keeps at least
    MIN_K_PER_SPLIT of K.

    NOTE: the fp32 partials ([split, M, N], written then summed) cost less than their size suggests
    (they mostly stay in L2): capping the split so that they move fewer bytes than the weights made
    M = 64 and 128 slower on three of the four Llama-3-8B layers (H100), so M counts only through
    the tile count."""
    split = 1
    while (tiles * split < programs_per_sm * sms and k // (2 * split) >= MIN_K_PER_SPLIT
           and split < MAX_SPLIT_K):
        split *= 2
    return split


def k_per_split(k: int, split: int, block_k: int) -> tuple[int, int]:
    """(K per split, rounded up to whole blocks; the number of non-empty splits that gives)."""
    per = -(-k // split)
    per = -(-per // block_k) * block_k
    return per, -(-k // per)


# ---- the tile code of a split-K program -------------------------------------------------------------------

@triton.jit
def split_tile(M, N, K, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile and K range. Grid: (M tiles, N tiles, K splits), M fastest, so the
    programs that run together share a weight tile; each split covers ``k_split`` of K. Returns
    (offs_m, offs_n, m_mask, n_mask, k_start, k_end)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_split
    return offs_m, offs_n, offs_m < M, offs_n < N, k_start, tl.minimum(k_start + k_split, K)


@triton.jit
def store_split_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_om, stride_on, stride_os):
    """``acc`` to this program's tile of ``out[split]`` (``stride_os`` 0 without a split), in out's dtype."""
    out = (out_ptr + tl.program_id(2).to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
           + offs_n[None, :] * stride_on)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def sum_splits_kernel(part_ptr, out_ptr, numel, num_splits, BLOCK: tl.constexpr):
    """out[M, N] = part[split, M, N].sum(0) in out's dtype; both contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    part = part_ptr + offs
    for _ in range(num_splits):
        acc += tl.load(part, mask=mask, other=0.0)
        part += numel
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launching ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SplitK:
    """One GEMM launch split along K: its grid, the K each split covers, and where the kernel writes
    (``out`` itself, or float32 partials ``[split, M, N]`` that :meth:`finish` sums into ``out``)."""

    grid: tuple[int, int, int]
    k_split: int
    dest: torch.Tensor
    out: torch.Tensor

    @classmethod
    def plan(cls, out: torch.Tensor, k: int, cfg: GemmConfig, block_k: int, programs_per_sm: int) -> SplitK:
        m, n = out.shape
        grid_mn = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
        split = cfg.split_k or choose_split_k(grid_mn[0] * grid_mn[1], k, num_sms(out.device), programs_per_sm)
        k_split, split = k_per_split(k, split, block_k)
        dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=out.device)
        return cls((*grid_mn, split), k_split, dest, out)

    @property
    def dest_strides(self) -> tuple[int, int, int]:
        """(row, column, split) strides of ``dest`` as the kernels take them."""
        split = self.grid[2] > 1
        return self.dest.stride(-2), self.dest.stride(-1), self.dest.stride(0) if split else 0

    def finish(self) -> torch.Tensor:
        return self.out if self.dest is self.out else sum_splits(self.dest, self.out)


def sum_splits(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[M, N] = partials[split, M, N].sum(0)`` in ``out``'s dtype (both contiguous)."""
    block = 1024
    launcher(sum_splits_kernel, (triton.cdiv(out.numel(), block),))(partials, out, out.numel(), partials.shape[0],
                                                          BLOCK=block, num_warps=4)
    return out
