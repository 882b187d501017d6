"""Where a tensor-parallel decode step's time goes, from the Chrome traces ``LLM.stop_profile(trace_dir)``
writes (``rank<r>.json``, one per rank; ``tp_peers.py --profile --trace-dir DIR`` makes them).

    python benchmarks/tp_trace_summary.py DIR

For each rank: the steps (a step starts at a CUDA graph launch, or at the first model kernel launch of an
eager step), the time between two steps' launches on the host, the host time from a step's launch call
to the next one spent in each top-level Python/torch op, the device's busy fraction and its gaps, and the
collectives' kernels (count and mean duration: a collective that waits for a slower rank is long). Then the
ranks side by side: how far apart in wall time each rank launched the same step (the profiler's clock is
the host's, shared by the processes).
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys

COLLECTIVE = ("nccl", "all_reduce", "allreduce", "one_shot", "two_shot", "broadcast")


def load(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(rank: str, events: list[dict]) -> list[float]:
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in complete if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime = [e for e in complete if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = sorted(e["ts"] for e in runtime if e["name"] in ("cudaGraphLaunch", "cuGraphLaunch"))
    print(f"== rank {rank}: {len(kernels)} kernels, {len(launches)} graph launches")
    if len(launches) > 1:
        gaps = [(b - a) / 1e3 for a, b in zip(launches, launches[1:])]
        print(f"   host: graph launch to the next: median {statistics.median(gaps):.3f} ms, "
              f"min {min(gaps):.3f}, max {max(gaps):.3f}")
    if kernels:
        start, end = kernels[0]["ts"], max(k["ts"] + k["dur"] for k in kernels)
        busy, cursor, idle = 0.0, start, []
        for k in kernels:
            if k["ts"] > cursor:
                idle.append(k["ts"] - cursor)
            busy += max(0.0, k["ts"] + k["dur"] - max(cursor, k["ts"]))
            cursor = max(cursor, k["ts"] + k["dur"])
        print(f"   device: busy {busy / (end - start):.0%} of {(end - start) / 1e3:.1f} ms; gaps over 50 us: "
              f"{sum(1 for g in idle if g > 50)} totalling {sum(g for g in idle if g > 50) / 1e3:.1f} ms")
        coll = collections.defaultdict(list)
        for k in kernels:
            if any(c in k["name"].lower() for c in COLLECTIVE):
                coll[k["name"][:70]].append(k["dur"])
        for name, durs in sorted(coll.items(), key=lambda kv: -sum(kv[1]))[:4]:
            print(f"   collective {name}: {len(durs)} x mean {statistics.mean(durs):.1f} us, "
                  f"median {statistics.median(durs):.1f} us, total {sum(durs) / 1e3:.1f} ms")
        by_name = collections.Counter()
        for k in kernels:
            by_name[k["name"][:60]] += k["dur"]
        for name, dur in by_name.most_common(6):
            print(f"   kernel {name}: {dur / 1e3:.1f} ms")
    host = collections.Counter()
    for e in complete:
        if e.get("cat") in ("python_function", "cpu_op", "user_annotation") and e.get("name", "").startswith(
                ("worker.py", "model_runner.py", "llm_engine.py", "step_codec.py", "batch_layout.py",
                 "rank_process.py", "multiproc.py", "input_buffers.py", "cuda_graphs.py", "stage_forward.py")):
            host[e["name"][:80]] += e["dur"]
    for name, dur in host.most_common(12):
        print(f"   host {name}: {dur / 1e3:.1f} ms")
    return launches


def main() -> None:
    d = sys.argv[1]
    ranks = sorted(f for f in os.listdir(d) if f.startswith("rank") and f.endswith(".json"))
    launches = {f: summarize(f[4:-5], load(os.path.join(d, f))) for f in ranks}
    if len(ranks) > 1:
        first, *rest = ranks
        for other in rest:
            a, b = launches[first], launches[other]
            n = min(len(a), len(b))
            if n:
                lag = [(b[-n + i] - a[-n + i]) / 1e3 for i in range(n)]
                print(f"== {other} launched each graph step {statistics.median(lag):+.3f} ms after {first} "
                      f"(median of the last {n}; min {min(lag):+.3f}, max {max(lag):+.3f})")


if __name__ == "__main__":
    main()
