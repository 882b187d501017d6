"""Top frames of a py-spy ``--format raw`` profile (one ``frame;frame;... count`` line per stack), by own
samples and by inclusive samples, each as a share of all samples; optionally one thread only.

    python benchmarks/pyspy_summary.py PROFILE.raw [--top 25] [--thread SUBSTRING]
"""
from __future__ import annotations

import argparse
import collections


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--thread", default=None, help="keep stacks whose first frame (the thread) contains this")
    args = p.parse_args()
    own, incl, threads, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in open(args.profile):
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        if args.thread and args.thread not in frames[0]:
            continue
        count = int(n)
        total += count
        threads[frames[0]] += count
        own[frames[-1]] += count
        for f in set(frames[1:]):
            incl[f] += count
    print(f"== {args.profile}: {total} samples")
    for title, counter in (("threads", threads), ("own", own), ("inclusive", incl)):
        print(f"-- top {title}")
        for f, n in counter.most_common(args.top):
            print(f"  {n / max(total, 1):6.1%}  {f[:160]}")


if __name__ == "__main__":
    main()
