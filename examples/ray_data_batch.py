"""Offline batch inference with Ray Data: one kvforge ``LLM`` per replica, prompts streamed through them.

    pip install 'kvforge[ray]'
    python examples/ray_data_batch.py                       # the default model, on the GPUs (or the CPU)
    python examples/ray_data_batch.py --replicas 4 --model /path/to/hf-dir --tensor-parallel-size 2

Each replica is a Ray actor that builds ``LLM`` once and then takes batches of rows; Ray Data balances
the batches over the replicas. With ``--tensor-parallel-size N`` each replica's engine starts N ranks of
its own; on GPUs give each replica N GPUs (``num_gpus``). Shapes follow vLLM's Ray Data example
(``ds.map_batches(LLMPredictor, concurrency=N, num_gpus=1)``).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import ray

from kvforge import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Name three colours.", "Write a haiku about the sea.",
           "What is 2 + 2?", "Who wrote Hamlet?", "Explain gravity in one sentence.",
           "List three fruits.", "What do bees make?"]


class LLMPredictor:
    """A Ray Data callable class: the engine is built once per replica, then reused for every batch."""

    def __init__(self, model: str | None, max_tokens: int, engine_args: dict[str, Any]):
        self.llm = LLM(model, **engine_args)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        outputs = self.llm.generate([str(p) for p in batch["prompt"]], self.params, use_tqdm=False)
        return {"prompt": [o.prompt for o in outputs], "generated_text": [o.outputs[0].text for o in outputs],
                "num_tokens": [len(o.outputs[0].token_ids) for o in outputs]}


def run(prompts: list[str], *, model: str | None = None, replicas: int = 1, batch_size: int = 4,
        max_tokens: int = 32, gpus_per_replica: float = 0, **engine_args: Any) -> list[dict]:
    """Generate for every prompt with ``replicas`` engines; one row per prompt (Ray Data's order)."""
    ds = ray.data.from_items([{"prompt": p} for p in prompts])
    ds = ds.map_batches(LLMPredictor, concurrency=replicas, batch_size=batch_size, num_gpus=gpus_per_replica,
                        fn_constructor_kwargs={"model": model, "max_tokens": max_tokens, "engine_args": engine_args})
    return ds.take_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory, .gguf, hub id or dummy:<preset> (default model)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="each replica's KV pool in GiB (CPU default: up to 4 GiB; CUDA: overrides the profiled size)")
    args = p.parse_args()
    import torch

    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    ray.init()
    rows = run(PROMPTS, model=args.model, replicas=args.replicas, batch_size=args.batch_size,
               max_tokens=args.max_tokens, gpus_per_replica=args.tensor_parallel_size if cuda else 0,
               device=args.device, tensor_parallel_size=args.tensor_parallel_size,
               kv_cache_memory_gib=args.kv_cache_memory_gib,
               # a replica's ranks are processes inside its actor, on the GPUs Ray gave it (not more actors)
               distributed_executor_backend="mp" if args.tensor_parallel_size > 1 else None)
    for row in rows:
        print(json.dumps({"prompt": row["prompt"], "generated_text": row["generated_text"]}))


if __name__ == "__main__":
    main()
