"""A ``torch.profiler`` trace of one rank, between ``LLM.start_profile`` and ``LLM.stop_profile``.

Every rank traces itself (the calls go to all of them, ``collective_rpc``), so a tensor-parallel or
pipeline run gives one trace per rank, named by it.
"""
from __future__ import annotations

import os

import torch
from torch.profiler import ProfilerActivity, profile


class RankProfiler:
    """Host and, on CUDA, device activity of one rank, from :meth:`start` to :meth:`stop`."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._trace: profile | None = None

    def start(self) -> None:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._trace = profile(activities=acts)
        self._trace.start()

    def stop(self, trace_dir: str | None = None, row_limit: int = 12) -> str:
        """Stop the trace; write ``rank<r>.json`` (Chrome trace) into ``trace_dir`` if given. Returns the
        rank's busiest operations, by device time then by host time, as text."""
        trace, self._trace = self._trace, None
        if trace is None:
            raise RuntimeError(f"rank {self.rank}: stop_profile without start_profile")
        trace.stop()
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            trace.export_chrome_trace(os.path.join(trace_dir, f"rank{self.rank}.json"))
        avg = trace.key_averages()
        keys = (["self_cuda_time_total"] if self.device.type == "cuda" else []) + ["self_cpu_time_total"]
        return f"rank {self.rank}\n" + "\n".join(avg.table(sort_by=k, row_limit=row_limit) for k in keys)
