"""W1 under LoRA: kvforge's base model, kvforge with 8 adapters and vLLM with the same 8 adapters, one run.

The issue's target (H200): W1 = 256 requests x 512 prompt tokens x 256 output tokens (greedy, EOS ignored,
the same prompt token ids everywhere: ``kvforge.bench.workloads.make_workload``, seed ``--seed``) on the
Llama-3-8B shape with random weights, request i under adapter i % 8 (rank 16 on every projection):

  (a) kvforge, the base model alone (LoRA off)
  (b) kvforge with the 8 adapters (enable_lora, max_loras=8, max_lora_rank=16)
  (c) vLLM with the same 8 adapter directories (the same three LoRA options, its defaults otherwise)

Targets: (b)/(a) >= 0.8 and (b)/(c) >= 1.0 in output tokens/s. Printed as a table; ``--out`` gets JSON.

Adapters: random PEFT directories written without ``peft`` (``adapter_config.json`` and
``adapter_model.safetensors``, bf16, seeded), shaped from the model config the engines load, into a temporary
directory that both engines read; 84 MB (80 MiB) each on the 8B shape.

Each engine runs in a process of its own, so each starts on a free GPU: (a) and (b) re-run this script
(``--child``), (c) runs ``kvforge.bench``'s vLLM worker (``--vllm-path`` in front of its ``PYTHONPATH``). The
measurement is ``kvforge bench throughput``'s on both sides: after the engine is built (CUDA graphs, compile),
a warm-up generate of min(8, N) other prompts, warm-up prompt i under adapter i % 8 (so every adapter is
loaded, and the LoRA kernels have run at prefill and decode, before the clock starts), then every request is
added at once and the engine stepped to completion; ``seconds`` is first add to last output.

    python benchmarks/lora_w1.py --vllm-path /tmp/vsite --out lora_w1.json   # the GPU (benchmarks/gpu_lora.sh)
    python benchmarks/lora_w1.py --model dummy:tiny --num-requests 4 --input-len 16 --output-len 4 \\
        --no-vllm --device cpu                                                 # a quick check of (a) and (b)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from kvforge.bench.lora_adapters import PROJECTIONS, write_adapter

TARGETS = {"lora_vs_base": 0.8, "lora_vs_vllm": 1.0}


def adapter_requests(root: str, num_loras: int) -> list[Any]:
    """The ``LoRARequest`` of each adapter directory under ``root`` (ids 1..num_loras)."""
    from kvforge import LoRARequest

    return [LoRARequest(f"adapter-{i}", i + 1, os.path.join(root, f"adapter-{i}")) for i in range(num_loras)]


def per_request(adapters: list[Any], n: int) -> list[Any]:
    """Request i runs under adapter i % len(adapters)."""
    return [adapters[i % len(adapters)] for i in range(n)]


def workload_digest(workload: list[Any]) -> str:
    """A hash of every prompt's token ids and output length: the sides ran the same requests iff equal."""
    h = hashlib.sha256()
    for r in workload:
        h.update(json.dumps([r.prompt_token_ids, r.output_len]).encode())
    return h.hexdigest()[:16]


# -- (a) and (b): one kvforge engine, in a child process ------------------------------------------------------
def lora_options(args: argparse.Namespace) -> dict[str, int]:
    """The LoRA engine options of (b) and (c)."""
    return {"max_loras": args.max_loras or args.num_loras, "max_lora_rank": args.max_lora_rank or args.lora_rank}


def run_child(args: argparse.Namespace) -> int:
    """The ``--child`` process: :func:`measure_kvforge`'s row, or an ``error`` row, to ``--result``."""
    try:
        row = measure_kvforge(args)
    except Exception as exc:  # the parent reports it in the table and the JSON
        traceback.print_exc()
        row = {"engine": f"({'b' if args.child == 'lora' else 'a'}) kvforge", "error": f"{type(exc).__name__}: {exc}"}
    with open(args.result, "w") as f:
        json.dump(row, f)
    return 1 if row.get("error") else 0


def measure_kvforge(args: argparse.Namespace) -> dict:
    """Build kvforge's engine for ``args.child`` (``base`` or ``lora``), warm up, run W1; its row."""
    from kvforge.bench.throughput import build_llm, device_name, run_streamed, warm_up, workload_for
    from kvforge.bench.workloads import check_fits

    lora = args.child == "lora"
    args.enable_lora = lora
    if lora:
        vars(args).update(lora_options(args))
    llm, load_s = build_llm(args)
    engine = llm.llm_engine
    workload = workload_for(args, engine.model_config.vocab_size)
    check_fits(workload, engine.max_model_len)
    adapters = adapter_requests(args.adapters, args.num_loras) if lora else None
    warm_up(llm, args, len(workload), loras=adapters)
    before = engine.get_stats()
    row = run_streamed(engine, workload, per_request(adapters, len(workload)) if lora else None)
    after = engine.get_stats()
    label = f"({'b' if lora else 'a'}) kvforge ({engine.attn_backend_name})"
    return row | {"engine": label + (f" + {args.num_loras} LoRA" if lora else ", base model"),
                  "load_seconds": load_s, "cuda_graph_capture_s": engine.cuda_graph_capture_s,
                  "num_blocks": engine.num_blocks, "max_num_seqs": engine.config.max_num_seqs,
                  "preemptions": after["num_preemptions"] - before["num_preemptions"],
                  "device": device_name(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                  "workload_digest": workload_digest(workload),
                  "lora": lora_options(args) | {"adapters": args.num_loras} if lora else None}


def kvforge_row(argv: list[str], role: str, adapters_root: str, timeout: float) -> dict:
    """Run this script as a ``--child role`` process; its row, or an ``error`` row."""
    label = "(b) kvforge + LoRA" if role == "lora" else "(a) kvforge, base model"
    with tempfile.TemporaryDirectory(prefix="kvforge-lora-w1-") as tmp:
        result = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", role, "--adapters", adapters_root,
               "--result", result]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"engine": label, "error": f"did not finish within --timeout={timeout:.0f} s"}
        if not os.path.exists(result):
            return {"engine": label, "error": f"the child exited with status {proc.returncode} (its log is above)"}
        with open(result) as f:
            return json.load(f) | {"process_seconds": time.perf_counter() - t0}


# -- (c): vLLM ------------------------------------------------------------------------------------------------
def vllm_row(args: argparse.Namespace, config: Any, source: Any, mc: Any, workload: list[Any],
             adapters: list[Any]) -> dict:
    """vLLM's row (``kvforge.bench.vllm_peer``) with the same adapters, requests and warm-up as kvforge's;
    ``config``, ``source``, ``mc``: kvforge's engine config, model source and model config (as vLLM's model)."""
    from kvforge.bench.throughput import WARM_TOKENS, warm_prompts
    from kvforge.bench.vllm_peer import VllmPeer, llm_kwargs, throughput_row

    peer = VllmPeer(python=args.vllm_python or sys.executable, path=list(args.vllm_path), timeout=args.timeout)
    try:
        print(f"(c): vLLM {peer.probe()} in {peer.python}", file=sys.stderr)
    except (ValueError, RuntimeError) as exc:
        return {"engine": "(c) vLLM", "error": str(exc)}
    warm = warm_prompts(args, mc.vocab_size, len(workload))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvforge-vllm-model-") as tmp:
        kwargs = llm_kwargs(source, mc, config.torch_dtype, args.seed or 0, tmp, config)
        kwargs |= {"enable_lora": True} | lora_options(args)
        try:
            row = throughput_row(peer, kwargs, workload, warm, WARM_TOKENS, loras=per_request(adapters, len(workload)),
                                 warmup_loras=per_request(adapters, len(warm)))
        except RuntimeError as exc:  # the worker wrote no result (it crashed or ran past --timeout)
            return {"engine": "(c) vLLM", "error": str(exc)}
    return row | {"engine": f"(c) {row['engine']} + {args.num_loras} LoRA", "llm_kwargs": kwargs,
                  "workload_digest": workload_digest(workload), "process_seconds": time.perf_counter() - t0}


# -- the report -----------------------------------------------------------------------------------------------
def ratio(num: dict, den: dict | None) -> float | None:
    a, b = num.get("output_tok_s"), (den or {}).get("output_tok_s")
    return a / b if a and b else None


def columns() -> list:
    from kvforge.bench import report

    return [("engine", 48, lambda r: str(r["engine"])), ("seconds", 9, report.num("seconds")),
            ("output tok/s", 13, report.num("output_tok_s", "{:,.0f}")),
            ("TTFT ms p50/p99", 17, report.pair("ttft_ms")), ("TPOT ms p50/p99", 17, report.pair("tpot_ms")),
            ("vs (a)", 9, report.ratio), ("load s", 8, report.num("load_seconds", "{:.1f}")),
            ("process s", 10, report.num("process_seconds", "{:.1f}"))]


def verdicts(ratios: dict[str, float | None]) -> list[str]:
    names = {"lora_vs_base": "(b)/(a)", "lora_vs_vllm": "(b)/(c)"}
    lines = []
    for key, target in TARGETS.items():
        value = ratios[key]
        shown = "n/a" if value is None else f"{value:.3f}x"
        met = "n/a" if value is None else ("met" if value >= target else "NOT met")
        lines.append(f"{names[key]} = {shown}   target >= {target:.2f}   {met}")
    return lines


def check_and_rate(rows: list[dict], workload: list[Any]) -> dict[str, float | None]:
    """Refuse rows that ran other requests, fill the rates (``kvforge.bench.throughput.derive``) in place;
    the two ratios of the targets."""
    from kvforge.bench.throughput import derive

    digest = workload_digest(workload)
    for row in rows:
        if row.get("workload_digest") not in (None, digest):
            row["error"] = f"ran other requests (digest {row['workload_digest']}, expected {digest})"
            row.pop("seconds", None)
    derive(rows, workload, None)
    return {"lora_vs_base": ratio(rows[1], rows[0]) if len(rows) > 1 else None,
            "lora_vs_vllm": ratio(rows[1], rows[2]) if len(rows) > 2 else None}


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from kvforge.bench import report
    from kvforge.bench.throughput import model_of, workload_for

    if args.out:  # written after every side: its folder must exist before the first
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    config, source, mc, _ = model_of(args)
    workload = workload_for(args, mc.vocab_size)
    n_in, n_out = sum(r.input_len for r in workload), sum(r.output_len for r in workload)
    rows: list[dict] = []
    payload = {"benchmark": "lora_w1", "complete": False,
               "args": {k: v for k, v in vars(args).items() if k not in ("child", "adapters", "result")},
               "model_config": mc.to_dict(),
               "workload": {"num_requests": len(workload), "prompt_tokens": n_in, "output_tokens": n_out,
                            "digest": workload_digest(workload)},
               "adapters": {"count": args.num_loras, "rank": args.lora_rank, "alpha": args.lora_alpha,
                            "target_modules": list(PROJECTIONS)},
               "targets": TARGETS, "rows": rows}

    def publish(complete: bool) -> None:
        """Rates and ratios so far, to ``--out`` after every side (a run cut short keeps what it measured)."""
        payload["ratios"] = check_and_rate(rows, workload)
        payload.update(complete=complete, measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
                       device=next((r["device"] for r in rows if r.get("device")), "?"))
        if args.out:
            report.write_json(args.out, payload)

    with tempfile.TemporaryDirectory(prefix="kvforge-lora-adapters-") as root:
        t0 = time.perf_counter()
        adapters = adapter_requests(root, args.num_loras)
        for i, a in enumerate(adapters):
            write_adapter(a.lora_path, mc, args.lora_rank, args.lora_alpha, (args.seed or 0) + i, source.name)
        size = os.path.getsize(os.path.join(adapters[0].lora_path, "adapter_model.safetensors"))
        payload["adapters"]["bytes_each"] = size
        print(f"{args.num_loras} adapters (rank {args.lora_rank}, {size / 2**20:.0f} MiB each) written to {root} "
              f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for role in ("base", "lora"):
            rows.append(kvforge_row(argv, role, root, args.timeout))
            publish(False)
        if not args.no_vllm:
            rows.append(vllm_row(args, config, source, mc, workload, adapters))
    publish(True)
    print(f"\n{source.name} on {payload['device']}: {len(workload)} requests, {n_in:,} prompt + {n_out:,} output "
          f"tokens (greedy, EOS ignored); request i under adapter i % {args.num_loras} (rank {args.lora_rank}, "
          f"{', '.join(PROJECTIONS)})")
    print(report.format_table(rows, columns()))
    print("\n".join(verdicts(payload["ratios"])))
    if args.out:
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(not r.get("error") for r in rows) else 1


def parser() -> argparse.ArgumentParser:
    from kvforge.cli import add_engine_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)  # --enable-lora, --max-loras and --max-lora-rank are set per side by this script
    p.set_defaults(model="dummy:llama-3-8b", dataset="fixed", range_ratio=0.5, prefix_len=None)
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", "--num-prompts", dest="num_prompts", type=int, default=256)
    w.add_argument("--input-len", type=int, default=512, help="prompt tokens of every request")
    w.add_argument("--output-len", type=int, default=256, help="output tokens of every request (EOS ignored)")
    w.add_argument("--num-loras", type=int, default=8, help="adapters; request i runs under adapter i %% N")
    w.add_argument("--lora-rank", type=int, default=16, help="rank of every adapter")
    w.add_argument("--lora-alpha", type=int, default=32, help="lora_alpha of every adapter")
    v = p.add_argument_group("vLLM, side (c)")
    v.add_argument("--no-vllm", action="store_true", help="skip (c)")
    v.add_argument("--vllm-python", default=None, metavar="PYTHON", help="interpreter that imports vLLM (this one)")
    v.add_argument("--vllm-path", action="append", default=[], metavar="DIR",
                   help="put DIR in front of vLLM's PYTHONPATH (repeatable), e.g. /tmp/vsite")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each side may take, load included")
    p.add_argument("--out", default=None, metavar="FILE", help="write the rows, ratios and targets here as JSON")
    # the child processes of (a) and (b)
    p.add_argument("--child", choices=["base", "lora"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--adapters", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    for flag, value in (("--num-requests", args.num_prompts), ("--input-len", args.input_len),
                        ("--output-len", args.output_len), ("--num-loras", args.num_loras),
                        ("--lora-rank", args.lora_rank)):
        if value < 1:
            raise SystemExit(f"{flag}: must be >= 1, got {value}")
    if args.child:
        return run_child(args)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
