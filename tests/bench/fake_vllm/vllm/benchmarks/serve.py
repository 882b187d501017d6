"""A stand-in for ``vllm bench serve`` (vLLM's serving client, ``vllm/benchmarks/serve.py``).

It takes the flags of vLLM's that ``kvforge bench serve --client vllm`` passes (argparse refuses any
other, so a misspelt flag fails here as it would in vLLM), sends ``--num-prompts`` streaming
``/v1/completions`` requests to ``--base-url`` at ``--request-rate`` (Poisson, seeded by ``--seed``) with
at most ``--max-concurrency`` in flight, and saves its result as vLLM does with ``--save-result``: one
JSON file in ``--result-dir``, named ``{backend}-{rate}qps[-concurrency{c}]-{model}-{date}.json``, with
vLLM's keys (``completed``, ``failed``, ``duration``, ``total_output_tokens``, ``output_throughput``,
``median_ttft_ms``, ``p99_ttft_ms``, ...; the percentiles of ``--metric-percentiles`` for each metric
of ``--percentile-metrics``). It records its arguments and the result it saved to ``$FAKE_VLLM_RECORD``.
Prompts are random token ids (vLLM's are text from the tokenizer; kvforge takes both).
``FAKE_VLLM_BENCH_FAIL=1`` makes it exit without saving a result.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime

import httpx
import numpy as np

from vllm import _record


def add_cli_args(p: argparse.ArgumentParser) -> None:
    for flag in ("--backend", "--base-url", "--model", "--tokenizer", "--dataset-name", "--percentile-metrics",
                 "--metric-percentiles", "--result-dir"):
        p.add_argument(flag, required=flag != "--result-dir")
    for flag, kind in (("--random-input-len", int), ("--random-output-len", int), ("--random-range-ratio", float),
                       ("--random-prefix-len", int), ("--num-prompts", int), ("--request-rate", float),
                       ("--max-concurrency", int), ("--seed", int), ("--temperature", float)):
        p.add_argument(flag, type=kind, default=0 if flag == "--random-prefix-len" else None)
    for flag in ("--ignore-eos", "--save-result", "--disable-tqdm"):
        p.add_argument(flag, action="store_true")


def lengths(args: argparse.Namespace, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt, output) lengths as vLLM's random dataset draws them: uniform in [L(1-r), L(1+r)], the
    prefix in front of the prompt."""
    def draw(length: int) -> int:
        return rng.randint(int(length * (1 - args.random_range_ratio)), int(length * (1 + args.random_range_ratio)))
    return [(args.random_prefix_len + draw(args.random_input_len), draw(args.random_output_len))
            for _ in range(args.num_prompts)]


async def one(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    out = {"success": False, "error": "", "chunks": [], "output_len": 0}
    start = time.perf_counter()
    async with client.stream("POST", f"{args.base_url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            out["error"] = f"HTTP {resp.status_code}"
            return out
        async for line in resp.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("choices"):
                out["chunks"].append(time.perf_counter() - start)
            if chunk.get("usage"):
                out["output_len"] = chunk["usage"]["completion_tokens"]
    out["latency"] = time.perf_counter() - start
    out["success"] = True
    return out


async def load(args: argparse.Namespace, work: list[tuple[list[int], int]], seed: int) -> tuple[list[dict], float]:
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(args.max_concurrency or len(work))
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()

        async def limited(prompt: list[int], max_tokens: int) -> dict:
            async with sem:
                return await one(client, args, prompt, max_tokens)

        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1 / args.request_rate))
        outs = await asyncio.gather(*tasks)
    return outs, time.perf_counter() - t0


def result_json(args: argparse.Namespace, work: list[tuple[list[int], int]], outs: list[dict], dur: float) -> dict:
    ok = [(o, len(p)) for o, (p, _) in zip(outs, work) if o["success"]]
    values = {"ttft": [o["chunks"][0] for o, _ in ok if o["chunks"]],
              "tpot": [(o["latency"] - o["chunks"][0]) / (o["output_len"] - 1) for o, _ in ok if o["output_len"] > 1],
              "itl": [b - a for o, _ in ok for a, b in zip(o["chunks"], o["chunks"][1:])],
              "e2el": [o["latency"] for o, _ in ok]}
    out_tokens = sum(o["output_len"] for o, _ in ok)
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend, "backend": args.backend,
              "label": None, "model_id": args.model, "tokenizer_id": args.tokenizer, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate if args.request_rate < float("inf") else "inf", "burstiness": 1.0,
              "max_concurrency": args.max_concurrency, "duration": dur, "completed": len(ok),
              "failed": len(outs) - len(ok), "total_input_tokens": sum(n for _, n in ok),
              "total_output_tokens": out_tokens, "request_throughput": len(ok) / dur, "request_goodput": None,
              "output_throughput": out_tokens / dur, "total_token_throughput": (out_tokens + sum(n for _, n in ok)) / dur,
              "max_output_tokens_per_s": 0.0, "max_concurrent_requests": args.max_concurrency or len(outs)}
    for metric in args.percentile_metrics.split(","):
        xs = np.asarray(values[metric] or [0.0]) * 1000
        result |= {f"mean_{metric}_ms": float(xs.mean()), f"median_{metric}_ms": float(np.median(xs)),
                   f"std_{metric}_ms": float(xs.std())}
        for p in args.metric_percentiles.split(","):
            result[f"p{p}_{metric}_ms"] = float(np.percentile(xs, float(p)))
    return result


def main(args: argparse.Namespace) -> None:
    _record({"call": "bench serve", "argv": sys.argv[1:],
             "tokenizer_json": os.path.exists(os.path.join(args.tokenizer, "tokenizer.json"))})
    if os.environ.get("FAKE_VLLM_BENCH_FAIL") == "1":
        print("Traceback (most recent call last): fake failure", file=sys.stderr)
        sys.exit(1)
    rng = random.Random(args.seed)
    work = [([rng.randrange(100, 1000) for _ in range(n_in)], n_out) for n_in, n_out in lengths(args, rng)]
    outs, dur = asyncio.run(load(args, work, args.seed))
    result = result_json(args, work, outs, dur)
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = f"{args.backend}-{args.request_rate}qps{concurrency}-{args.model.split('/')[-1]}-{result['date']}.json"
    if args.save_result:
        os.makedirs(args.result_dir, exist_ok=True)
        with open(os.path.join(args.result_dir, name), "w") as f:
            json.dump(result, f)
    _record({"call": "bench serve result", "result": result})
    print("============ Serving Benchmark Result ============")
    print(f"Successful requests:                     {result['completed']}")
