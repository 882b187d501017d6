"""Percentiles of per-request latencies, and the roofline that throughput is measured against.

Roofline: the fastest the hardware could run a workload, from the model's shape and two measured
ceilings, the copy ``bandwidth`` (bytes/s) and the matmul rate ``flops`` (FLOP/s). A step runs two
kinds of kernels one after the other, the matmuls (every layer's weights and the LM head) and
attention (the batch's KV cache), and each kind is held by whichever of its two ceilings it hits
first:

    step = max(weight bytes / bandwidth, matmul FLOPs / flops) + max(KV bytes / bandwidth, attention FLOPs / flops)

so a decode step is bandwidth-bound at small batches and its matmuls compute-bound at large ones
(past ``itemsize * flops / (2 * bandwidth)`` sequences: 183 in bf16 on an H200). Matmul FLOPs are ``2 * weights`` per token;
attention FLOPs ``4 * layers * q_heads * head_dim`` per (query, key) pair (QK^T and PV). A step
streams every layer's matrices and the LM head; the embedding table is only gathered.

Prefill is compute-bound: ``2 * layer weights`` FLOPs per computed prompt token, the LM head once
per prompt (only the last token's logits are needed) and causal attention. A prompt token that
another prompt of the workload already computed (a shared prefix) is not computed again: the work
is the token count of the workload's prompt trie. Decode is simulated as ideal continuous batching:
``max_num_seqs`` slots, each step every running request computes one token, a finished request's
slot is refilled at once; a request's first output token comes from its prefill. Host work is left
out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from kvforge.bench.workloads import BenchRequest

#: measured on the lent H200 (shared/gpu/README.md): device-to-device copy and bf16 8192^3 matmul
H200_BANDWIDTH = 4.25e12
H200_FLOPS = 779e12


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a step streams, and the decoder matmuls' rate against ``flops``
    (a plain ``int`` itemsize, accepted wherever a Precision is, means everything in that dtype)."""

    layer_bytes: float  # per decoder-layer weight (quantized: 1 for FP8, 0.5 plus scales for INT4)
    head_bytes: int  # per LM-head weight (always the model dtype)
    kv_bytes: int  # per KV-cache element
    matmul_speedup: float = 1.0  # FP8 tensor cores run twice the bf16 rate


def _precision(p: int | Precision) -> Precision:
    return p if isinstance(p, Precision) else Precision(p, p, p)


#: built-in methods by weight format: FP8 weights run on FP8 tensor cores (twice the bf16 rate);
#: INT4 weights keep a scale and a zero point in the model dtype per group (4 bytes per G in bf16)
_FP8_METHODS = ("fp8",)
_INT4_METHODS = ("int4", "awq", "gptq")


def engine_precision(config: Any, mc: Any, itemsize: int) -> Precision:
    """:func:`precision_for` an ``EngineConfig`` and its model's ``ModelConfig`` (model dtype ``itemsize``)."""
    checkpoint = getattr(mc, "quantization_config", None)
    method = config.quantization or (checkpoint or {}).get("quant_method")
    kv = 1 if config.kv_cache_dtype in ("fp8", "fp8_e4m3") else itemsize
    return precision_for(method, config.plugins.get(method or "", {}), checkpoint, itemsize, kv)


def precision_for(quantization: str | None, options: dict, checkpoint: dict | None, itemsize: int,
                  kv_itemsize: int) -> Precision:
    """The :class:`Precision` of an engine: its ``quantization`` method (with its ``[plugins.<name>]``
    ``options``, and the checkpoint's ``quantization_config``), the model dtype's ``itemsize`` and the
    KV cache's. A method it does not know (a plugin's) counts as the model dtype."""
    checkpoint = checkpoint or {}
    kind = quantization
    group = options.get("group_size") or checkpoint.get("group_size") or checkpoint.get("q_group_size") or 128
    if quantization == "compressed-tensors":  # FP8 when a scheme has 8-bit weights, else INT4
        weights = [g.get("weights") or {} for g in (checkpoint.get("config_groups") or {}).values()]
        kind = "fp8" if any(w.get("num_bits") == 8 for w in weights) else "int4"
        int4 = [w for w in weights if w.get("num_bits") == 4]
        if int4:
            group = -1 if int4[0].get("strategy") == "channel" else (int4[0].get("group_size") or 128)
    if kind in _FP8_METHODS:
        return Precision(1, itemsize, kv_itemsize, 2.0)
    if kind in _INT4_METHODS:
        group = group if group > 0 else 4096  # one group per channel: scales negligible
        return Precision(0.5 + 2 * itemsize / group, itemsize, kv_itemsize)
    return Precision(itemsize, itemsize, kv_itemsize)


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


# -- the model's shape ----------------------------------------------------------------------------------
def mlp_shape(mc: Any) -> tuple[int, int, int, int]:
    """(experts, experts per token, intermediate size per expert, shared-expert intermediate size) of a
    layer's MLP: (1, 1, intermediate_size, 0) for a dense model."""
    hf = getattr(mc, "hf_config", None) or {}
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if not experts:
        return 1, 1, mc.intermediate_size, 0
    return (experts, hf["num_experts_per_tok"], hf.get("moe_intermediate_size") or mc.intermediate_size,
            hf.get("shared_expert_intermediate_size") or 0)


def _attn_params(mc: Any) -> int:
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    return mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size


def experts_touched(mc: Any, tokens: float | None) -> float:
    """Experts a step of ``tokens`` tokens reads per layer, expected under uniform routing (random
    weights route about uniformly): E * (1 - (1 - k/E)^tokens); all of them when ``tokens`` is None."""
    experts, k, _, _ = mlp_shape(mc)
    if tokens is None or experts == 1:
        return float(experts)
    return experts * (1 - (1 - k / experts) ** tokens)


def layer_params(mc: Any, experts: float | None = None) -> float:
    """Matmul weights of every decoder layer of a ``ModelConfig`` (norms and routers left out); of an
    MoE layer, ``experts`` of its experts (default: all it stores)."""
    n, k, inter, shared = mlp_shape(mc)
    per_expert = 3 * mc.hidden_size * inter
    mlp = (n if experts is None else experts) * per_expert + 3 * mc.hidden_size * shared
    return mc.num_hidden_layers * (_attn_params(mc) + mlp)


def active_layer_params(mc: Any) -> float:
    """The layer weights one token multiplies with (its k experts of each MoE layer): its FLOPs / 2."""
    _, k, _, _ = mlp_shape(mc)
    return layer_params(mc, experts=k)


def lm_head_params(mc: Any) -> int:
    return mc.vocab_size * mc.hidden_size


def param_count(mc: Any) -> float:
    """Every weight the model stores: the layers, the embedding table and, if untied, the LM head."""
    return layer_params(mc) + lm_head_params(mc) * (1 if mc.tie_word_embeddings else 2)


def step_weight_bytes(mc: Any, itemsize: int | Precision, tokens: float | None = None) -> float:
    """Bytes of weights one forward step of ``tokens`` tokens streams: the layers' matrices (an MoE
    layer's experts that its tokens use, :func:`experts_touched`; None: all) and the LM head."""
    p = _precision(itemsize)
    return layer_params(mc, experts_touched(mc, tokens)) * p.layer_bytes + lm_head_params(mc) * p.head_bytes


def kv_bytes_per_token(mc: Any, itemsize: int | Precision) -> int:
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * _precision(itemsize).kv_bytes


def matmul_seconds(mc: Any, itemsize: int | Precision, tokens: float, head_tokens: float, flops: float) -> float:
    """Seconds of matmul FLOPs: ``tokens`` through every layer, ``head_tokens`` through the LM head."""
    p = _precision(itemsize)
    return 2 * (active_layer_params(mc) * tokens / p.matmul_speedup + lm_head_params(mc) * head_tokens) / flops


def attention_flops(mc: Any, pairs: float) -> float:
    """FLOPs of attention over ``pairs`` (query, key) pairs, every layer and head: QK^T and PV."""
    return 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * pairs


# -- one step ------------------------------------------------------------------------------------------
def decode_step_floor_s(mc: Any, itemsize: int | Precision, batch: int, context_sum: float, bandwidth: float,
                        flops: float) -> float:
    """Seconds a decode step of ``batch`` sequences needs at least, whose contexts (keys each new token
    attends to, itself included) add up to ``context_sum``: the matmuls, then attention, each at
    the slower of its two ceilings."""
    matmuls = max(step_weight_bytes(mc, itemsize, batch) / bandwidth, matmul_seconds(mc, itemsize, batch, batch, flops))
    attention = max(context_sum * kv_bytes_per_token(mc, itemsize) / bandwidth,
                    attention_flops(mc, context_sum) / flops)
    return matmuls + attention


def prefill_floor_s(mc: Any, tokens: int, pairs: float, prompts: int, flops: float,
                    itemsize: int | Precision = 2) -> float:
    """Seconds computing ``tokens`` prompt tokens of ``prompts`` prompts needs at least, their causal
    attention covering ``pairs`` (query, key) pairs: compute-bound."""
    return matmul_seconds(mc, itemsize, tokens, prompts, flops) + attention_flops(mc, pairs) / flops


# -- a whole workload ----------------------------------------------------------------------------------
def prefill_work(workload: list[BenchRequest]) -> tuple[int, int]:
    """``(tokens, pairs)`` the workload's prompts need computed: a token that an earlier prompt (in
    sorted order: the prompt trie) already computed is skipped, but every prompt computes at least
    its last token (its logits). Token at position p attends to p + 1 keys."""
    tokens = pairs = 0
    prev: np.ndarray = np.zeros(0, dtype=np.int64)
    for prompt in sorted(r.prompt_token_ids for r in workload):
        cur = np.asarray(prompt, dtype=np.int64)
        n = min(len(prev), len(cur))
        diff = np.flatnonzero(prev[:n] != cur[:n])
        shared = min(int(diff[0]) if len(diff) else n, len(cur) - 1)
        tokens += len(cur) - shared
        pairs += (len(cur) * (len(cur) + 1) - shared * (shared + 1)) // 2
        prev = cur
    return tokens, pairs


def decode_steps(workload: list[BenchRequest], max_num_seqs: int) -> list[tuple[int, int]]:
    """``(batch, context_sum)`` of every decode step of ideal continuous batching in workload order:
    request i's decode step j (1 .. output_len - 1) computes the token at position input_len + j - 1."""
    slots = max(1, max_num_seqs)
    waiting = iter(workload)
    running: list[list[int]] = []  # [context of the next step, steps left]
    steps = []
    while True:
        while len(running) < slots:
            r = next(waiting, None)
            if r is None:
                break
            if r.output_len > 1:
                running.append([r.input_len + 1, r.output_len - 1])
        if not running:
            return steps
        steps.append((len(running), sum(c for c, _ in running)))
        for s in running:
            s[0] += 1
            s[1] -= 1
        running = [s for s in running if s[1]]


@dataclass(frozen=True)
class Roofline:
    """The floor of a workload: seconds of prefill and decode, and how many decode steps there are
    and how many of them have compute-bound matmuls."""

    prefill_s: float
    decode_s: float
    decode_steps: int
    compute_bound_steps: int
    output_tokens: int

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "output_tok_s": self.tok_s, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "decode_steps": self.decode_steps,
                "compute_bound_steps": self.compute_bound_steps}


def roofline(mc: Any, workload: list[BenchRequest], max_num_seqs: int, itemsize: int | Precision,
             bandwidth: float, flops: float) -> Roofline:
    """The workload's floor (module docstring): prefill of its prompt trie, then ideal continuous
    batching of its decode steps in slots of ``max_num_seqs``."""
    tokens, pairs = prefill_work(workload)
    steps = decode_steps(workload, max_num_seqs)
    knee = step_weight_bytes(mc, itemsize) / bandwidth / matmul_seconds(mc, itemsize, 1, 1, flops)
    return Roofline(prefill_s=prefill_floor_s(mc, tokens, pairs, len(workload), flops, itemsize),
                    decode_s=sum(decode_step_floor_s(mc, itemsize, b, c, bandwidth, flops) for b, c in steps),
                    decode_steps=len(steps), compute_bound_steps=sum(b > knee for b, _ in steps),
                    output_tokens=sum(r.output_len for r in workload))


def roofline_tok_s(mc: Any, workload: list[BenchRequest], max_num_seqs: int, itemsize: int | Precision,
                   bandwidth: float, flops: float) -> float:
    """Output tokens/s at the roofline (see :func:`roofline`)."""
    return roofline(mc, workload, max_num_seqs, itemsize, bandwidth, flops).tok_s
