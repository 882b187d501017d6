"""Per-layer attention forward, side by side for every available backend (Llama-3-8B attention shape).

    python benchmarks/attention.py                       # all cases, every available backend
    python benchmarks/attention.py --block-size 128 --backends flashinfer,flash_attn --json out.json
    python benchmarks/attention.py --device cpu --quick  # smoke test of the script (torch backend)

Cases: decode (one query token per sequence) for batch 64 and 256 at contexts 1k, 4k and 16k; prefill
of 4 fresh 4096-token sequences; 4 chunks of 4096 tokens after a cached 4096-token prefix. Block
tables are shuffled. The timed region is one ``forward`` (write the new K/V, attend) over one layer's
cache, with the metadata built once outside it; ``build_metadata`` is timed separately. Warm-up comes
first: FlashInfer JIT-compiles on first use (minutes), FA4 compiles per shape family (seconds).

Figures of merit (s = bytes per element, H/Hkv = query/KV heads, D = head size):
- decode bytes = 2*sum(ctx)*Hkv*D*s (K and V read) + 2*B*H*D*s (q read, out written)
  + 2*B*Hkv*D*s (new K/V written); TB/s and its fraction of the measured 4.25 TB/s copy bandwidth.
- prefill FLOPs = 4*H*D*sum over sequences of (q_len*ctx - q_len*(q_len-1)/2), ctx = context after
  the step (the causal (query, key) pairs, 2 FLOPs each for QK^T and PV); TFLOP/s and fraction of
  the measured 779 TFLOP/s bf16 matmul rate.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time

import numpy as np
import torch

BANDWIDTH = 4.25e12  # bytes/s, H200 device-to-device copy (read + write), shared/gpu/README.md
FLOPS = 779e12  # bf16 8192^3 matmul on the H200


def make_layout(specs, block_size, rng):
    """BatchLayout for (cached prefix, new tokens) per sequence over shuffled blocks; (layout, num_blocks)."""
    from kvforge.attention import BatchLayout

    need = np.array([-(-(p + q) // block_size) for p, q in specs])
    num_blocks = int(need.sum())
    blocks = rng.permutation(num_blocks).astype(np.int32)
    bt = np.zeros((len(specs), int(need.max())), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(need)])
    slots = []
    for i, (prefix, q_len) in enumerate(specs):
        bt[i, :need[i]] = blocks[starts[i]:starts[i + 1]]
        pos = np.arange(prefix, prefix + q_len)
        slots.append(bt[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    q_lens = np.array([q for _, q in specs])
    layout = BatchLayout(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                         np.array([p + q for p, q in specs], dtype=np.int32), bt, np.concatenate(slots))
    return layout, num_blocks


def cases(args):
    """(name, kind, specs) for every case asked for."""
    out = []
    if "decode" in args.cases:
        for b in args.batch_sizes:
            for ctx in args.contexts:
                label = f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)
                out.append((f"decode b={b} ctx={label}", "decode", [(ctx - 1, 1)] * b))
    if "prefill" in args.cases:
        n = args.prefill_len
        out.append((f"prefill 4x{n}", "prefill", [(0, n)] * 4))
        out.append((f"chunk 4x{n} after {n} prefix", "prefill", [(n, n)] * 4))
    return out


def figures(kind, specs, h, hkv, d, itemsize):
    """(bytes, flops) of one forward over these sequences (see the module docstring)."""
    q_lens = np.array([q for _, q in specs], dtype=np.float64)
    ctx = np.array([p + q for p, q in specs], dtype=np.float64)
    n_tok = q_lens.sum()
    nbytes = itemsize * (2 * ctx.sum() * hkv * d + 2 * n_tok * h * d + 2 * n_tok * hkv * d)
    flops = 4 * h * d * float((q_lens * ctx - q_lens * (q_lens - 1) / 2).sum())
    return nbytes, flops


def timeit(fn, device, iters, repeats):
    """Median seconds per call over ``repeats`` runs of ``iters`` back-to-back calls."""
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


KV_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn}


def build_backends(args, device, dtype):
    from kvforge.plugin_manager import get_plugin_manager

    pm = get_plugin_manager()
    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    kw = dict(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
              scale=args.head_size ** -0.5, block_size=args.block_size, dtype=dtype, device=device)
    if kv_dtype is not None:
        kw["kv_cache_dtype"] = kv_dtype
    backends, skipped = {}, {}
    for name in args.backends:
        if name not in pm.names("attention_backend"):
            skipped[name] = "not registered"
            continue
        try:
            cls = pm.get("attention_backend", name)
            reasons = cls.validate(device=device, dtype=dtype, head_size=args.head_size, block_size=args.block_size,
                                   **({"kv_cache_dtype": kv_dtype} if kv_dtype is not None else {}))
            if reasons:
                skipped[name] = "; ".join(reasons)
                continue
            backends[name] = cls(**kw)
        except Exception as exc:  # an import or construction failure skips that backend only
            skipped[name] = repr(exc)
    return backends, skipped


def run(args):
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.tensor([], dtype=KV_DTYPES[args.kv_cache_dtype] or dtype).element_size()  # KV bytes
    backends, skipped = build_backends(args, device, dtype)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_size
    rows = []
    for case, kind, specs in cases(args):
        rng = np.random.default_rng(0)
        layout, num_blocks = make_layout(specs, args.block_size, rng)
        t = layout.num_tokens
        # one layer's cache, shared by the backends (they all write the same values to the same slots)
        cache = torch.empty((2, num_blocks, args.block_size, hkv, d), dtype=dtype, device=device).normal_()
        q = torch.randn(t, h, d, dtype=dtype, device=device)
        k, v = torch.randn(t, hkv, d, dtype=dtype, device=device), torch.randn(t, hkv, d, dtype=dtype, device=device)
        nbytes, flops = figures(kind, specs, h, hkv, d, itemsize)
        for name, backend in backends.items():
            if KV_DTYPES[args.kv_cache_dtype] is not None:  # an FP8 cache belongs to its backend (its scales)
                cache = backend.allocate_kv_cache(num_blocks, 1)[0]
                cache.view(torch.uint8).copy_(torch.randint(0, 0x78, cache.shape, dtype=torch.uint8, device=device))
            if backend.kv_cache_shape(num_blocks) != tuple(cache.shape):
                rows.append(dict(case=case, backend=name, error="kv_cache_shape differs from the default"))
                continue
            try:
                backend.build_metadata(layout)  # warm-up: JIT compiles, caches
                # host time of planning (what a step pays before its first layer)
                plan = functools.partial(backend.build_metadata, layout)
                build_s = timeit(plan, torch.device("cpu"), 1, args.repeats)
                meta = backend.build_metadata(layout)
                for _ in range(args.warmup):
                    backend.forward(q, k, v, cache, meta)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                sec = timeit(functools.partial(backend.forward, q, k, v, cache, meta), device, args.iters, args.repeats)
            except torch.OutOfMemoryError:
                rows.append(dict(case=case, backend=name, error="out of memory"))
                gc.collect()
                torch.cuda.empty_cache()
                continue
            row = dict(case=case, kind=kind, backend=name, ms=sec * 1e3, build_ms=build_s * 1e3,
                       tokens=t, kv_tokens=int(layout.seq_lens.sum()))
            if kind == "decode":
                row.update(tb_s=nbytes / sec / 1e12, frac_bw=nbytes / sec / args.bandwidth)
            else:
                row.update(tflop_s=flops / sec / 1e12, frac_flops=flops / sec / args.flops)
            rows.append(row)
            del meta
        del cache, q, k, v
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, skipped


def print_table(rows, args):
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nattention forward, one layer: {args.num_heads} q heads, {args.num_kv_heads} kv heads, head "
          f"{args.head_size}, {args.dtype}, block size {args.block_size}, on {dev}")
    print(f"{'case':<30}{'backend':<12}{'ms':>10}{'build ms':>10}{'TB/s':>8}{'of BW':>8}{'TFLOP/s':>9}"
          f"{'of peak':>9}{'vs best':>9}")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        best = min((r["ms"] for r in mine if "ms" in r), default=None)
        for r in mine:
            if "error" in r:
                print(f"{case:<30}{r['backend']:<12}  {r['error']}")
                continue
            bw = f"{r['tb_s']:>8.2f}{r['frac_bw']:>8.1%}" if "tb_s" in r else f"{'':>16}"
            fl = f"{r['tflop_s']:>9.1f}{r['frac_flops']:>9.1%}" if "tflop_s" in r else f"{'':>18}"
            print(f"{case:<30}{r['backend']:<12}{r['ms']:>10.3f}{r['build_ms']:>10.2f}{bw}{fl}"
                  f"{r['ms'] / best:>8.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv_ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--backends", default="flashinfer,flash_attn,triton,torch", type=lambda s: s.split(","))
    p.add_argument("--cases", default="decode,prefill", type=lambda s: s.split(","))
    p.add_argument("--batch-sizes", default=[64, 256], type=csv_ints)
    p.add_argument("--contexts", default=[1024, 4096, 16384], type=csv_ints)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_DTYPES),
                   help="auto: the compute dtype; fp8: an e4m3 cache (scales 1.0), backends that lack it skipped")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="back-to-back calls per timing sample")
    p.add_argument("--repeats", type=int, default=5, help="timing samples; the median is reported")
    p.add_argument("--bandwidth", type=float, default=BANDWIDTH, help="measured copy bandwidth, bytes/s")
    p.add_argument("--flops", type=float, default=FLOPS, help="measured bf16 matmul rate, FLOP/s")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test of the script)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()
    if args.quick:
        args.batch_sizes, args.contexts, args.prefill_len = [4], [64, 256], 128
        args.warmup, args.iters, args.repeats = 1, 1, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --device cpu --quick")
    rows, skipped = run(args)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "skipped": skipped, "rows": rows,
                       "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}, f, indent=2)


if __name__ == "__main__":
    main()
