"""Bar charts of a kvforge-vs-vLLM run from its JSON files (benchmarks/gpu_vs_vllm.sh writes them).

    python benchmarks/plot_vs_vllm.py benchmarks/results/2026-11-24-h200-vs-vllm docs/img

Writes ``vs-vllm-offline.png`` (output tok/s of W1, W2, W3 and 1 / seconds of the batch-1 request,
each relative to vLLM) and ``vs-vllm-serve.png`` (TTFT and TPOT p50/p99 at each request rate, from
``vllm bench serve``). Needs matplotlib (not a kvforge dependency).
"""
from __future__ import annotations

import json
import os
import sys


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def main(argv: list[str]) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, out = argv
    os.makedirs(out, exist_ok=True)
    labels, ours, theirs = [], [], []
    for name, title in (("w1", "W1 fixed"), ("w2", "W2 uniform"), ("w3", "W3 shared prefix")):
        rows = load(os.path.join(results, f"{name}.json"))["rows"]
        labels.append(title)
        ours.append(rows[0]["output_tok_s"])
        theirs.append(rows[1]["output_tok_s"])
    rows = load(os.path.join(results, "batch1.json"))["rows"]
    labels.append("batch 1 (1/s)")
    ours.append(1 / rows[0]["latency_p50_s"])
    theirs.append(1 / rows[1]["latency_p50_s"])
    fig, ax = plt.subplots(figsize=(8, 4.2))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [o / t for o, t in zip(ours, theirs)], 0.4, label="kvforge", color="#3b6ea8")
    ax.bar([i + 0.2 for i in x], [1.0] * len(labels), 0.4, label="vLLM 0.26 (FLASH_ATTN)", color="#9a9a9a")
    ax.axhline(1.10, color="#c0392b", linestyle="--", label="target 1.10x")
    for i, (o, t) in enumerate(zip(ours, theirs)):
        ax.text(i - 0.2, o / t + 0.01, f"{o / t:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylim(0.8, 1.2)
    ax.set_ylabel("throughput relative to vLLM")
    ax.set_title("H200, Llama-3-8B shape (random bf16), same requests, one after the other", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "vs-vllm-offline.png"), dpi=110)
    plt.close(fig)

    rates = (2, 8, 32)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for k, (engine, color) in enumerate((("kvforge", "#3b6ea8"), ("vllm", "#9a9a9a"))):
            runs = [load(os.path.join(results, f"serve-{engine}-rate{r}.json")) for r in rates]
            for j, q in enumerate(("median", "p99")):
                xs = [i + (k * 2 + j) * 0.2 - 0.3 for i in range(len(rates))]
                ax.bar(xs, [r[f"{q}_{metric}_ms"] for r in runs], 0.2, color=color, alpha=1.0 if q == "median" else 0.55,
                       label=f"{'kvforge' if engine == 'kvforge' else 'vLLM 0.26'} {q}")
        ax.set_xticks(range(len(rates)), [f"{r} req/s" for r in rates])
        ax.set_yscale("log")
        ax.set_ylabel(f"{metric.upper()} ms (log scale)")
        ax.legend(fontsize=7)
    fig.suptitle("vllm bench serve, 512-token prompts, 128 out, Poisson arrivals (H200)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "vs-vllm-serve.png"), dpi=110)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
