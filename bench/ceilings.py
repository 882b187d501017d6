"""The two ceilings of the roofline (bench/metrics.py), chosen for the GPU the bench runs on.

A roofline is only as true as its ceilings: the copy bandwidth (bytes/s, bytes read + written) and
the bf16 matmul rate (FLOP/s) of *this* GPU. Before issue 37 every CUDA device got the H200's, so an
H100's "fraction of roofline" was measured against a GPU 40% faster at copying. Now, per ceiling:

1. ``--bandwidth`` / ``--flops`` win;
2. with ``--measure-ceilings`` the rest is measured on the spot (:func:`measure`: a device-to-device copy
   of a large buffer and a bf16 8192^3 matmul, the median of timed iterations after a warm-up);
3. else :data:`TABLE`, looked up by ``torch.cuda.get_device_name()`` (:func:`lookup`): figures measured on
   the lent H200 and H100 (shared/gpu/README.md), and datasheet-scaled estimates for other GPUs;
4. a GPU the table does not know (or a MIG slice, which has a fraction of the GPU) is measured.

On CPU only the flags count: without both there is no roofline, and the header says so.
"""
from __future__ import annotations

import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvforge.bench.metrics import H200_BANDWIDTH, H200_FLOPS

#: the measured/datasheet ratios of the two GPUs measured here (H200: copy 4.25 of 4.8 TB/s, matmul 779
#: of 989 TFLOP/s; H100 SXM: 3.0 of 3.35, 790 of 989), averaged: what a datasheet entry is scaled by
BANDWIDTH_EFFICIENCY = 0.89
FLOPS_EFFICIENCY = 0.79


@dataclass(frozen=True)
class GpuEntry:
    """One row of :data:`TABLE`: the device names it matches (every word of ``words`` in the name) and
    its ceilings, measured or scaled from the datasheet (``datasheet``: its TB/s and dense bf16 TFLOP/s)."""

    name: str
    words: tuple[str, ...]
    bandwidth: float
    flops: float
    datasheet: tuple[float, float] | None = None  # None: measured here

    @property
    def source(self) -> str:
        return f"table: {self.name}" + (" (datasheet-scaled estimate)" if self.datasheet else "")


def _scaled(name: str, words: tuple[str, ...], tb_s: float, tflops: float) -> GpuEntry:
    return GpuEntry(name, words, tb_s * 1e12 * BANDWIDTH_EFFICIENCY, tflops * 1e12 * FLOPS_EFFICIENCY, (tb_s, tflops))


#: first match wins, so a name's more specific entries come first (``H100 PCIe`` before ``H100``)
TABLE: tuple[GpuEntry, ...] = (
    _scaled("H200 NVL", ("h200", "nvl"), 4.8, 835),
    GpuEntry("H200", ("h200",), H200_BANDWIDTH, H200_FLOPS),  # measured on the lent H200
    _scaled("H100 PCIe", ("h100", "pcie"), 2.0, 756),
    _scaled("H100 NVL", ("h100", "nvl"), 3.9, 835),
    GpuEntry("H100 80GB HBM3", ("h100",), 3.0e12, 790e12),  # measured on the lent H100 (SXM)
    _scaled("A100 80GB PCIe", ("a100", "80gb", "pcie"), 1.935, 312),
    _scaled("A100 40GB PCIe", ("a100", "pcie"), 1.555, 312),
    _scaled("A100-SXM4-40GB", ("a100", "40gb"), 1.555, 312),
    _scaled("A100-SXM4-80GB", ("a100",), 2.039, 312),
    _scaled("L40S", ("l40s",), 0.864, 362),
    _scaled("B200", ("b200",), 8.0, 2250),
)


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


def lookup(device_name: str) -> GpuEntry | None:
    """The :data:`TABLE` entry for a ``torch.cuda.get_device_name()`` (case and punctuation ignored, so
    ``NVIDIA A100-SXM4-80GB`` and ``a100 sxm4 80gb`` match alike), or None: unknown, or a MIG slice."""
    words = _words(device_name)
    if "mig" in words:
        return None
    return next((e for e in TABLE if all(w in words for w in e.words)), None)


@dataclass(frozen=True)
class Ceilings:
    """The ceilings a bench uses, and where each came from; ``note`` says why there are none."""

    device: str
    bandwidth: float | None
    flops: float | None
    source: str
    note: str | None = None
    measured: dict | None = None  # :func:`measure`'s figures, when it ran

    @property
    def ok(self) -> bool:
        return bool(self.bandwidth and self.flops)

    def describe(self) -> str:
        """The header line every bench prints: the device, the ceilings, where they came from."""
        if not self.ok:
            return f"roofline n/a on {self.device} ({self.note})"
        return (f"roofline ceilings of {self.device}: {self.bandwidth / 1e12:.2f} TB/s copy, "
                f"{self.flops / 1e12:.0f} TFLOP/s bf16 matmul ({self.source})")

    def as_dict(self) -> dict:
        return {"device": self.device, "bandwidth": self.bandwidth, "flops": self.flops, "source": self.source,
                "note": self.note, "measured": self.measured}


def resolve(bandwidth: float | None, flops: float | None, device_type: str, device_name: str,
            measure_ceilings: bool = False, measurer: Callable[[], dict] | None = None) -> Ceilings:
    """The :class:`Ceilings` (module docstring for the order). ``measurer`` returns :func:`measure`'s
    dict; it is called at most once, and only on CUDA when a flag is missing and either
    ``measure_ceilings`` or an unknown device asks for it."""
    flags = {"bandwidth": bandwidth, "flops": flops}
    sources = {k: f"--{k}" for k, v in flags.items() if v is not None}
    if device_type != "cuda":
        if len(sources) == 2:
            return Ceilings(device_name, bandwidth, flops, "--bandwidth, --flops")
        why = ("--measure-ceilings measures CUDA devices only; " if measure_ceilings else "") + \
            "give --bandwidth and --flops"
        return Ceilings(device_name, None, None, "none", note=why)
    measured = None
    if len(sources) < 2:
        entry = None if measure_ceilings else lookup(device_name)
        if entry is not None:
            fill = {"bandwidth": entry.bandwidth, "flops": entry.flops}
            origin = entry.source
        else:
            origin = "measured" if measure_ceilings else f"measured: {device_name} is not in the table"
            try:
                if measurer is None:
                    raise RuntimeError("no way to measure was given")
                measured = measurer()
            except RuntimeError as exc:  # CUDA errors (out of memory) are RuntimeErrors
                return Ceilings(device_name, None, None, "none", note=f"measuring the ceilings failed: {exc}")
            fill = {"bandwidth": measured["bandwidth"], "flops": measured["flops"]}
        for key in flags:
            if flags[key] is None:
                flags[key], sources[key] = fill[key], origin
    if sources["bandwidth"] == sources["flops"]:
        source = sources["bandwidth"]
    elif all(s.startswith("--") for s in sources.values()):
        source = "--bandwidth, --flops"
    else:
        source = f"bandwidth {sources['bandwidth']}; flops {sources['flops']}"
    return Ceilings(device_name, flags["bandwidth"], flags["flops"], source, measured=measured)


# -- measuring -------------------------------------------------------------------------------------------
def copy_traffic_bytes(buffer_bytes: int) -> int:
    """Bytes a device-to-device copy of a buffer moves: each byte read once and written once (as the
    README's 4.25 TB/s counts them)."""
    return 2 * buffer_bytes


def matmul_flop_count(n: int) -> int:
    """FLOPs of an n x n by n x n matmul: a multiply and an add per (row, column, inner) triple."""
    return 2 * n ** 3


def rate(amount: float, seconds: list[float]) -> float:
    """``amount`` per second at the median of the timed iterations (the median, not the best, so that one
    lucky iteration does not set a ceiling the hardware does not hold)."""
    return amount / statistics.median(seconds)


def _timed(op: Callable[[], Any], device: Any, warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``op`` after ``warmup`` untimed ones: CUDA events on a GPU
    (the device time, no host overhead), ``perf_counter`` elsewhere."""
    import torch

    for _ in range(warmup):
        op()
    if device.type != "cuda":
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            op()
            out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        op()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _copy_seconds(device: Any, buffer_bytes: int, warmup: int, iters: int) -> list[float]:
    import torch

    src = torch.empty(buffer_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _timed(lambda: dst.copy_(src), device, warmup, iters)


def _matmul_seconds(device: Any, n: int, warmup: int, iters: int) -> list[float]:
    import torch

    # a, b, out: [n, n] bf16
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return _timed(lambda: torch.matmul(a, b, out=out), device, warmup, iters)


def measure(device: Any, buffer_bytes: int = 1 << 30, n: int = 8192, warmup: int = 5, iters: int = 20) -> dict:
    """Measure the two ceilings on ``device``: ``dst.copy_(src)`` of a ``buffer_bytes`` buffer (capped at
    an eighth of the free memory) and a bf16 ``n``^3 matmul. Returns ``{"bandwidth", "flops"}`` and what
    they came from; the tensors are freed after.

    NOTE: a short burst on purpose (about 30 ms of matmuls at the defaults), as the table's figures were
    taken. On the lent H200 (2026-12-04) it read 4.19-4.23 TB/s and 804-806 TFLOP/s over six calls a
    second apart; 70 back-to-back matmuls per call instead fell to 680-750 TFLOP/s, call after call, under
    the power limit, which would make the ceiling depend on how long and how often it is measured."""
    import torch

    if device.type == "cuda":
        buffer_bytes = min(buffer_bytes, torch.cuda.mem_get_info(device)[0] // 8)
    copy_s = _copy_seconds(device, buffer_bytes, warmup, iters)
    matmul_s = _matmul_seconds(device, n, warmup, iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"bandwidth": rate(copy_traffic_bytes(buffer_bytes), copy_s), "flops": rate(matmul_flop_count(n), matmul_s),
            "buffer_bytes": buffer_bytes, "matmul_n": n, "iters": iters,
            "copy_s_median": statistics.median(copy_s), "matmul_s_median": statistics.median(matmul_s)}


def for_device(args: Any, device: Any) -> Ceilings:
    """:func:`resolve` for a bench's flags (``--bandwidth``, ``--flops``, ``--measure-ceilings``) on the
    ``torch.device`` it runs on; says on stderr when it measures."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()

    def measurer() -> dict:
        print(f"measuring the roofline's ceilings on {name} (a copy of 1 GiB, a bf16 8192^3 matmul)", file=sys.stderr)
        return measure(device)

    return resolve(args.bandwidth, args.flops, device.type, name, args.measure_ceilings, measurer)
