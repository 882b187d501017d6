"""A stand-in for ``vllm serve`` and ``vllm bench serve``.

``serve`` records its arguments to ``$FAKE_VLLM_RECORD``, logs an attention backend line as vLLM does,
and serves the model with ``kvforge serve`` on the CPU (extra kvforge flags from ``$FAKE_VLLM_SERVE_ARGS``),
so that ``kvforge bench serve --vs vllm`` can be tested end to end. ``bench serve`` is vLLM's client
(``vllm.benchmarks.serve`` here: it drives the server and saves a result in vLLM's format)."""
import argparse
import os
import shlex
import sys

from vllm import _record


def main() -> None:
    p = argparse.ArgumentParser(prog="vllm")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    for flag in ("--host", "--port", "--dtype", "--seed", "--served-model-name", "--load-format", "--tokenizer"):
        serve.add_argument(flag)
    serve.add_argument("--skip-tokenizer-init", action="store_true")
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve

    add_cli_args(bench.add_parser("serve"))
    args = p.parse_args()
    if args.command == "bench":
        bench_serve(args)
        return
    _record({"call": "serve", "argv": sys.argv[1:],
             "config_json": os.path.exists(os.path.join(args.model, "config.json")),
             "tokenizer_json": bool(args.tokenizer) and os.path.exists(os.path.join(args.tokenizer, "tokenizer.json"))})
    print("INFO [cuda.py:1] Using FAKE_ATTN attention backend out of potential backends: ['FAKE_ATTN']", flush=True)
    from kvforge.cli import main as kvforge_main

    argv = ["serve", "--model", args.model, "--host", args.host, "--port", args.port,
            "--served-model-name", args.served_model_name, "--seed", args.seed]
    argv += ["--load-format", args.load_format] if args.load_format else []
    argv += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    sys.exit(kvforge_main(argv + shlex.split(os.environ.get("FAKE_VLLM_SERVE_ARGS", ""))))
