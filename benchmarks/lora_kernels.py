"""Where LoRA's time goes on the GPU: the segmented GEMMs per layer shape, and an engine's decode steps.

    python benchmarks/lora_kernels.py kernels [--rows 256 --slots 8 --rank 16]   # part 1
    python benchmarks/lora_kernels.py engine [--num-prompts 256 --output-len 48]  # part 2

Part 1 (Llama-3-8B layer shapes, bf16): for each fused projection (qkv, o, gate_up, down), ``--rows`` token
rows spread evenly over ``--slots`` adapters of rank ``--rank``, it times inside a CUDA graph (no launch
overhead): the base layer's GEMM, and the LoRA shrink + expand under the tiles ``pick_tiles`` chooses today
(graph mode: a work list sized for all rows; and eager: exactly the tiles needed), and then a sweep of other
tiles for the shrink and for the expand. Every line gives microseconds per call and the ratio to the base GEMM;
the best tiles per shape close each block.

Part 2 (torch.profiler): one engine (``dummy:llama-3-8b``, LoRA on, ``--num-loras`` random rank-``--rank``
adapters), a generate of ``--num-prompts`` short prompts under adapter i % N, then the same prompts with no
adapter; each run's wall time, GPU-busy time and its top kernels by GPU time.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

#: Llama-3-8B: (name, K = in, N = out of the fused layer, parts)
SHAPES = (("qkv", 4096, 6144, 3), ("o", 4096, 4096, 1), ("gate_up", 4096, 28672, 2), ("down", 14336, 4096, 1))


def graph_time_us(fn, reps: int = 20, replays: int = 10) -> float:
    """Microseconds per ``fn()`` call, from a CUDA graph of ``reps`` calls replayed ``replays`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * replays)


def kernels(args: argparse.Namespace) -> None:
    from kvforge.lora.ops import LoRABatch, group_rows, tile_capacity

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows, slots = args.rows, args.slots
    order, starts = group_rows(np.arange(rows) % slots, slots)
    batches = {"graph": LoRABatch.from_grouping(order, starts, device=dev, tiles=tile_capacity(rows, slots)),
               "eager": LoRABatch.from_grouping(order, starts, device=dev)}
    print(f"{torch.cuda.get_device_name()}: {rows} rows over {slots} adapters ({int(np.diff(starts).max())} rows "
          f"each), rank {args.rank}, bf16; microseconds per call inside a CUDA graph")
    total = {"base": 0.0, "lora": 0.0}
    for shape in SHAPES:
        base, lora = bench_shape(shape, rows, slots, args.rank, batches, dev)
        total["base"] += base
        total["lora"] += lora
    print(f"\nper decoder layer: base GEMMs {total['base']:.1f} us, LoRA (graph, today's tiles) {total['lora']:.1f} us "
          f"({total['lora'] / total['base']:.2f}x)")


def bench_shape(shape, rows: int, slots: int, rank: int, batches: dict, dev) -> tuple[float, float]:
    """One projection's lines; (base GEMM us, LoRA us in the graph batch with today's tiles)."""
    from kvforge.lora.ops import SegmentTiles, pick_tiles, segmented_matmul_triton

    name, k, n, parts = shape
    r = parts * rank
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    a = torch.randn(slots, r, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(slots, n, r, device=dev, dtype=torch.bfloat16) * 0.01
    y = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
    s = torch.zeros(rows, r, device=dev, dtype=torch.bfloat16)
    base = graph_time_us(lambda: torch.mm(x, w.t(), out=y))
    print(f"\n== {name}: K={k} N={n} R={r}   base GEMM {base:8.1f} us")

    def shrink(batch, t=None):
        segmented_matmul_triton(x, a, batch, s, accumulate=False, tiles=t)

    def expand(batch, t=None):
        segmented_matmul_triton(s, b, batch, y, accumulate=True, tiles=t)

    today = {}
    for mode, batch in batches.items():
        both = graph_time_us(lambda: (shrink(batch), expand(batch)))  # noqa: B023  (called at once)
        today[mode] = both
        cap = batch.tiles.shape[0]
        print(f"  today {mode:5s} ({cap:3d} tiles): {both:7.1f} us ({both / base:5.2f}x base); shrink alone "
              f"{graph_time_us(lambda: shrink(batch)):6.1f}, tiles {pick_tiles(cap, r, k, fp32=False)} / "  # noqa: B023
              f"{pick_tiles(cap, n, r, fp32=False)}")
    graph = batches["graph"]
    sweep = [SegmentTiles(32, max(16, min(64, 1 << (r - 1).bit_length())), bk, split, 4, 3)
             for bk, split in itertools.product((128, 256), (4, 8, 16)) if bk * split <= k]
    ranked = sorted(((graph_time_us(lambda: shrink(graph, t)), t) for t in sweep), key=lambda z: z[0])  # noqa: B023
    for us, t in ranked[:3]:
        print(f"  shrink  {us:7.1f} us  {t}")
    rk = max(16, 1 << (r - 1).bit_length())
    sweep = [SegmentTiles(32, bn, min(rk, 64), 1, warps, 2) for bn, warps in itertools.product((64, 128, 256), (4, 8))]
    ranked = sorted(((graph_time_us(lambda: expand(graph, t)), t) for t in sweep), key=lambda z: z[0])  # noqa: B023
    for us, t in ranked[:3]:
        print(f"  expand  {us:7.1f} us  {t}")
    return base, today["graph"]


def engine(args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    from kvforge import LLM, LoRARequest, SamplingParams
    from kvforge.bench.lora_adapters import write_adapter

    llm = LLM(args.model, enable_lora=True, max_loras=args.num_loras, max_lora_rank=args.rank,
              enforce_eager=args.enforce_eager)
    mc = llm.llm_engine.model_config
    tmp = tempfile.mkdtemp(prefix="kvforge-lora-prof-")
    loras = []
    for i in range(args.num_loras):
        path = os.path.join(tmp, f"a{i}")
        write_adapter(path, mc, args.rank, 2 * args.rank, i, args.model)
        loras.append(LoRARequest(f"a{i}", i + 1, path))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, mc.vocab_size - 100, (args.num_prompts, args.input_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    per = [loras[i % len(loras)] for i in range(len(prompts))]
    llm.generate(prompts[:16], SamplingParams(max_tokens=8, ignore_eos=True), lora_request=per[:16], use_tqdm=False)
    for label, lr in (("LoRA", per), ("base", None)):
        for _ in range(2):  # first: warm (shapes, graphs); second: profiled
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, params, lora_request=lr, use_tqdm=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
        by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                by_name[ev.name][0] += ev.device_time
                by_name[ev.name][1] += 1
        busy = sum(v[0] for v in by_name.values()) / 1e6
        toks = len(prompts) * args.output_len
        print(f"\n== {label}: {len(prompts)} x {args.input_len} in x {args.output_len} out: wall {wall:.2f} s "
              f"({toks / wall:,.0f} out tok/s), GPU busy {busy:.2f} s ({busy / wall:.0%})")
        for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {us / 1e3:9.1f} ms {count:7d}x {us / max(count, 1):8.1f} us  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=("kernels", "engine"))
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--num-loras", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lora_kernels.py needs a GPU")
    (kernels if args.part == "kernels" else engine)(args)


if __name__ == "__main__":
    main()
