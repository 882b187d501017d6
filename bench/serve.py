"""``kvforge bench serve``: streaming ``/v1/completions`` load against the OpenAI-compatible server.

The server (bench/servers.py) is started in this process (``create_app`` under uvicorn on a background
thread, on a free loopback port), as a ``kvforge serve`` subprocess (``--server-process``), or not at all
(``--base-url``, any OpenAI-compatible server). With ``--vs vllm`` kvforge runs as a subprocess on a free
port, then ``vllm serve`` of the same model on the same port, each driven by the same loads in turn.
Which loads (rates, concurrencies, runs, clients) is bench/sweep.py's plan; a load is sent by kvforge's
own client (here) or by ``vllm bench serve`` (bench/vllm_client.py).

kvforge's client sends each prompt as token ids with ``ignore_eos: true``, ``max_tokens`` = its output
length, ``temperature: 0`` and ``stream_options.include_usage``. Arrivals are Poisson at the run's rate
(seeded by the run's seed; ``inf`` sends all at once), at most the run's concurrency in flight.
Per request: TTFT = first content chunk - send; ITL = gaps between content chunks; TPOT = (last chunk
- first chunk) / (tokens - 1); E2E = end of stream - send. A request fails on a non-200 answer, a
transport error, or a completion_tokens count other than its output length.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from kvforge.bench import report, vllm_client
from kvforge.bench.ceilings import for_device
from kvforge.bench.metrics import engine_precision, roofline_tok_s, summarize
from kvforge.bench.servers import (
    ExternalServer,
    InProcessServer,
    ProcessServer,
    free_port,
    kvforge_server,
    vllm_server,
)
from kvforge.bench.spec_stats import describe as describe_spec
from kvforge.bench.spec_stats import from_metrics, spec_delta
from kvforge.bench.sweep import Plan, aggregate, plan_of
from kvforge.bench.throughput import derive, device_name, finish, workload_for
from kvforge.bench.workloads import BenchRequest, check_fits, make_workload


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # perf_counter of each chunk with choices
    end: float = 0.0
    output_tokens: int = 0


# -- the load -------------------------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``n`` requests, Poisson at ``rate``/s; all 0 for ``inf``."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def send(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Result:
    res = Result(sent=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            usage = None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    res.chunks.append(time.perf_counter())
                usage = chunk.get("usage") or usage
        res.end = time.perf_counter()
        res.output_tokens = usage["completion_tokens"] if usage else len(res.chunks)
        if res.output_tokens != body["max_tokens"]:
            res.error = f"generated {res.output_tokens} tokens, expected {body['max_tokens']}"
        else:
            res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(url: str, model: str | None, workload: list[BenchRequest], warm: BenchRequest, rate: float,
                   max_concurrency: int | None, seed: int, api_key: str | None) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def body(r: BenchRequest) -> dict:
        b = {"prompt": r.prompt_token_ids, "max_tokens": r.output_len, "temperature": 0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}}
        return b | ({"model": model} if model else {})

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        warm_res = await send(client, url, body(warm), headers)
        if not warm_res.ok:
            raise RuntimeError(f"the warm-up request failed: {warm_res.error}")
        offsets = arrival_offsets(len(workload), rate, seed)
        start = time.perf_counter()

        async def launch(offset: float, r: BenchRequest) -> Result:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if sem is None:
                return await send(client, url, body(r), headers)
            async with sem:
                return await send(client, url, body(r), headers)

        results = await asyncio.gather(*(launch(o, r) for o, r in zip(offsets, workload)))
    return results, max(r.end or time.perf_counter() for r in results) - start


def summarize_results(results: list[Result], workload: list[BenchRequest]) -> dict:
    ok = [(res, r) for res, r in zip(results, workload) if res.ok]
    errors = [res.error for res in results if not res.ok]
    return {
        "completed": len(ok), "failed": len(errors), "errors": errors[:5],
        "output_tokens": sum(res.output_tokens for res, _ in ok),
        "prompt_tokens": sum(r.input_len for _, r in ok),
        "ttft_ms": summarize((res.chunks[0] - res.sent for res, _ in ok if res.chunks), 1e3),
        "tpot_ms": summarize(((res.chunks[-1] - res.chunks[0]) / (res.output_tokens - 1)
                              for res, _ in ok if res.output_tokens > 1 and res.chunks), 1e3),
        "itl_ms": summarize((b - a for res, _ in ok for a, b in zip(res.chunks, res.chunks[1:])), 1e3),
        "e2e_ms": summarize((res.end - res.sent for res, _ in ok), 1e3),
    }


def _spec_counters(url: str) -> dict | None:
    """The server's speculative-decoding counters (None: speculation off, or not a kvforge server)."""
    try:
        return from_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    except httpx.HTTPError:
        return None


def kvforge_client(args: argparse.Namespace, url: str, model: str, workload: list[BenchRequest], warm: BenchRequest,
                   rate: float, max_concurrency: int | None, seed: int) -> dict:
    """One run of kvforge's own client: the load, and the speculative-decoding counters it moved."""
    spec_before = _spec_counters(url)
    results, duration = asyncio.run(run_load(url, model, workload, warm, rate, max_concurrency, seed, args.api_key))
    return {"seconds": duration, "spec_decode": spec_delta(spec_before, _spec_counters(url))} | \
        summarize_results(results, workload)


def _server_starts(args: argparse.Namespace, config: Any, source: Any, mc: Any, peer: Any,
                   workdir: str) -> list[tuple[str, Callable[[], Any]]]:
    """``(vLLM client backend, start)`` of every server in turn: ``--base-url``'s, or kvforge's (in this
    process, or a subprocess), then with ``--vs vllm`` ``vllm serve`` on the same port."""
    if args.base_url:
        return [("openai", lambda: ExternalServer(args.base_url))]
    if not (args.server_process or args.vs):
        return [("openai", lambda: InProcessServer(config, args.server_timeout))]
    port = free_port()  # every server in turn on the same port
    starts: list[tuple[str, Callable[[], Any]]] = [("openai", lambda: kvforge_server(args, port, args.server_timeout))]
    if args.vs:
        starts.append(("vllm", lambda: vllm_server(peer, config, source, mc, args.seed or 0, port,
                                                    args.server_timeout, workdir)))
    return starts


def drive(args: argparse.Namespace, plan: Plan, server: Any, backend: str, workloads: list[list[BenchRequest]],
          warm: BenchRequest, peer: Any, tokenizer: str | None) -> list[dict]:
    """Every run of ``plan`` against one started ``server``: points, then runs, then clients."""
    model = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                      if args.api_key else {}, timeout=30).json()["data"][0]["id"]
    records = []
    for point, (rate, limit) in enumerate(plan.points):
        for run in range(plan.runs):
            offset = plan.seed_offset(point, run)
            seed = (args.seed or 0) + offset
            for client in plan.clients:
                if client == "kvforge":
                    rec = kvforge_client(args, server.url, model, workloads[offset], warm, rate, limit, seed)
                else:
                    rec = vllm_client.run(peer, dict(
                        url=server.url, model=model, tokenizer=tokenizer, backend=backend, dataset=args.dataset,
                        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                        range_ratio=args.range_ratio, prefix_len=args.prefix_len, request_rate=rate,
                        max_concurrency=limit, seed=seed), args.api_key)
                records.append({"engine": server.label, "client": client, "url": server.url,
                                "cold_start_s": server.cold_start_s, "request_rate": rate, "max_concurrency": limit,
                                "run": run, "seed": seed, "seed_offset": offset} | rec)
                if plan.aggregated:
                    done = rec.get("error") or f"{rec['completed']}/{rec['completed'] + rec['failed']} ok"
                    print(f"[{server.label}, {client} client] rate {_rate(rate)}, concurrency {limit or '-'}, "
                          f"run {run + 1}/{plan.runs}: {done}", file=sys.stderr)
    return records


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run(args: argparse.Namespace) -> int:
    import torch

    from kvforge.bench.throughput import model_of, vllm_peer
    from kvforge.bench.vllm_peer import attention_backend

    plan = plan_of(args)
    if args.vs and args.base_url:
        raise ValueError("--vs vllm: starts both servers itself, so it cannot be combined with --base-url")
    peer = vllm_peer(args, client="vllm" in plan.clients)  # fails before anything starts if vLLM does not import
    config, source, mc, tokenizer = model_of(args)
    workloads = [workload_for(args, mc.vocab_size, seed_offset=o, tokenizer=tokenizer) for o in range(plan.num_workloads)]
    warm = make_workload("fixed", 1, args.input_len, min(4, args.output_len), mc.vocab_size,
                         seed=(args.seed or 0) + 1_000_003)[0]
    # measured (if at all) before any server holds the GPU
    ceilings = None if args.base_url else for_device(args, config.torch_device)
    dtype, dev = (None, None) if args.base_url else (config.torch_dtype, config.torch_device)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-serve-") as workdir:
        client_tokenizer = vllm_client.tokenizer_dir(config, source, mc, workdir) if "vllm" in plan.clients else None
        if "vllm" in plan.clients and client_tokenizer is None:
            raise ValueError(f"--client vllm: vLLM's client sends text prompts, and {source.name} has no tokenizer "
                             "(give --tokenizer)")
        unstarted = []  # a peer server that did not start: the rows of those that did are still reported
        for i, (backend, start) in enumerate(_server_starts(args, config, source, mc, peer, workdir)):
            try:
                server = start()
            except RuntimeError as exc:
                if i == 0:
                    raise
                print(f"error: the peer server did not start, so it has no rows: {exc}", file=sys.stderr)
                unstarted.append(str(exc))
                continue
            mine = []
            try:
                if isinstance(server, InProcessServer):
                    eng = server.engine.engine
                    for w in workloads:
                        check_fits(w, eng.max_model_len)
                    dtype, dev = eng.dtype, eng.device
                mine = drive(args, plan, server, backend, workloads, warm, peer, client_tokenizer)
            finally:
                log = server.output() if isinstance(server, ProcessServer) else ""
                server.stop()
            if server.label.startswith("vLLM"):
                for rec in mine:
                    rec["attention_backend"] = attention_backend(log)
            records += mine
    rooflines: dict[int, float] = {}
    if dtype is not None and ceilings is not None and ceilings.ok:
        itemsize = engine_precision(config, mc, torch.empty((), dtype=dtype).element_size())
        rooflines = {o: roofline_tok_s(mc, w, config.max_num_seqs, itemsize, ceilings.bandwidth, ceilings.flops)
                     for o, w in enumerate(workloads)}
    for offset, w in enumerate(workloads):
        derive([r for r in records if r["seed_offset"] == offset], w, rooflines.get(offset))
    device = device_name(dev) if dev is not None else "remote"
    rows = aggregate(records) if plan.aggregated else records
    report_serve(args, plan, config, device, ceilings, workloads[0], rows, records, rooflines.get(0))
    finish(args, "serve", device, str(dtype).removeprefix("torch.") if dtype else None, mc, workloads[0], rows,
           {"roofline_tok_s": rooflines.get(0), "bandwidth": ceilings.bandwidth if ceilings else None,
            "flops": ceilings.flops if ceilings else None, "ceilings": ceilings.as_dict() if ceilings else None,
            "base_url": args.base_url, "sweep": {"request_rates": list(plan.rates),
                                                 "concurrencies": list(plan.concurrencies), "runs": plan.runs,
                                                 "clients": list(plan.clients)},
            "runs": records})
    return 0 if not unstarted and all(not r.get("error") and r["failed"] == 0 for r in records) else 1


def report_serve(args: argparse.Namespace, plan: Plan, config: Any, device: str, ceilings: Any,
                 workload: list[BenchRequest], rows: list[dict], records: list[dict], roofline: float | None) -> None:
    """The header, the table (one row per run, or a sweep's medians and spreads), and what went wrong."""
    colds = {r["engine"]: r["cold_start_s"] for r in records if r.get("cold_start_s") is not None}
    cold = ", ".join(f"{e} {s:.2f} s" for e, s in colds.items()) or "external server"
    load = (f"at {_rate(plan.rates[0])} req/s, max concurrency {plan.concurrencies[0] or 'unlimited'}"
            if not plan.aggregated else
            f"rates {', '.join(map(_rate, plan.rates))} req/s x max concurrency "
            f"{', '.join(str(c or 'unlimited') for c in plan.concurrencies)}, {plan.runs} runs each "
            "(median [min-max] over runs)")
    print(f"\n{config.model or 'default model'} on {device}: {len(workload)} streaming requests ({args.dataset}) "
          f"{load}, clients {', '.join(plan.clients)}; cold start {cold}")
    print(ceilings.describe() if ceilings else "roofline n/a (an external server: its GPU is not known)")
    print(report.format_table(rows, report.SWEEP_COLUMNS if plan.aggregated else report.SERVE_COLUMNS))
    for rec in records:
        where = f"    {rec['engine']}, {rec['client']} client, rate {_rate(rec['request_rate'])}, run {rec['run'] + 1}"
        if rec.get("error"):
            if plan.aggregated:  # the one-run table prints it under the row
                print(f"{where}: {rec['error']}")
        elif rec["failed"]:
            print(f"{where}: {rec['failed']} failed; first error: {(rec['errors'] or ['not said'])[0]}")
    for engine, backend in {r["engine"]: r.get("attention_backend") for r in records}.items():
        if backend:
            print(f"    {engine}: attention backend {backend}")
    if records[0].get("spec_decode"):
        print(describe_spec(records[0]["spec_decode"]))
    if args.plot:
        if plan.aggregated:
            print("--plot: draws one run's rows; a sweep's are in the table and --json", file=sys.stderr)
        else:
            report.write_plot(args.plot, rows, "output_tok_s", "output tokens/s",
                              f"{rows[0]['engine']}: {_rate(plan.rates[0])} req/s", roofline)
