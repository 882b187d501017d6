"""Benchmark workloads: seeded random prompt token ids and exact output lengths (EOS is ignored).

Datasets:
- ``fixed``: every request has ``input_len`` prompt tokens and ``output_len`` output tokens.
- ``uniform``: prompt lengths drawn uniformly from ``[input_len * (1 - r), input_len * (1 + r)]`` and
  output lengths from ``[output_len * (1 - r), output_len * (1 + r)]`` (integers, at least 1).
- ``shared-prefix``: ``input_len`` prompt tokens of which the first ``prefix_len`` are the same in
  every request (prefix caching can reuse them); the rest are random per request.
- ``edit``: real text, where copying is common (speculative decoding's n-gram drafter thrives on it):
  seeded Python functions of about ``input_len`` tokens, then "the same code with one name changed",
  so the model's continuation repeats the prompt. Needs the model's tokenizer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from kvforge.bench import DATASETS

#: prompt ids are drawn from [LOW_ID, vocab - LOW_ID): away from the special tokens at the ends
LOW_ID = 100


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # generated tokens, exactly: EOS is ignored

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def make_workload(dataset: str, num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                  seed: int = 0, range_ratio: float = 0.5, prefix_len: int | None = None,
                  tokenizer: Any = None) -> list[BenchRequest]:
    """``num_prompts`` requests of ``dataset``; the same arguments give the same requests.

    ``prefix_len`` (shared-prefix only) defaults to ``input_len // 2``. Raises ``ValueError`` naming
    the flag for out-of-range values.
    """
    check_workload_args(dataset, num_prompts, input_len, output_len, range_ratio, prefix_len)
    lo_id = min(LOW_ID, vocab_size // 4)
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int, length: int) -> list[list[int]]:
        return torch.randint(lo_id, vocab_size - lo_id, (n, length), generator=gen).tolist()

    if dataset == "edit":
        if tokenizer is None:
            raise ValueError("--dataset edit: needs the model's tokenizer (a model with none has only token-id datasets)")
        return [BenchRequest(edit_prompt(tokenizer, input_len, seed * 100_003 + i), output_len)
                for i in range(num_prompts)]
    if dataset == "fixed":
        # NOTE: one [n, input_len] draw, so fixed workloads match the old benchmarks/throughput.py prompts
        return [BenchRequest(p, output_len) for p in tokens(num_prompts, input_len)]
    if dataset == "uniform":
        rng = random.Random(seed)
        in_lens = [rng.randint(*length_range(input_len, range_ratio)) for _ in range(num_prompts)]
        out_lens = [rng.randint(*length_range(output_len, range_ratio)) for _ in range(num_prompts)]
        return [BenchRequest(tokens(1, i)[0], o) for i, o in zip(in_lens, out_lens)]
    prefix_len = input_len // 2 if prefix_len is None else prefix_len
    prefix = tokens(1, prefix_len)[0] if prefix_len else []
    return [BenchRequest(prefix + s, output_len) for s in tokens(num_prompts, input_len - prefix_len)]


_NAMES = ["total", "count", "value", "items", "result", "index", "offset", "limit", "buffer", "score",
          "weight", "price", "name", "width", "height", "left", "right", "node", "parent", "child"]


def edit_prompt(tokenizer: Any, input_len: int, seed: int) -> list[int]:
    """Seeded Python functions of about ``input_len`` tokens and an instruction to repeat them with one
    name changed, ending where the copy starts."""
    rng = random.Random(seed)
    functions: list[str] = []
    text = ""
    while True:
        a, b, c, d = rng.sample(_NAMES, 4)
        n, m = rng.randint(2, 99), rng.randint(2, 9)
        functions.append(f"def update_{a}_{len(functions)}({a}, {b}):\n    {c} = {a} + {b} * {m}\n"
                         f"    if {c} > {n}:\n        {d} = {c} - {a}\n    else:\n        {d} = {c} + {b}\n"
                         f"    return {d} * {m}\n\n")
        body = "".join(functions)
        old = functions[0].split("(")[1].split(",")[0]
        new = f"new_{old}"
        candidate = (f"{body}# The same code, with the variable `{old}` renamed to `{new}` and nothing else "
                     f"changed:\n\n")
        if text and len(tokenizer.encode(candidate, add_special_tokens=False)) > input_len:
            break
        text = candidate
        if len(functions) > 10_000:
            break
    return tokenizer.encode(text, add_special_tokens=False)


def check_workload_args(dataset: str, num_prompts: int, input_len: int, output_len: int,
                        range_ratio: float = 0.5, prefix_len: int | None = None) -> None:
    """``ValueError`` naming the flag for a workload that cannot be made (before any model loads)."""
    if dataset not in DATASETS:
        raise ValueError(f"--dataset: {dataset!r} is not one of {', '.join(DATASETS)}")
    for flag, value in (("--num-prompts", num_prompts), ("--input-len", input_len), ("--output-len", output_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag}: must be an integer >= 1, got {value!r}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio: must be in [0, 1), got {range_ratio}")
    if prefix_len is not None and not 0 <= prefix_len < input_len:
        raise ValueError(f"--prefix-len: must be in [0, --input-len={input_len}) so that every prompt has a "
                         f"token of its own, got {prefix_len}")


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """The inclusive integer range ``[length * (1 - ratio), length * (1 + ratio)]``, at least 1."""
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def check_fits(workload: list[BenchRequest], max_model_len: int) -> None:
    """``ValueError`` if a request's prompt + output does not fit the engine's context."""
    worst = max(workload, key=lambda r: r.input_len + r.output_len)
    if worst.input_len + worst.output_len > max_model_len:
        raise ValueError(f"--input-len/--output-len: a request needs {worst.input_len} + {worst.output_len} tokens, "
                         f"more than max_model_len={max_model_len}; lower them or raise --max-model-len")
