"""Where the GPU time of a step goes, by kernel, and where a whole run's wall time goes, by step kind.

    python benchmarks/kernel_profile.py --model dummy:llama-3-8b --attention-backend triton

Part 1 (torch.profiler): one prefill step of ``--prefill-tokens`` fresh prompt tokens and a few decode
steps at batch ``--decode-batch``; prints each phase's kernels grouped by kind (GEMM, attention,
elementwise/norm, other) with their share of the GPU time, and the GPU-busy fraction of the wall time.
Part 2 (no profiler, no extra syncs): the throughput workload stepped by hand; every step's wall time
is attributed to its kind (prefill-carrying or decode-only), so the table shows how many steps of each
kind ran and their mean wall time.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch


def kind_of(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "cutlass", "sm90", "sm100", "nvjet", "matmul", "xmma", "ampere_", "cublas")):
        return "gemm"
    if any(s in n for s in ("attn", "attention", "decode", "prefill", "flash", "cache")):
        return "attention"
    if any(s in n for s in ("elementwise", "reduce", "norm", "rope", "silu", "act", "mul", "add", "cat",
                            "copy", "index", "gather", "neg", "fused")):
        return "elementwise"
    return "other"


def profile_phase(label: str, fn, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind_of(ev.name)] += ev.device_time / steps
            by_name[ev.name][0] += ev.device_time / steps
            by_name[ev.name][1] += 1 / steps
    gpu = sum(by_kind.values())
    print(f"\n== {label}: wall {wall * 1e3:.2f} ms/step, GPU busy {gpu / 1e3:.2f} ms ({gpu / 1e3 / (wall * 1e3):.0%})")
    for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<12}{t / 1e3:>9.2f} ms {t / gpu:>6.1%}")
    print("  top kernels:")
    for name, (t, cnt) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"    {t / 1e3:>8.3f} ms  x{cnt:>5.0f}  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--decode-context", type=int, default=640)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--skip-kernels", action="store_true", help="only part 2")
    p.add_argument("--runs", type=int, default=1, help="part 2 this many times (the first one warms up)")
    p.add_argument("--step-times", action="store_true", help="print every prefill-carrying step's ms")
    args = p.parse_args()

    from kvforge import LLM

    llm = LLM(args.model, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
              async_scheduling=not args.no_async_scheduling)
    eng = llm.llm_engine
    runner = eng.runner.worker  # the driver worker: model, cache, graphs
    dev = runner.device

    # -- part 1: kernels of one prefill step and of decode steps -----------------------------------
    if dev.type == "cuda" and not args.skip_kernels:
        part1(runner, args)
    for _ in range(args.runs):
        run_workload(eng, args)


def part1(runner, args) -> None:
    from kvforge.rank.batch_layout import prefill_layout
    from kvforge.rank.cuda_graphs import decode_layout

    dev, bs = runner.device, runner.block_size
    lens = [512] * (args.prefill_tokens // 512)
    blocks_per_seq = -(-512 // bs)
    layout = prefill_layout(lens, blocks_per_seq, bs)
    ids = torch.randint(100, 1000, (layout.num_tokens,), device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])

    @torch.inference_mode()
    def prefill():
        meta = runner.attn.build_metadata(layout)
        h = runner.model(ids, pos, runner.kv_caches, meta)
        runner.model.compute_logits(h[torch.tensor(layout.query_start_loc[1:] - 1, device=dev, dtype=torch.long)])

    profile_phase(f"prefill {layout.num_tokens} tokens ({len(lens)} x 512), eager", prefill, steps=2)

    b, ctx = args.decode_batch, args.decode_context
    nblk = -(-ctx // bs)
    tables = (torch.arange(b * nblk) % runner.kv_caches[0].shape[1]).reshape(b, nblk).to(torch.int32).numpy()
    seq_lens = torch.full((b,), ctx, dtype=torch.int32).numpy()
    slots = (tables[:, -1].astype("int64") * bs + (ctx - 1) % bs)
    dl = decode_layout(b, nblk, seq_lens, tables, slots)
    dids = torch.randint(100, 1000, (b,)).numpy()
    dpos = torch.full((b,), ctx - 1, dtype=torch.long).numpy()

    @torch.inference_mode()
    def decode_eager():
        meta = runner.attn.build_metadata(dl)
        h = runner.model(torch.from_numpy(dids).to(dev), torch.from_numpy(dpos).to(dev), runner.kv_caches, meta)
        runner.model.compute_logits(h).argmax(-1)

    profile_phase(f"decode batch {b} x context {ctx}, eager", decode_eager, steps=3)
    if runner.graphs is not None:
        wide = np.zeros((b, runner.graphs.max_blocks), dtype=np.int32)
        wide[:, :nblk] = tables
        gl = decode_layout(b, runner.graphs.max_blocks, seq_lens, wide, slots)

        @torch.inference_mode()
        def decode_graph():
            runner.graphs.input_ids[:b].copy_(torch.from_numpy(dids))  # b is a captured size
            runner.graphs.positions[:b].copy_(torch.from_numpy(dpos))
            h = runner.graphs.replay(gl)
            runner.model.compute_logits(h).argmax(-1)

        profile_phase(f"decode batch {b} x context {ctx}, CUDA graph", decode_graph, steps=3)



def run_workload(eng, args) -> None:
    """Part 2: a whole run, wall time per step kind."""
    from kvforge import SamplingParams

    vocab = eng.model_config.vocab_size
    prompts = torch.randint(100, vocab - 100, (args.num_prompts, args.input_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for pr in prompts:
        eng.add_request(None, pr, sp)
    stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    orig_schedule = eng.scheduler.schedule
    last = {}

    def schedule():
        out = orig_schedule()
        last["out"] = out
        return out

    eng.scheduler.schedule = schedule
    slow: list[tuple[float, int, int]] = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - ts
        out = last["out"]
        n_tok = out.total_num_scheduled_tokens
        kind = "decode-only" if n_tok == len(out.scheduled) else "prefill-carrying"
        s = stats[kind]
        s[0] += 1
        s[1] += dt
        s[2] += n_tok
        if kind == "prefill-carrying":
            slow.append((round(dt * 1e3, 1), n_tok, len(out.scheduled)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    total_out = args.num_prompts * args.output_len
    print(f"\n== run: {args.num_prompts} x {args.input_len} in x {args.output_len} out: {wall:.2f} s, "
          f"{total_out / wall:,.0f} output tok/s")
    print(f"  {'kind':<18}{'steps':>7}{'seconds':>9}{'ms/step':>9}{'tokens/step':>13}")
    for kind, (n, t, tok) in stats.items():
        print(f"  {kind:<18}{n:>7}{t:>9.2f}{t / n * 1e3:>9.2f}{tok / n:>13.0f}")
    if args.step_times:
        print("  prefill-carrying steps (ms, tokens, sequences):", slow)
    eng.scheduler.schedule = orig_schedule


if __name__ == "__main__":
    main()
