"""The serving sweep of ``kvforge bench serve``: which loads run, and what the report makes of them.

One *run* is one load (``--num-prompts`` requests) sent by one client to one server. A *point* is a
(request rate, most in flight) pair: every rate of ``--request-rates`` with every limit of
``--concurrencies``. Each point runs ``--runs`` times (default 3 in a sweep), and every run of every point
gets requests of its own: run k of point p is seeded ``--seed + p * runs + k``, the same seed for every
server and client, so each engine gets the very same requests and no run is served from a prefix cache
an earlier run filled. A noisy machine moves one run; so the report gives, per (point, server, client),
the median over runs and their spread (min-max) of TTFT p50 and p99, TPOT p50, ITL p50 and output
tokens/s (:func:`aggregate`), and the JSON keeps every run.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from kvforge.bench.metrics import percentile

#: who sends the load: kvforge's own client (bench/serve.py) or ``vllm bench serve`` (bench/vllm_client.py)
CLIENTS = ("kvforge", "vllm")
#: kvforge workloads vLLM's random dataset can draw (bench/vllm_client.py)
VLLM_DATASETS = ("fixed", "uniform", "shared-prefix")


@dataclass(frozen=True)
class Plan:
    """The runs of one ``bench serve``: ``points`` x ``runs`` x ``clients``, on every server in turn."""

    rates: tuple[float, ...]
    concurrencies: tuple[int | None, ...]  # None: no limit
    runs: int
    clients: tuple[str, ...]
    #: report medians and spreads (a sweep flag or --runs > 1), not one row per run
    aggregated: bool

    @property
    def points(self) -> list[tuple[float, int | None]]:
        return [(rate, limit) for rate in self.rates for limit in self.concurrencies]

    def seed_offset(self, point: int, run: int) -> int:
        """Added to ``--seed`` for run ``run`` of point ``point``: the index of its workload."""
        return point * self.runs + run

    @property
    def num_workloads(self) -> int:
        return len(self.points) * self.runs


def plan_of(args: argparse.Namespace) -> Plan:
    """The :class:`Plan` of ``bench serve``'s flags; ``ValueError`` naming the flag, before anything starts."""
    rates = args.request_rates or [args.request_rate]
    rate_flag = "--request-rates" if args.request_rates else "--request-rate"
    for rate in rates:
        if not rate > 0:
            raise ValueError(f"{rate_flag}: must be > 0 (inf sends every request at once), got {rate}")
    limits = args.concurrencies or [args.max_concurrency]
    limit_flag = "--concurrencies" if args.concurrencies else "--max-concurrency"
    for limit in limits:
        if limit is not None and limit < 1:
            raise ValueError(f"{limit_flag}: must be >= 1, got {limit}")
    swept = bool(args.request_rates or args.concurrencies)
    runs = args.runs if args.runs is not None else (3 if swept else 1)
    if runs < 1:
        raise ValueError(f"--runs: must be >= 1, got {runs}")
    clients = args.client or (list(CLIENTS) if "vllm" in args.vs else ["kvforge"])
    for client in clients:
        if client not in CLIENTS:
            raise ValueError(f"--client: {client!r} is not one of {', '.join(CLIENTS)}")
    if "vllm" in clients and args.dataset not in VLLM_DATASETS:
        raise ValueError(f"--client vllm: vLLM's random dataset has no {args.dataset!r} workload "
                         f"(it has {', '.join(VLLM_DATASETS)})")
    return Plan(tuple(rates), tuple(limits), runs, tuple(dict.fromkeys(clients)), swept or runs > 1)


def _latency(key: str, stat: str) -> Callable[[dict], float | None]:
    return lambda run: (run.get(key) or {}).get(stat)


#: what the report aggregates over runs: name -> that figure of one run record
STATS: dict[str, Callable[[dict], float | None]] = {
    "ttft_p50_ms": _latency("ttft_ms", "p50"), "ttft_p99_ms": _latency("ttft_ms", "p99"),
    "tpot_p50_ms": _latency("tpot_ms", "p50"), "itl_p50_ms": _latency("itl_ms", "p50"),
    "output_tok_s": lambda run: run.get("output_tok_s"),
}


def spread(values: list[float]) -> dict | None:
    """``{"median", "min", "max", "n"}`` of the runs' values; None if there are none."""
    if not values:
        return None
    return {"median": percentile(values, 50), "min": min(values), "max": max(values), "n": len(values)}


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (server, client, rate, concurrency), in the order the runs ran: :data:`STATS` as a
    :func:`spread` over its runs that ran (a run with an ``error`` has no figures and is counted apart;
    a run with failed requests counts, on the requests that completed, and ``failed`` sums them)."""
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        key = (rec["engine"], rec["client"], rec["request_rate"], rec["max_concurrency"])
        groups.setdefault(key, []).append(rec)
    rows = []
    for (engine, client, rate, limit), runs in groups.items():
        ran = [r for r in runs if not r.get("error")]
        row = {"engine": engine, "client": client, "request_rate": rate, "max_concurrency": limit,
               "runs_ok": len(ran), "runs": len(runs), "failed": sum(r.get("failed", 0) for r in ran),
               "run_errors": [r["error"] for r in runs if r.get("error")]}
        for name, figure in STATS.items():
            row[name] = spread([v for v in (figure(r) for r in ran) if v is not None])
        rows.append(row)
    return rows
