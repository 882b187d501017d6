"""``--client vllm``: the load sent by vLLM's own client, ``vllm bench serve``, as a subprocess.

kvforge's client (bench/serve.py) is ours, so a second opinion comes from a client nobody here wrote:
``vllm bench serve`` in vLLM's interpreter (``--vllm-python``, ``--vllm-path``), pointed at the server
under test with ``--base-url``. It draws its own ``random`` dataset (text of the same prompt and output
lengths, seeded by the run's seed, so both engines get the same requests from it), runs one load, and
saves its result as JSON (``--save-result --result-dir``, a fresh directory per run), which
:func:`row_from_result` reads into the columns kvforge's client fills. Its random prompts are text, so
it needs the model's tokenizer: kvforge's is saved for it (:func:`tokenizer_dir`).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from typing import Any

#: the metrics and percentiles asked of ``vllm bench serve``; its JSON then holds ``mean_<m>_ms``,
#: ``median_<m>_ms``, ``std_<m>_ms``, ``p50_<m>_ms`` and ``p99_<m>_ms`` for each
METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = ("50", "99")


def tokenizer_dir(config: Any, source: Any, mc: Any, workdir: str) -> str | None:
    """A directory holding the model's tokenizer (kvforge's, saved there once), or None: it has none."""
    from kvforge.model.tokenizer_source import tokenizer_for

    path = os.path.join(workdir, "client-tokenizer")
    if not os.path.isdir(path):
        tokenizer = tokenizer_for(config, source, mc)
        if tokenizer is None:
            return None
        tokenizer.save_pretrained(path)
    return path


def bench_serve_argv(*, url: str, model: str, tokenizer: str, backend: str, dataset: str, num_prompts: int,
                     input_len: int, output_len: int, range_ratio: float, prefix_len: int | None,
                     request_rate: float, max_concurrency: int | None, seed: int, result_dir: str) -> list[str]:
    """``vllm bench serve`` arguments for one run of kvforge's workload flags. ``fixed`` and ``uniform``
    map to vLLM's random dataset with range ratio 0 and r (both draw lengths from [L(1-r), L(1+r)]);
    ``shared-prefix`` to its ``--random-prefix-len`` P (prepended to L - P random tokens)."""
    if dataset not in ("fixed", "uniform", "shared-prefix"):
        raise ValueError(f"--client vllm: vLLM's random dataset has no {dataset!r} workload "
                         "(fixed, uniform and shared-prefix have one)")
    ratio = range_ratio if dataset == "uniform" else 0.0
    prefix = (input_len // 2 if prefix_len is None else prefix_len) if dataset == "shared-prefix" else 0
    argv = ["bench", "serve", "--backend", backend, "--base-url", url, "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len - prefix),
            "--random-output-len", str(output_len), "--random-range-ratio", str(ratio),
            "--num-prompts", str(num_prompts), "--request-rate", "inf" if math.isinf(request_rate) else str(request_rate),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(PERCENTILES),
            "--save-result", "--result-dir", result_dir, "--disable-tqdm"]
    if prefix:
        argv += ["--random-prefix-len", str(prefix)]
    if max_concurrency is not None:
        argv += ["--max-concurrency", str(max_concurrency)]
    return argv


def _summary(result: dict, metric: str, n: int | None) -> dict | None:
    """``{"mean", "p50", "p99", "n"}`` in ms, as ``kvforge.bench.metrics.summarize`` gives, from vLLM's keys."""
    p50 = result.get(f"p50_{metric}_ms", result.get(f"median_{metric}_ms"))
    if p50 is None:
        return None
    return {"mean": result.get(f"mean_{metric}_ms"), "p50": p50, "p99": result.get(f"p99_{metric}_ms"), "n": n}


def row_from_result(result: dict) -> dict:
    """The run record of one saved ``vllm bench serve`` result (its JSON's keys: ``duration``,
    ``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``, ``output_throughput``,
    ``request_throughput`` and the per-metric ``p50_ttft_ms``...). ``n`` is the completed requests
    (vLLM does not save how many gaps its ITL percentiles cover: None there). Older vLLMs save no
    ``failed``: then it is the prompts that did not complete."""
    completed = int(result["completed"])
    failed = result.get("failed")
    if failed is None:
        failed = int(result.get("num_prompts", completed)) - completed
    errors = [e for e in result.get("errors") or [] if e]
    return {"seconds": result["duration"], "completed": completed, "failed": int(failed), "errors": errors[:5],
            "output_tokens": int(result["total_output_tokens"]), "prompt_tokens": int(result["total_input_tokens"]),
            "ttft_ms": _summary(result, "ttft", completed), "tpot_ms": _summary(result, "tpot", completed),
            "itl_ms": _summary(result, "itl", None), "e2e_ms": _summary(result, "e2el", completed),
            "vllm_output_throughput": result.get("output_throughput"),
            "vllm_request_throughput": result.get("request_throughput"), "spec_decode": None}


def run(peer: Any, argv_kwargs: dict, api_key: str | None) -> dict:
    """One ``vllm bench serve`` run (``argv_kwargs``: :func:`bench_serve_argv`'s, less ``result_dir``);
    its record, or ``{"error": ...}`` with the tail of its output when it saved no result."""
    with tempfile.TemporaryDirectory(prefix="kvforge-vllm-bench-") as result_dir:
        cmd = peer.cli(*bench_serve_argv(**argv_kwargs, result_dir=result_dir))
        env = peer.env() | ({"OPENAI_API_KEY": api_key} if api_key else {})
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=peer.timeout)
            output, status = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:  # its captured output is bytes whatever text= says
            output = b"".join(b for b in (exc.stdout, exc.stderr) if isinstance(b, bytes)).decode(errors="replace")
            status = f"killed after {peer.timeout:.0f} s"
        saved = sorted(f for f in os.listdir(result_dir) if f.endswith(".json") and not f.endswith(".pytorch.json"))
        if len(saved) != 1:
            return {"error": f"vllm bench serve (status {status}) saved {len(saved)} results; its output ends:\n"
                             f"{output[-2000:]}"}
        with open(os.path.join(result_dir, saved[0])) as f:
            result = json.load(f)
    return row_from_result(result) | {"vllm_result": {k: v for k, v in result.items() if not isinstance(v, list)}}
