"""What the GPUs' link gives NCCL on this machine, through the same private ProcessGroupNCCL objects the
engine uses: peer access, and all-reduce time per call, eager and replayed in a CUDA graph.

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
    if rank == 0:
        for r in rows:
            print("ROW", json.dumps(r), flush=True)
    pg.abort()


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
