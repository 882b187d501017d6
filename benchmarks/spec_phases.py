"""Where a decode step's wall time goes, by phase, with and without speculative decoding.

On the GPU machine, after `source .gpu/install.sh` (base and model groups):
    python benchmarks/spec_phases.py [--speculative-config JSON] [--batch-size 1] [--output-len 256]
Wraps the engine's phases (schedule, launch, wait for the GPU, apply tokens, outputs, propose) in
perf_counter timers and brackets each launched step's GPU work with CUDA events, on the default
model and the `edit` dataset; prints the mean microseconds per engine step of each phase.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import time

import torch

from kvforge import LLM, SamplingParams
from kvforge.bench.workloads import edit_prompt


def timed(obj, name, acc):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speculative-config", type=json.loads, default=None)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(speculative_config=args.speculative_config)
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def batch(seed):
        return [{"prompt_token_ids": edit_prompt(tok, 512, seed * 1000 + i)} for i in range(args.batch_size)]
    llm.generate(batch(99), params, use_tqdm=False)  # warm-up
    acc: dict[str, float] = collections.defaultdict(float)
    timed(eng.scheduler, "schedule", acc)
    timed(eng.scheduler, "update", acc)
    timed(eng.runner, "launch", acc)
    timed(eng.outputs, "process", acc)
    if eng.spec is not None:
        timed(eng.spec, "propose", acc)
        timed(eng.runner, "_verify", acc)
    # inside launch
    timed(eng.runner.builder, "build", acc)
    timed(eng.runner.worker, "_lay_out_step", acc)
    timed(eng.runner, "_sample", acc)
    timed(eng.runner.model, "compute_logits", acc)
    if eng.runner.graphs is not None:
        timed(eng.runner.graphs, "replay", acc)
        timed(eng.runner.attn, "update_graph_metadata", acc)
    from kvforge.rank import step_handle
    timed(step_handle.StepHandle, "finish", acc)
    gpu_ms: list[float] = []
    launch = eng.runner.launch

    def launch_with_events(*a, **k):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        h = launch(*a, **k)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        res = h.result

        def result():
            t = time.perf_counter()
            out = res()
            acc["wait"] += time.perf_counter() - t
            gpu_ms.append(start.elapsed_time(end))
            return out
        h.result = result
        return h
    if eng.device.type == "cuda":
        eng.runner.launch = launch_with_events
    steps = 0
    step = eng.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()
    eng.step = counting_step
    t0 = time.perf_counter()
    tokens = 0
    for it in range(args.iters):
        outs = llm.generate(batch(it), params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    replay = graph_replay_costs(eng) if eng.device.type == "cuda" else None
    print(json.dumps({"graph_replay_us": replay, "speculative_config": args.speculative_config, "batch_size": args.batch_size,
                      "steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps,
                      "step_us": 1e6 * wall / steps,
                      "tpot_ms_per_request": 1e3 * wall / (tokens / args.batch_size),
                      "gpu_us_per_launch": 1e3 * sum(gpu_ms) / max(len(gpu_ms), 1),
                      "phases_us_per_step": {k: round(1e6 * v / steps, 1) for k, v in sorted(acc.items())},
                      "spec": eng.get_stats()["spec_decode"]}, indent=1))


@torch.inference_mode()
def graph_replay_costs(eng) -> dict[str, dict[str, float]]:
    """Host microseconds of one ``cudaGraphLaunch`` and device microseconds of the replayed graph,
    for the batch-1 graphs (decode, and verification when captured)."""
    from kvforge.rank.cuda_graphs import uniform_layout
    g = eng.runner.graphs
    out = {}
    for (size, q) in [k for k in g.graphs if k[0] == 1]:
        layout = uniform_layout(size, q, g.max_blocks)
        graph = g.graphs[(size, q)][0]
        g.replay(layout)
        torch.cuda.synchronize()
        host, n = 0.0, 50
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            t = time.perf_counter()
            graph.replay()
            host += time.perf_counter() - t
        end.record()
        torch.cuda.synchronize()
        out[f"q={q}"] = {"launch_host_us": 1e6 * host / n, "back_to_back_us": 1e3 * start.elapsed_time(end) / n}
    return out


if __name__ == "__main__":
    main()
