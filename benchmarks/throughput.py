"""Offline throughput: kvforge vs transformers on the same workload, in one process.

A thin wrapper over ``kvforge bench throughput`` (bench/, docs/benchmarks.md), kept so that
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
    from kvforge.cli import main as kvforge_main

    return kvforge_main(["bench", "throughput", *DEFAULTS, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
