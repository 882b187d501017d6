"""``kvforge bench throughput|latency|serve``: the argparse side (entry point group ``kvforge.cli``)."""
from __future__ import annotations

import argparse
from typing import Callable

from kvforge.bench import DATASETS, PEERS


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Entry point (group ``kvforge.cli``): adds ``bench`` and its three subcommands to ``kvforge``."""
    bench = subparsers.add_parser("bench", help="benchmark throughput, latency or the server (docs/benchmarks.md)")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="{throughput,latency,serve}")

    tp = _add(sub, "throughput", "the whole workload offline at once; --vs adds transformers peers", _throughput)
    tp.add_argument("--vs", action="append", default=[], choices=PEERS,
                    help="also run a peer on the same workload (repeatable): transformers in this process, "
                         "vLLM in a subprocess of its own")
    tp.add_argument("--hf-batch-size", type=int, default=256, help="static batch size of --vs hf-generate")

    lat = _add(sub, "latency", "end-to-end latency of one batch (as vLLM's benchmark_latency)", _latency)
    lat.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    lat.add_argument("--num-iters-warmup", type=int, default=3, help="untimed iterations first")
    lat.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    lat.add_argument("--vs", action="append", default=[], choices=["vllm"],
                     help="also run vLLM (in a subprocess of its own) on the same batches")

    srv = _add(sub, "serve", "streaming /v1/completions load against the OpenAI-compatible server", _serve)
    srv.add_argument("--request-rate", type=float, default=float("inf"),
                     help="Poisson arrivals per second (seeded by --seed); inf sends all at once (default)")
    srv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    srv.add_argument("--base-url", default=None,
                     help="benchmark this running server (e.g. http://127.0.0.1:8000) instead of starting one; "
                          "--model still picks the vocabulary of the random prompts")
    srv.add_argument("--server-process", action="store_true",
                     help="start `kvforge serve` as a subprocess instead of in this process")
    srv.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    srv.add_argument("--api-key", default=None, help="bearer key for --base-url")
    srv.add_argument("--vs", action="append", default=[], choices=["vllm"],
                     help="then start `vllm serve` on the same port with the same model and drive it with the "
                          "same load (implies --server-process)")
    sw = srv.add_argument_group("sweep (docs/benchmarks.md: the serving sweep)")
    sw.add_argument("--request-rates", type=_list_of(float, "--request-rates"), default=None, metavar="R,R,...",
                    help="sweep these Poisson rates (req/s, inf allowed) instead of --request-rate")
    sw.add_argument("--concurrencies", type=_list_of(int, "--concurrencies"), default=None, metavar="C,C,...",
                    help="sweep these most-in-flight limits instead of --max-concurrency (every rate with every one)")
    sw.add_argument("--runs", type=int, default=None,
                    help="runs of every point, each on requests of its own (default: 3 in a sweep, else 1)")
    sw.add_argument("--client", type=_list_of(str, "--client"), default=None, metavar="kvforge,vllm",
                    help="who sends the load: kvforge's own client, `vllm bench serve` (vLLM's own, in vLLM's "
                         "interpreter), or both (default: both with --vs vllm, else kvforge)")


def _add(sub: argparse._SubParsersAction, name: str, help: str, func: Callable) -> argparse.ArgumentParser:
    from kvforge.cli import add_engine_args

    p = sub.add_parser(name, help=help, description=help)
    add_engine_args(p)  # --seed among them: it seeds the workload too (default 0)
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=256)
    w.add_argument("--input-len", type=int, default=512, help="prompt tokens (the mean for uniform)")
    w.add_argument("--output-len", type=int, default=256, help="output tokens, EOS ignored (the mean for uniform)")
    w.add_argument("--dataset", choices=DATASETS, default="fixed")
    w.add_argument("--range-ratio", type=float, default=0.5,
                   help="uniform: lengths in [len * (1 - r), len * (1 + r)]")
    w.add_argument("--prefix-len", type=int, default=None,
                   help="shared-prefix: prompt tokens every request shares (default: input-len // 2)")
    v = p.add_argument_group("vLLM as a peer (--vs vllm)")
    v.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="interpreter that imports vLLM (default: this one)")
    v.add_argument("--vllm-path", action="append", default=[], metavar="DIR",
                   help="put DIR in front of vLLM's PYTHONPATH (repeatable), e.g. where its wheels are unpacked")
    v.add_argument("--vllm-dummy-weights", choices=["kvforge", "vllm"], default="kvforge",
                   help="random-weight models: vLLM's weights drawn again as kvforge's (default), or vLLM's own "
                        "(uniform +-1e-3: another model, whose MoE routing differs)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="FILE", help="write every number (args, device, rows) here")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart (needs matplotlib)")
    o.add_argument("--bandwidth", type=float, default=None,
                   help="copy bandwidth, bytes/s, for the roofline (CUDA default: this GPU's from the table in "
                        "kvforge.bench.ceilings, else measured)")
    o.add_argument("--flops", type=float, default=None,
                   help="bf16 matmul rate, FLOP/s, for the roofline (CUDA default: as --bandwidth)")
    o.add_argument("--measure-ceilings", action="store_true",
                   help="measure the ceilings --bandwidth and --flops leave open on this GPU (a copy of 1 GiB, a "
                        "bf16 8192^3 matmul) instead of taking them from the table")
    p.set_defaults(func=func)
    return p


def _list_of(kind: Callable[[str], object], flag: str) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of ``kind``, refused (exit status 2) naming ``flag``."""
    def parse(text: str) -> list:
        try:
            values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: expected comma-separated {kind.__name__}s, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag}: expected at least one value, got {text!r}")
        return values
    return parse


def _check(args: argparse.Namespace) -> None:
    """Workload and output flags, checked before any model loads (``ValueError`` naming the flag)."""
    from kvforge.bench.workloads import check_workload_args

    check_workload_args(args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                        args.prefix_len)
    for flag in ("bandwidth", "flops"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag}: must be > 0, got {value}")


def _throughput(args: argparse.Namespace) -> int:
    _check(args)
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size: must be >= 1, got {args.hf_batch_size}")
    from kvforge.bench import throughput
    return throughput.run(args)


def _latency(args: argparse.Namespace) -> int:
    _check(args)
    from kvforge.bench import latency
    return latency.run(args)


def _serve(args: argparse.Namespace) -> int:
    _check(args)
    from kvforge.bench import serve
    return serve.run(args)
