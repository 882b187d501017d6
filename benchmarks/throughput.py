"""Offline throughput: kvforge vs transformers on the same workload, in one process.

A thin wrapper over ``kvforge bench throughput`` (core/bench/, docs/benchmarks.md), kept so that
existing commands work; only the default model differs (``dummy:llama-3-8b`` here):

    python benchmarks/throughput.py --model dummy:llama-3-8b --num-prompts 256 --input-len 512 \
        --output-len 256 --vs hf-generate --hf-batch-size 256

Every flag of the original script (``--model --num-prompts --input-len --output-len
--attention-backend --dtype --max-num-seqs --max-num-batched-tokens --gpu-memory-utilization --seed
--vs --hf-batch-size --bandwidth --flops --json``) has the same name and meaning there; ``--help``
lists the rest (datasets, latency percentiles, ``--plot``).
"""
from __future__ import annotations

import sys

DEFAULTS = ["--model", "dummy:llama-3-8b"]  # argparse keeps the last value, so the caller's flags win


def main(argv: list[str] | None = None) -> int:
    import argparse
    import logging

    from kvforge.bench.cli import add_bench_parser

    # NOTE: the bench parser is added directly, not found through the `kvforge.cli` entry points, so
    # that this script also works from an install made before `bench` was registered
    parser = argparse.ArgumentParser(prog="benchmarks/throughput.py")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "throughput", *DEFAULTS, *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
