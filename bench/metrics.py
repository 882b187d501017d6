"""Percentiles of per-request latencies, and the roofline that throughput is measured against.

Roofline (an estimate of the fastest the hardware could run a workload, from the model's shape):
- a decode step streams every weight once plus the live KV cache of the running batch, at the
  measured copy ``bandwidth`` (bytes/s);
- prefill costs ``2 * params`` FLOPs per prompt token, at the measured matmul rate ``flops`` (FLOP/s).
Attention FLOPs, prefix-cache hits and host overhead are left out. Weights count the embedding table
and, if untied, the LM head (the formula of the original benchmarks/throughput.py).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

from kvforge.bench.workloads import BenchRequest

#: measured on the lent H200 (shared/gpu/README.md): device-to-device copy and bf16 8192^3 matmul
H200_BANDWIDTH = 4.25e12
H200_FLOPS = 779e12


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as ``numpy.percentile``; NaN if empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float] | None:
    """``{"mean", "p50", "p99", "n"}`` of ``values * scale`` (e.g. 1e3 for ms); None if empty."""
    xs = [v * scale for v in values]
    if not xs:
        return None
    return {"mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}


def param_count(mc: Any) -> int:
    """Weights of a Llama-family ``ModelConfig`` (norms and biases left out)."""
    h, inter, layers = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    return layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)


def kv_bytes_per_token(mc: Any, itemsize: int) -> int:
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize


def decode_step_floor_s(mc: Any, itemsize: int, batch: int, avg_context: float, bandwidth: float) -> float:
    """Seconds one decode step needs at least: weights + ``batch * avg_context`` tokens of KV at ``bandwidth``."""
    return (param_count(mc) * itemsize + batch * avg_context * kv_bytes_per_token(mc, itemsize)) / bandwidth


def roofline_seconds(mc: Any, workload: list[BenchRequest], max_num_seqs: int, itemsize: int,
                     bandwidth: float, flops: float) -> float:
    """Seconds the workload needs at least, if requests run in waves of ``max_num_seqs``.

    Each wave takes as many decode steps as its longest output; every step streams the weights, and
    over a request's life its KV reads add up to ``output_len * (input_len + output_len / 2)`` tokens
    (its average context per step).
    For equal lengths this is the original ``roofline_tok_s`` of benchmarks/throughput.py.
    """
    params = param_count(mc)
    batch = max(1, min(max_num_seqs, len(workload)))
    steps = sum(max(r.output_len for r in workload[i:i + batch]) for i in range(0, len(workload), batch))
    kv_tokens = sum(r.output_len * (r.input_len + r.output_len / 2) for r in workload)
    decode_s = (steps * params * itemsize + kv_tokens * kv_bytes_per_token(mc, itemsize)) / bandwidth
    prefill_s = 2 * params * sum(r.input_len for r in workload) / flops
    return decode_s + prefill_s


def roofline_tok_s(mc: Any, workload: list[BenchRequest], max_num_seqs: int, itemsize: int,
                   bandwidth: float, flops: float) -> float:
    """Output tokens/s at the roofline (see :func:`roofline_seconds`)."""
    out = sum(r.output_len for r in workload)
    return out / roofline_seconds(mc, workload, max_num_seqs, itemsize, bandwidth, flops)


def resolve_ceilings(bandwidth: float | None, flops: float | None,
                     device_type: str) -> tuple[float | None, float | None]:
    """The (bandwidth, flops) to use: given values win; on CUDA the H200's measured ceilings fill in
    what is missing; on CPU only explicitly given values count (else None: no roofline)."""
    if device_type == "cuda":
        return bandwidth or H200_BANDWIDTH, flops or H200_FLOPS
    return bandwidth, flops
