"""The fused MoE kernels (``kvforge.layers.fused_moe``) against the torch reference and vLLM's
``fused_experts``, at the expert shapes of Qwen3-30B-A3B and gpt-oss-20b, bf16 (GPU only).

    python benchmarks/fused_moe.py --out benchmarks/results/<date>-<gpu>-fused-moe/fused_moe.json
    python benchmarks/fused_moe.py --quick                         # T in {1, 64, 4096}
    python benchmarks/fused_moe.py --vllm-path DIR --bandwidth-tbs 3.35   # vLLM from DIR; an H100's HBM
    python benchmarks/fused_moe.py --sweep --out sweep.json        # tile candidates per BLOCK_M bucket

Shapes: ``qwen3-30b-a3b`` E 128, k 8, H 2048, I 768, silu; ``gpt-oss-20b`` E 32, k 4, H 2880, I 2880,
biases, swigluoai. Routing: a softmax over random logits, top k.

Timing: as benchmarks/quant_kernels.py, each case's calls are captured in one CUDA graph (no launch
overhead, as decode runs in the engine) and replayed; the figure is the median over replays of
(replay time / calls). Each call of a case has its own routing (ROUTINGS of them), so successive
calls touch mostly different experts and read their weights from HBM as a model's layers do. The
reference synchronises with the host (it loops over the experts that got tokens), so it is timed
eagerly with CUDA events, and fewer times.

The sweep times each bucket's candidate tiles (``fused_moe.MOE_TILES`` swapped for the run) at
token counts that fall in the bucket on both shapes, and prints the fastest as a table to paste.

Roofline: the bytes a call must move at least (the experts it touches: their w13, w2 and biases; x and
the output) over its time, as a fraction of ``--bandwidth-tbs`` (default 4.8, the H200's HBM3e).
Decode should approach it; prefill is bound by the tensor cores instead (TFLOP/s is printed too).
vLLM's swigluoai reads gate and up interleaved where kvforge reads them stacked: the same bytes and
FLOPs, so its times compare, its values do not.
"""
from __future__ import annotations

import argparse
import contextlib
import enum
import inspect
import json
import statistics
import sys
import time

import torch

#: model -> (experts, top_k, hidden, intermediate, biases, activation)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, False, "silu"),
          "gpt-oss-20b": (32, 4, 2880, 2880, True, "swigluoai")}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
QUICK_TOKENS = [1, 64, 4096]
#: distinct routings per case, one per call of the captured graph
ROUTINGS = 8
#: MOE_TILES bucket -> (average pairs per expert to time it at, candidates as (block_n_up, block_n_down,
#: block_k, group_m, num_warps, num_stages)); the first candidate of each is the table's entry
SWEEP = {
    8: ((1 / 16, 1), [(32, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4), (32, 32, 128, 1, 4, 4), (16, 32, 128, 1, 4, 4),
                      (32, 64, 64, 1, 4, 5), (32, 64, 256, 1, 4, 3), (64, 128, 128, 1, 4, 3), (32, 64, 128, 1, 2, 4)]),
    24: ((16,), [(64, 128, 128, 1, 4, 3), (64, 128, 64, 4, 4, 4), (32, 64, 128, 4, 4, 4), (64, 64, 64, 4, 4, 4),
                 (128, 128, 64, 4, 4, 3), (32, 128, 64, 8, 4, 4)]),
    48: ((32,), [(64, 128, 64, 8, 4, 3), (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3),
                 (32, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4)]),
    1 << 30: ((256,), [(64, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 256, 64, 8, 8, 3),
                       (64, 128, 64, 8, 4, 4), (128, 128, 32, 8, 8, 4), (64, 128, 64, 1, 8, 3)]),
}


def make_weights(model: str, g: torch.Generator) -> dict:
    experts, _, hidden, inter, bias, activation = SHAPES[model]

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    return dict(w13=randn(experts, 2 * inter, hidden, scale=hidden ** -0.5),
                w2=randn(experts, hidden, inter, scale=inter ** -0.5),
                w13_bias=randn(experts, 2 * inter, scale=0.5) if bias else None,
                w2_bias=randn(experts, hidden, scale=0.5) if bias else None, activation=activation)


def make_inputs(model: str, num_tokens: int, g: torch.Generator) -> dict:
    experts, top_k, hidden, *_ = SHAPES[model]
    logits = torch.randn(num_tokens, experts, generator=g, device="cuda")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return dict(x=torch.randn(num_tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16),
                topk_weights=weights / weights.sum(-1, keepdim=True), topk_ids=ids)


def min_bytes(model: str, weights: dict, inputs: dict) -> int:
    """Bytes one call must move: the experts it touches (w13, w2, biases), x and the output."""
    _, _, hidden, inter, bias, _ = SHAPES[model]
    touched = inputs["topk_ids"].unique().numel()
    per_expert = (2 * inter * hidden + hidden * inter + (2 * inter + hidden if bias else 0)) * 2
    return touched * per_expert + 2 * inputs["x"].numel() * 2


def flops(model: str, num_tokens: int) -> int:
    _, top_k, hidden, inter, *_ = SHAPES[model]
    return 2 * num_tokens * top_k * (2 * inter * hidden + hidden * inter)


# ---- the implementations ----------------------------------------------------------------------------

def kvforge_call(fn, weights: dict, inputs: dict):
    w = weights
    return lambda: fn(inputs["x"], w["w13"], w["w2"], inputs["topk_weights"], inputs["topk_ids"],
                      activation=w["activation"], w13_bias=w["w13_bias"], w2_bias=w["w2_bias"])


def load_vllm(path: str | None):
    """vLLM's ``fused_experts`` (with ``path`` first on sys.path), or None where it does not import."""
    if path:
        sys.path.insert(0, path)
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as exc:  # noqa: BLE001 - vLLM missing or broken: the comparison is left out
        print(f"vLLM not compared: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return fused_experts


def vllm_call(fused_experts, weights: dict, inputs: dict):
    """A call of vLLM's ``fused_experts``, passing the activation and biases under the names this
    vLLM version takes (its signature has changed across releases); None where it cannot take them."""
    params = inspect.signature(fused_experts).parameters
    kwargs = {}
    if "activation" in params:
        kwargs["activation"] = weights["activation"]
        default = params["activation"].default
        if isinstance(default, enum.Enum):  # vLLM 0.26: MoEActivation; its "swigluoai" wants gate/up interleaved
            name = {"swigluoai": "swigluoai_uninterleave"}.get(weights["activation"], weights["activation"])
            kwargs["activation"] = type(default)(name)
    elif weights["activation"] != "silu":
        return None
    for ours, theirs in (("w13_bias", "w1_bias"), ("w2_bias", "w2_bias")):
        if weights[ours] is not None:
            if theirs not in params:
                return None
            kwargs[theirs] = weights[ours]
    ids = inputs["topk_ids"].to(torch.int32)  # what vLLM's own top-k gives it
    return lambda: fused_experts(inputs["x"], weights["w13"], weights["w2"], inputs["topk_weights"], ids, **kwargs)


# ---- timing -----------------------------------------------------------------------------------------

def time_graph_us(calls: list, budget_s: float = 0.05) -> float:
    """Median microseconds per call: all ``calls`` captured in one CUDA graph, replayed (the quantized
    GEMM benchmark's timer)."""
    from quant_kernels import time_us  # benchmarks/ is this script's directory, first on sys.path

    return time_us(calls, budget_s)


def time_eager_us(calls: list, repeats: int = 3) -> float:
    """Median microseconds per call, eagerly (for code that synchronises with the host)."""
    for fn in calls:
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for fn in calls:
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples) * 1e3 / len(calls)


# ---- the comparison ---------------------------------------------------------------------------------

def run(models: list[str], token_counts: list[int], vllm_fn, bandwidth_tbs: float, with_ref: bool) -> list[dict]:
    from kvforge.layers.fused_moe import fused_experts, fused_experts_ref, pick_tiles

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model in models:
        weights = make_weights(model, g)
        for num_tokens in token_counts:
            inputs = [make_inputs(model, num_tokens, g) for _ in range(ROUTINGS)]
            nbytes = statistics.mean(min_bytes(model, weights, i) for i in inputs)
            experts, top_k = SHAPES[model][:2]
            row = dict(model=model, T=num_tokens, block_m=pick_tiles(num_tokens * top_k, experts).block_m,
                       min_bytes=nbytes, flops=flops(model, num_tokens))
            impls = {"kvforge": ([kvforge_call(fused_experts, weights, i) for i in inputs], time_graph_us)}
            if with_ref:
                impls["torch_ref"] = ([kvforge_call(fused_experts_ref, weights, i) for i in inputs[:2]], time_eager_us)
            if vllm_fn is not None:
                calls = [vllm_call(vllm_fn, weights, i) for i in inputs]
                impls["vllm"] = (calls, time_graph_us) if calls[0] is not None else None
            for name, impl in impls.items():
                if impl is None:
                    row[f"{name}_error"] = "this vLLM's fused_experts takes no activation/bias arguments"
                    continue
                try:
                    us = impl[1](impl[0])
                except Exception as exc:  # noqa: BLE001 - out of memory, or a vLLM that wants its config
                    row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    torch.cuda.empty_cache()
                    continue
                row[f"{name}_us"] = us
                row[f"{name}_roofline"] = nbytes / (us * 1e-6) / (bandwidth_tbs * 1e12)
                row[f"{name}_tflops"] = row["flops"] / (us * 1e-6) / 1e12
            for other in ("torch_ref", "vllm"):
                if f"{other}_us" in row and "kvforge_us" in row:
                    row[f"speedup_vs_{other}"] = row[f"{other}_us"] / row["kvforge_us"]
            rows.append(row)
            print_row(row)
            del inputs, impls
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()
    return rows


def print_row(row: dict) -> None:
    def cell(name):
        if f"{name}_us" not in row:
            return f"{'-' if f'{name}_error' not in row else 'error':>26}"
        return f"{row[f'{name}_us']:9.1f} {100 * row[f'{name}_roofline']:5.1f}% {row[f'{name}_tflops']:6.1f}TF"

    ratios = " ".join(f"{row[k]:6.2f}x" if k in row else f"{'-':>7}"
                      for k in ("speedup_vs_torch_ref", "speedup_vs_vllm"))
    print(f"{row['model']:>14} {row['T']:>5} {row['block_m']:>4} {row['min_bytes'] / 1e6:8.1f} "
          + " ".join(cell(n) for n in ("kvforge", "torch_ref", "vllm")) + f" {ratios}", flush=True)


# ---- the sweep --------------------------------------------------------------------------------------

@contextlib.contextmanager
def only_tiles(tiles):
    """Every call picks ``tiles`` (the module's table swapped for the block)."""
    from kvforge.layers import fused_moe

    saved = fused_moe.MOE_TILES
    fused_moe.MOE_TILES = {1 << 62: tiles}
    try:
        yield
    finally:
        fused_moe.MOE_TILES = saved


def sweep(models: list[str]) -> dict:
    """Per bucket: us summed over the models and token counts, per candidate; the fastest."""
    from kvforge.layers.fused_moe import MOE_TILES, MoeTiles, fused_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {model: make_weights(model, g) for model in models}
    results = {}
    for bucket, (averages, candidates) in SWEEP.items():
        block_m = MOE_TILES[bucket].block_m
        cases = []
        for model in models:
            experts, top_k = SHAPES[model][:2]
            for average in averages:
                num_tokens = max(1, round(average * experts / top_k))
                cases.append((model, num_tokens, [make_inputs(model, num_tokens, g) for _ in range(ROUTINGS)]))
        scores = {}
        for n_up, n_down, block_k, group_m, warps, stages in candidates:
            tiles = MoeTiles(block_m, n_up, n_down, block_k, group_m, warps, stages)
            try:
                with only_tiles(tiles):
                    scores[tiles] = sum(time_graph_us([kvforge_call(fused_experts, weights[m], i) for i in ins],
                                                      budget_s=0.02) for m, _, ins in cases)
            except Exception as exc:  # noqa: BLE001 - over the shared memory or registers: skipped
                print(f"  bucket {bucket}: {tiles} failed: {type(exc).__name__}", file=sys.stderr)
                continue
            print(f"  bucket {bucket}: {scores[tiles]:9.1f} us  {tiles}", flush=True)
        best = min(scores, key=scores.get)
        results[bucket] = dict(cases=[(m, t) for m, t, _ in cases], best=repr(best), best_us=scores[best],
                               scores={repr(t): us for t, us in scores.items()})
        print(f"    {bucket if bucket < 1 << 30 else '1 << 30'}: {best!r},  # {scores[best]:.1f} us over "
              f"{[(m, t) for m, t, _ in cases]}", flush=True)
        del cases
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts T (comma-separated)")
    ap.add_argument("--models", default=",".join(SHAPES), help="expert shapes (comma-separated)")
    ap.add_argument("--vllm-path", help="a directory to put first on sys.path for `import vllm`")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8,
                    help="the HBM bandwidth of the roofline, TB/s (4.8: H200; 3.35: H100 SXM)")
    ap.add_argument("--no-ref", action="store_true", help="leave out the torch reference (slow at large T)")
    ap.add_argument("--sweep", action="store_true", help="time tile candidates per BLOCK_M bucket instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    models = args.models.split(",")
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        sys.exit(f"--models: unknown {unknown}; known: {', '.join(SHAPES)}")
    if args.sweep:
        t0 = time.perf_counter()
        out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__, sweep={str(b): r for b, r in sweep(models).items()})
        print(f"\n{time.perf_counter() - t0:.0f} s")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        return
    token_counts = QUICK_TOKENS if args.quick else [int(t) for t in args.tokens.split(",")]
    vllm_fn = load_vllm(args.vllm_path)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, bandwidth_tbs=args.bandwidth_tbs, routings=ROUTINGS)
    if vllm_fn is not None:
        meta["vllm"] = getattr(sys.modules.get("vllm"), "__version__", "?")
    print(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}"
          + (f", vllm {meta['vllm']}" if "vllm" in meta else ""))
    print("cells: us / fraction of the HBM roofline / TFLOP/s; ratios: kvforge's speedup over torch_ref, vllm")
    print(f"{'model':>14} {'T':>5} {'BM':>4} {'MB':>8} {'kvforge':>26} {'torch_ref':>26} {'vllm':>26} "
          f"{'/ref':>7} {'/vllm':>7}")
    t0 = time.perf_counter()
    rows = run(models, token_counts, vllm_fn, args.bandwidth_tbs, with_ref=not args.no_ref)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
