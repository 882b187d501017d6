"""What the GPUs' link gives NCCL on this machine, through the same private ProcessGroupNCCL objects the
engine uses: peer access, and all-reduce time per call, eager and replayed in a CUDA graph; then the same
for PyTorch's symmetric-memory all-reduces over peer memory (one-shot and two-shot, no multicast), with
their results checked against NCCL's.

    python benchmarks/nccl_probe.py [--gpus 2]     (NCCL_DEBUG=INFO shows the transport NCCL chose)

One JSON line per measurement on stdout, prefixed ``ROW``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def rank_main(rank: int, world: int, port: int) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    opts = dist.ProcessGroupNCCL.Options()
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("probe/", store), rank, world, opts)
    rows = []
    if rank == 0:
        rows.append({"peer_access": [torch.cuda.can_device_access_peer(0, j) for j in range(1, world)]})
    for numel in (4096, 256 * 4096, 16 * 2 ** 20):  # batch 1 and batch 256 of a 4096-wide bf16 hidden; 32 MiB
        x = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
        eager = timed(lambda x=x: pg.allreduce([x]).wait(), 50)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                pg.allreduce([x]).wait()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(64):  # one decode step of a 32-layer model: two all-reduces a layer
                pg.allreduce([x]).wait()
        in_graph = timed(graph.replay, 10) / 64
        nbytes = numel * 2
        rows.append({"bytes": nbytes, "eager_us": round(eager * 1e6, 1), "graph_us": round(in_graph * 1e6, 1),
                     "bus_GBps": round(2 * (world - 1) / world * nbytes / in_graph / 1e9, 1)})
    try:
        rows += symm_mem_rows(pg, store, rank, world)
    except Exception as exc:  # noqa: BLE001 - a probe: say what failed
        rows.append({"symm_mem_error": f"{type(exc).__name__}: {exc}"[:400]})
    if rank == 0:
        for r in rows:
            print("ROW", json.dumps(r), flush=True)
    pg.abort()


def symm_mem_rows(nccl, store, rank: int, world: int) -> list[dict]:
    """One-shot and two-shot all-reduce of torch's symmetric memory through a named group that wraps
    the private NCCL backend (the registration vLLM does for its stateless groups)."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed import ProcessGroup

    name = "probe-symm"
    group = ProcessGroup(dist.PrefixStore("probe-symm/", store), rank, world)
    group._set_default_backend(ProcessGroup.BackendType.NCCL)
    group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)
    cap = 16 * 2 ** 20
    buf = symm_mem.empty(cap, dtype=torch.bfloat16, device="cuda")
    hdl = symm_mem.rendezvous(buf, name)
    rows = [{"symm_mem_backend": str(getattr(symm_mem, "get_backend", lambda d: "?")("cuda")),
             "multicast_ptr": int(hdl.multicast_ptr)}]
    for numel in (4096, 32 * 4096, 256 * 4096, 2 ** 21):
        x = buf[:numel]
        out = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
        ref = torch.randn(numel, dtype=torch.bfloat16, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
        want = ref.float().clone()
        nccl.allreduce([want]).wait()

        def one_shot(x=x, out=out):
            torch.ops.symm_mem.one_shot_all_reduce_out(x, "sum", name, out)

        def two_shot(x=x):
            torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", name)

        row: dict = {"bytes": numel * 2}
        for label, fn, result in (("one_shot", one_shot, out), ("two_shot", two_shot, x)):
            x.copy_(ref)
            fn()
            torch.cuda.synchronize()
            row[f"{label}_max_err"] = round(float((result.float() - want).abs().max()), 4)
            row[f"{label}_eager_us"] = round(timed(fn, 50) * 1e6, 1)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                for _ in range(64):
                    fn()
            row[f"{label}_graph_us"] = round(timed(graph.replay, 10) / 64 * 1e6, 1)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    args = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args.gpus, port), nprocs=args.gpus)
    os._exit(0)


if __name__ == "__main__":
    main()
