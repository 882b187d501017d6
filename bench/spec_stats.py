"""Speculative-decoding figures for ``kvforge bench``: what a run drafted and accepted, from the
engine's stats (throughput, latency) or from a server's ``/metrics`` (serve)."""
from __future__ import annotations

import re
from typing import Any

from kvforge.spec_decode.policy import SpecDecodeStats

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_delta(before: dict | None, after: dict | None) -> dict | None:
    """The run's share of ``engine.get_stats()["spec_decode"]`` (None when speculation is off)."""
    if not after:
        return None
    before = before or {k: 0 for k in COUNTERS} | {"accepted_by_position": [0] * len(after["accepted_by_position"])}
    d = {k: after[k] - before[k] for k in COUNTERS}
    d["accepted_by_position"] = [a - b for a, b in zip(after["accepted_by_position"], before["accepted_by_position"])]
    return derived(d)


def from_metrics(text: str) -> dict | None:
    """The speculative counters of a ``/metrics`` page (None when it has none)."""
    values = {}
    for k in COUNTERS:
        m = re.search(rf"^kvforge:spec_decode_{k}_total\{{[^}}]*\}} (\S+)$", text, flags=re.M)
        if m is None:
            return None
        values[k] = int(float(m.group(1)))
    pos = sorted((int(p), int(float(v))) for p, v in re.findall(
        r'^kvforge:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} (\S+)$', text,
        flags=re.M))
    values["accepted_by_position"] = [v for _, v in pos]
    return values


def derived(d: dict) -> dict:
    stats = SpecDecodeStats(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"])
    d["acceptance_rate"], d["mean_accepted_length"] = stats.acceptance_rate, stats.mean_accepted_length
    n = d["num_drafts"]
    d["acceptance_by_position"] = [a / n if n else 0.0 for a in d["accepted_by_position"]]
    return d


def describe(d: Any) -> str:
    if not d:
        return ""
    by_pos = ", ".join(f"{r:.0%}" for r in d["acceptance_by_position"])
    return (f"speculative decoding: {d['num_accepted_tokens']:,} of {d['num_draft_tokens']:,} draft tokens accepted "
            f"({d['acceptance_rate']:.1%}), mean accepted length {d['mean_accepted_length']:.2f} over "
            f"{d['num_drafts']:,} request-steps; by position {by_pos}")
