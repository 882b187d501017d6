"""``kvforge bench latency``: the end-to-end latency of one batch, as vLLM's benchmark_latency measures it.

One batch of ``--batch-size`` requests runs through ``LLM.generate`` ``--num-iters-warmup`` times
untimed, then ``--num-iters`` times timed; each iteration uses fresh prompts (a different seed), so
that prefix caching cannot skip the prefill. A prefill-only run of the same batch (``max_tokens=1``,
also ``--num-iters`` times, on prompts of their own) gives the prefill time, and the decode-step estimate is
``(p50 latency - p50 prefill) / (longest output - 1)``. Its floor is one decode step of the batch at
its average context (``mean input + output / 2``) on the compute-aware roofline (bench/metrics.py:
the matmuls and attention, each at the slower of ``--bandwidth`` and ``--flops``).
"""
from __future__ import annotations

import argparse
import time

import torch

from kvforge.bench import report
from kvforge.bench.ceilings import for_device
from kvforge.bench.metrics import (
    Precision,
    decode_step_floor_s,
    engine_precision,
    kv_bytes_per_token,
    percentile,
    step_weight_bytes,
)
from kvforge.bench.peers import sync
from kvforge.bench.spec_stats import describe as describe_spec
from kvforge.bench.spec_stats import spec_delta
from kvforge.bench.throughput import build_llm, device_name, engine_config, finish, workload_for
from kvforge.bench.workloads import BenchRequest, check_fits


def time_batch(llm, workload: list[BenchRequest], max_tokens: int | None = None) -> float:
    from kvforge import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=max_tokens or r.output_len, ignore_eos=True) for r in workload]
    sync(llm.llm_engine.device)
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=False)
    sync(llm.llm_engine.device)
    elapsed = time.perf_counter() - t0
    for out, r in zip(outs, workload):
        want = max_tokens or r.output_len
        if len(out.outputs[0].token_ids) != want:  # EOS is ignored: anything else is an engine bug
            raise RuntimeError(f"a request generated {len(out.outputs[0].token_ids)} tokens, expected {want}")
    return elapsed


def latency_row(engine: str, latencies: list[float], prefills: list[float], workload: list[BenchRequest], mc,
                itemsize: int | Precision, bandwidth: float | None, flops: float | None) -> dict:
    """The columns of one engine's timed batches and prefill-only batches."""
    longest = max(r.output_len for r in workload)
    p50, prefill = percentile(latencies, 50), percentile(prefills, 50)
    step = (p50 - prefill) / (longest - 1) if longest > 1 else None
    avg_ctx = sum(r.input_len for r in workload) / len(workload) + longest / 2
    floor = (decode_step_floor_s(mc, itemsize, len(workload), len(workload) * avg_ctx, bandwidth, flops)
             if bandwidth and flops else None)
    return {"engine": engine, "batch_size": len(workload),
            "latencies_s": latencies, "prefill_latencies_s": prefills,
            "latency_mean_s": sum(latencies) / len(latencies), "latency_p50_s": p50,
            "latency_p99_s": percentile(latencies, 99), "prefill_s": prefill, "decode_step_s": step,
            "decode_floor_s": floor, "floor_ratio": step / floor if step and floor else None,
            "weight_bytes": step_weight_bytes(mc, itemsize, len(workload)),
            "kv_bytes_per_step": len(workload) * avg_ctx * kv_bytes_per_token(mc, itemsize)}


def make_batches(args: argparse.Namespace, vocab_size: int, tokenizer) -> list[list[BenchRequest]]:
    # NOTE: every run gets prompts of its own (the prefill-only runs too): a repeated prompt would
    # hit the prefix cache and skip its prefill
    n_runs = args.num_iters_warmup + 2 * args.num_iters
    return [workload_for(args, vocab_size, args.batch_size, seed_offset=i, tokenizer=tokenizer) for i in range(n_runs)]


def run(args: argparse.Namespace) -> int:
    from kvforge.bench.throughput import model_of, vllm_peer

    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--num-iters", args.num_iters, 1),
                               ("--num-iters-warmup", args.num_iters_warmup, 0)):
        if value < least:
            raise ValueError(f"{flag}: must be >= {least}, got {value}")
    warm_n, timed_n = args.num_iters_warmup, args.num_iters
    peer, vllm = vllm_peer(args), None
    ceilings = for_device(args, engine_config(args).torch_device)  # measured (if at all) on an idle GPU
    bandwidth, flops = ceilings.bandwidth, ceilings.flops
    if peer is not None:  # first, on a device nothing else holds yet
        import tempfile

        from kvforge.bench.vllm_peer import latency_seconds, llm_kwargs

        config, source, mc_v, tokenizer = model_of(args)
        batches = make_batches(args, mc_v.vocab_size, tokenizer)
        with tempfile.TemporaryDirectory(prefix="kvforge-vllm-model-") as tmp:
            vllm = latency_seconds(peer, llm_kwargs(source, mc_v, config.torch_dtype, args.seed or 0, tmp, config), batches,
                                   [None] * (warm_n + timed_n) + [1] * timed_n)
    llm, load_s = build_llm(args)
    engine = llm.llm_engine
    mc, device, dtype = engine.model_config, engine.device, engine.dtype
    batches = make_batches(args, mc.vocab_size, engine.tokenizer)
    check_fits(batches[0], engine.max_model_len)
    for batch in batches[:warm_n]:
        time_batch(llm, batch)
    spec_before = engine.get_stats()["spec_decode"]
    timed = batches[warm_n:warm_n + timed_n]
    latencies = [time_batch(llm, batch) for batch in timed]
    spec = spec_delta(spec_before, engine.get_stats()["spec_decode"])
    prefills = [time_batch(llm, batch, max_tokens=1) for batch in batches[warm_n + timed_n:]]

    workload = timed[0]
    longest = max(r.output_len for r in workload)
    itemsize = engine_precision(engine.config, mc, torch.empty((), dtype=dtype).element_size())
    rows = [latency_row(f"kvforge ({engine.attn_backend_name})", latencies, prefills, workload, mc, itemsize,
                        bandwidth, flops) | {"load_seconds": load_s, "spec_decode": spec}]
    if vllm is not None:
        head, seconds = vllm
        if seconds:
            rows.append(latency_row(head["engine"], seconds[warm_n:warm_n + timed_n], seconds[warm_n + timed_n:],
                                    workload, mc, itemsize, bandwidth, flops) | head)
        else:
            rows.append(head)
    base = rows[0]["latency_p50_s"]
    for row in rows:  # > 1: this engine's batch takes longer than kvforge's
        row["vs_kvforge"] = row["latency_p50_s"] / base if row.get("latency_p50_s") else None
    dev = device_name(device)
    lens = f"{sum(r.input_len for r in workload) // len(workload)} prompt x {longest} output tokens"
    print(f"\n{engine.source.name} on {dev}: batch of {args.batch_size} ({args.dataset}, {lens}), "
          f"{args.num_iters} iterations after {args.num_iters_warmup} warm-up; the floor on the roofline")
    print(ceilings.describe())
    print(report.format_table(rows, report.LATENCY_COLUMNS))
    if spec:
        print(describe_spec(spec))
    finish(args, "latency", dev, str(dtype).removeprefix("torch."), mc, workload, rows,
           {"bandwidth": bandwidth, "flops": flops, "ceilings": ceilings.as_dict()})
    if args.plot:
        report.write_plot(args.plot, rows, "latency_p50_s", "batch latency p50 (s)",
                          f"{engine.source.name} on {dev}: batch {args.batch_size}, {lens}")
    return 0
