"""``kvforge bench serve``: streaming ``/v1/completions`` load against the OpenAI-compatible server.

The server is started in this process (``create_app`` under uvicorn on a background thread, on a free
loopback port), as a ``kvforge serve`` subprocess (``--server-process``), or not at all
(``--base-url``, any OpenAI-compatible server). Cold start is engine construction (in-process) or
process start (subprocess) until ``/health`` answers 200. With ``--vs vllm`` kvforge runs as a
subprocess on a free port, then ``vllm serve`` of the same model on the same port, each driven by
the same load in turn (``vllm_server``).

Each request sends its prompt as token ids with ``ignore_eos: true``, ``max_tokens`` = its output
length, ``temperature: 0`` and ``stream_options.include_usage``. Arrivals are Poisson at
``--request-rate`` req/s (seeded; ``inf`` sends all at once), at most ``--max-concurrency`` in flight.
Per request: TTFT = first content chunk - send; ITL = gaps between content chunks; TPOT = (last chunk
- first chunk) / (tokens - 1); E2E = end of stream - send. A request fails on a non-200 answer, a
transport error, or a completion_tokens count other than its output length.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvforge.bench import report
from kvforge.bench.metrics import engine_precision, resolve_ceilings, roofline_tok_s, summarize
from kvforge.bench.spec_stats import describe as describe_spec
from kvforge.bench.spec_stats import from_metrics, spec_delta
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


# -- servers ------------------------------------------------------------------------------------------
def wait_healthy(url: str, timeout: float, alive: Any = lambda: True) -> None:
    """Poll ``url``/health until it answers 200. One client for the whole wait: ``httpx.get`` builds a
    client (and an SSL context) per call, about 20 ms of CPU, which at this rate took a third of a core
    from the server starting on a small machine. No keep-alive: each poll on its own connection."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("the server exited before /health answered 200")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")


class InProcessServer:
    """The app under uvicorn on a daemon thread of this process (the engine thread is its own)."""

    label = "kvforge serve (in-process)"

    def __init__(self, config: Any, timeout: float):
        import uvicorn

        from kvforge.engine.async_engine import AsyncLLMEngine
        from kvforge.plugin_manager import get_plugin_manager
        from kvforge.server.app import create_app
        from kvforge.server.cli import default_served_name

        t0 = time.perf_counter()
        self.engine = AsyncLLMEngine.from_config(config)
        app = create_app(self.engine, [default_served_name(config.model)], hook=get_plugin_manager().hook)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves this very socket
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="kvforge-bench-server", daemon=True)
        self.thread.start()
        wait_healthy(self.url, timeout, self.thread.is_alive)
        self.cold_start_s = time.perf_counter() - t0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessServer:
    """A server command as a subprocess on loopback ``port``, its output in a log file; cold start is
    process start until ``/health`` answers 200."""

    def __init__(self, cmd: list[str], port: int, timeout: float, label: str, env: dict | None = None):
        self.label = label
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvforge-bench-serve-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.url, timeout, lambda: self.proc.poll() is None)
        except RuntimeError as exc:
            tail = self.output()[-3000:]
            self.stop()
            raise RuntimeError(f"{exc}; server log ({self.log.name}):\n{tail}") from None
        self.cold_start_s = time.perf_counter() - t0

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:  # read before stop() closes our handle
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def kvforge_server(args: argparse.Namespace, port: int, timeout: float) -> ProcessServer:
    """``python -m kvforge.cli serve`` with the same engine flags."""
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", "--port", str(port), *engine_argv(args)]
    return ProcessServer(cmd, port, timeout, "kvforge serve (process)")


def vllm_server(peer: Any, config: Any, source: Any, mc: Any, seed: int, port: int, timeout: float,
                workdir: str) -> ProcessServer:
    """``vllm serve`` of the same model (random weights where kvforge's are), served under kvforge's
    model name, vLLM's defaults otherwise; without a tokenizer it is told to skip loading one."""
    from kvforge.bench.vllm_peer import llm_kwargs
    from kvforge.model.tokenizer_source import tokenizer_for
    from kvforge.server.cli import default_served_name

    kwargs = llm_kwargs(source, mc, config.torch_dtype, seed, workdir, config)
    cmd = [peer.python, "-c", "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()",
           "serve", kwargs["model"], "--host", "127.0.0.1", "--port", str(port), "--dtype", kwargs["dtype"],
           "--seed", str(kwargs["seed"]), "--served-model-name", default_served_name(config.model)]
    if kwargs.get("load_format"):
        cmd += ["--load-format", kwargs["load_format"]]
    for key in ("quantization", "kv_cache_dtype"):
        if kwargs.get(key):
            cmd += ["--" + key.replace("_", "-"), kwargs[key]]
    tokenizer = tokenizer_for(config, source, mc)
    if tokenizer is None:
        cmd.append("--skip-tokenizer-init")
    elif source.kind == "dummy" and source.path is None:  # a preset: its config directory lacks the tokenizer
        path = os.path.join(workdir, "tokenizer")
        tokenizer.save_pretrained(path)
        cmd += ["--tokenizer", path]
    return ProcessServer(cmd, port, timeout, f"vLLM {peer.version} serve", env=peer.env())


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as ``kvforge serve`` arguments."""
    from kvforge.cli import ENGINE_FLAGS

    argv: list[str] = []
    for flag, _ in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            argv += [flag, str(value)]
    if args.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if getattr(args, "async_scheduling", None) is not None:
        argv.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    return argv


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


def run(args: argparse.Namespace) -> int:
    import torch

    from kvforge.bench.throughput import model_of, vllm_peer

    if not args.request_rate > 0:
        raise ValueError(f"--request-rate: must be > 0 (inf sends every request at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    if args.vs and args.base_url:
        raise ValueError("--vs vllm: starts both servers itself, so it cannot be combined with --base-url")
    peer = vllm_peer(args)  # fails before anything starts if vLLM does not import
    config, source, mc, tokenizer = model_of(args)
    workload = workload_for(args, mc.vocab_size, tokenizer=tokenizer)
    warm = make_workload("fixed", 1, args.input_len, min(4, args.output_len), mc.vocab_size,
                         seed=(args.seed or 0) + 1_000_003)[0]
    dtype = dev = max_num_seqs = None
    rows = []
    if args.base_url:
        rows.append(measure(args, args.base_url.rstrip("/"), args.base_url.rstrip("/"), None, workload, warm))
        device = "remote"
    else:
        dtype, dev, max_num_seqs = config.torch_dtype, config.torch_device, config.max_num_seqs
        if args.server_process or args.vs:
            port = free_port()  # every server in turn on the same port
            server: Any = kvforge_server(args, port, args.server_timeout)
        else:
            server = InProcessServer(config, args.server_timeout)
            eng = server.engine.engine
            check_fits(workload, eng.max_model_len)
            dtype, dev = eng.dtype, eng.device
        rows.append(measure(args, server.url, server.label, server, workload, warm))
        if args.vs:
            with tempfile.TemporaryDirectory(prefix="kvforge-vllm-model-") as tmp:
                server = vllm_server(peer, config, source, mc, args.seed or 0, port, args.server_timeout, tmp)
                row = measure(args, server.url, server.label, server, workload, warm)
            rows.append(row)
        device = device_name(dev)
    roofline = bandwidth = flops = None
    if dtype is not None:
        bandwidth, flops = resolve_ceilings(args.bandwidth, args.flops, torch.device(dev).type)
        if bandwidth and flops:
            itemsize = engine_precision(config, mc, torch.empty((), dtype=dtype).element_size())
            roofline = roofline_tok_s(mc, workload, max_num_seqs, itemsize, bandwidth, flops)
    derive(rows, workload, roofline)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    cold = rows[0]["cold_start_s"]
    print(f"\n{config.model or 'default model'} on {device}: {len(workload)} streaming requests ({args.dataset}) "
          f"at {rate} req/s, max concurrency {args.max_concurrency or 'unlimited'}; "
          + (f"cold start {cold:.2f} s" if cold is not None else "external server"))
    print(report.format_table(rows, report.SERVE_COLUMNS))
    for row in rows:
        if row["failed"]:
            print(f"    {row['engine']}: {row['failed']} failed; first error: {row['errors'][0]}")
        if row.get("attention_backend"):
            print(f"    {row['engine']}: attention backend {row['attention_backend']}")
    if rows[0]["spec_decode"]:
        print(describe_spec(rows[0]["spec_decode"]))
    finish(args, "serve", device, str(dtype).removeprefix("torch.") if dtype else None, mc, workload, rows,
           {"roofline_tok_s": roofline, "bandwidth": bandwidth, "flops": flops,
            "base_url": rows[0].get("url")})
    if args.plot:
        report.write_plot(args.plot, rows, "output_tok_s", "output tokens/s", f"{rows[0]['engine']}: {rate} req/s",
                          roofline)
    return 0 if all(row["failed"] == 0 for row in rows) else 1


def measure(args: argparse.Namespace, url: str, label: str, server: Any, workload: list[BenchRequest],
            warm: BenchRequest) -> dict:
    """One server's row: the load, then the server stopped (if we started it)."""
    from kvforge.bench.vllm_peer import attention_backend

    try:
        model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                          if args.api_key else {}, timeout=30).json()["data"][0]["id"]
        spec_before = _spec_counters(url)
        results, duration = asyncio.run(run_load(url, model, workload, warm, args.request_rate,
                                                 args.max_concurrency, args.seed or 0, args.api_key))
        spec = spec_delta(spec_before, _spec_counters(url))
    finally:
        log = server.output() if isinstance(server, ProcessServer) else ""
        if server is not None:
            server.stop()
    row = {"engine": label, "url": url, "seconds": duration,
           "cold_start_s": server.cold_start_s if server is not None else None,
           "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "spec_decode": spec}
    if label.startswith("vLLM"):
        row["attention_backend"] = attention_backend(log)
    return row | summarize_results(results, workload)
