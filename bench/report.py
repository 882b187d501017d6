"""Output of a benchmark: a fixed-width table on stdout, a JSON file, and an optional bar chart.

A result row is a dict: ``engine`` (label), numbers, latency summaries as ``{"mean", "p50", "p99",
"n"}`` dicts in milliseconds (``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``), and ``error`` when
the engine could not run (its other cells print as ``n/a``).
"""
from __future__ import annotations

import json
import math
import sys
import textwrap
from typing import Any, Callable

Column = tuple[str, int, Callable[[dict], str]]


def num(key: str, fmt: str = "{:,.2f}", scale: float = 1.0) -> Callable[[dict], str]:
    def cell(row: dict) -> str:
        v = row.get(key)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v * scale if scale != 1.0 else v)
    return cell


def pair(key: str) -> Callable[[dict], str]:
    """``p50/p99`` of a latency summary, in ms."""
    def cell(row: dict) -> str:
        s = row.get(key)
        return "n/a" if not s else f"{s['p50']:.1f}/{s['p99']:.1f}"
    return cell


def ratio(row: dict) -> str:
    v = row.get("ratio")
    return "n/a" if v is None else f"{v:.2f}x"


def fraction(key: str) -> Callable[[dict], str]:
    def cell(row: dict) -> str:
        v = row.get(key)
        return "n/a" if v is None else f"{v:.1%}"
    return cell


THROUGHPUT_COLUMNS: list[Column] = [
    ("engine", 40, lambda r: str(r["engine"])), ("seconds", 9, num("seconds")),
    ("output tok/s", 13, num("output_tok_s", "{:,.0f}")), ("total tok/s", 12, num("total_tok_s", "{:,.0f}")),
    ("req/s", 9, num("req_s")), ("TTFT ms p50/p99", 17, pair("ttft_ms")), ("TPOT ms p50/p99", 17, pair("tpot_ms")),
    ("ITL ms p50/p99", 17, pair("itl_ms")), ("vs kvforge", 11, ratio), ("of roofline", 12, fraction("roofline_frac")),
]

SERVE_COLUMNS: list[Column] = [
    ("engine", 30, lambda r: str(r["engine"])), ("client", 9, lambda r: str(r.get("client", "kvforge"))),
    ("seconds", 9, num("seconds")),
    ("ok/failed", 10, lambda r: f"{r.get('completed', 0)}/{r.get('failed', 0)}"),
    ("output tok/s", 13, num("output_tok_s", "{:,.0f}")), ("req/s", 9, num("req_s")),
    ("TTFT ms p50/p99", 17, pair("ttft_ms")), ("TPOT ms p50/p99", 17, pair("tpot_ms")),
    ("ITL ms p50/p99", 17, pair("itl_ms")), ("E2E ms p50/p99", 19, pair("e2e_ms")),
    ("cold start s", 13, num("cold_start_s")), ("of roofline", 12, fraction("roofline_frac")),
]


def spread(key: str, fmt: str = "{:.1f}") -> Callable[[dict], str]:
    """``median [min-max]`` over a sweep point's runs (``kvforge.bench.sweep.spread``)."""
    def cell(row: dict) -> str:
        s = row.get(key)
        if not s:
            return "n/a"
        return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"
    return cell


def rate(row: dict) -> str:
    r = row.get("request_rate")
    return "inf" if r is None or math.isinf(r) else f"{r:g}"


#: one row per (server, client, rate, concurrency) of ``bench serve``'s sweep: medians [spread] over runs
SWEEP_COLUMNS: list[Column] = [
    ("engine", 28, lambda r: str(r["engine"])), ("client", 8, lambda r: str(r["client"])),
    ("rate", 7, rate), ("conc", 6, lambda r: str(r["max_concurrency"] or "-")),
    ("runs", 6, lambda r: f"{r['runs_ok']}/{r['runs']}"), ("failed", 7, lambda r: str(r["failed"])),
    ("TTFT p50 ms", 22, spread("ttft_p50_ms")), ("TTFT p99 ms", 22, spread("ttft_p99_ms")),
    ("TPOT p50 ms", 20, spread("tpot_p50_ms", "{:.2f}")), ("ITL p50 ms", 20, spread("itl_p50_ms", "{:.2f}")),
    ("output tok/s", 24, spread("output_tok_s", "{:,.0f}")),
]

LATENCY_COLUMNS: list[Column] = [
    ("engine", 30, lambda r: str(r["engine"])), ("batch", 6, num("batch_size", "{:d}")),
    ("mean s", 9, num("latency_mean_s", "{:.3f}")), ("p50 s", 9, num("latency_p50_s", "{:.3f}")),
    ("p99 s", 9, num("latency_p99_s", "{:.3f}")), ("prefill s", 10, num("prefill_s", "{:.3f}")),
    ("decode step ms", 15, num("decode_step_s", "{:.2f}", 1e3)),
    ("floor ms", 10, num("decode_floor_s", "{:.2f}", 1e3)), ("x floor", 8, num("floor_ratio", "{:.2f}")),
    ("p50 vs kvforge", 15, num("vs_kvforge", "{:.2f}x")),
]


def format_table(rows: list[dict], columns: list[Column]) -> str:
    lines = ["".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w, _) in enumerate(columns))]
    for row in rows:
        cells = [f(row) for _, _, f in columns]
        lines.append("".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, (_, w, _)) in enumerate(zip(cells, columns))))
        if row.get("error"):
            client = f", {row['client']} client" if row.get("client") else ""
            lines.append(f"    {row['engine']}{client}: {row['error']}")
    return "\n".join(lines)


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def write_plot(path: str, rows: list[dict], key: str, label: str, title: str,
               reference: float | None = None, reference_label: str = "roofline") -> bool:
    """A bar chart of ``row[key]`` per engine (and a dashed line at ``reference``); False, with a
    message on stderr, if matplotlib is not installed (it is not a kvforge dependency)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed, so {path} was not written "
              "(pip install matplotlib to get plots)", file=sys.stderr)
        return False
    names = [r["engine"] for r in rows]
    values = [r.get(key) or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(rows)), 4.5))
    bars = ax.bar(range(len(rows)), values, color=["#3b6ea8"] + ["#9a9a9a"] * (len(rows) - 1))
    ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values])
    if reference:
        ax.axhline(reference, color="#c0392b", linestyle="--", label=f"{reference_label} {reference:,.0f}")
        ax.legend()
    ax.set_xticks(range(len(rows)), names, rotation=12, ha="right", fontsize=8)
    ax.set_ylabel(label)
    ax.set_title(textwrap.fill(title, 100), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
