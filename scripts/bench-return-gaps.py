#!/usr/bin/env python3
"""Where a prefix group's next request went, by the time since the group's previous one.

Usage: scripts/bench-return-gaps.py OUT/results.json [CACHED_TOKENS_FOR_A_HIT]

Per policy label, all seeds pooled: every answered request of a group seen before, bucketed by
the (client-side) time since the group's previous request in 15 s steps, counted as sent to the
previous request's replica and a hit there (cached tokens at least the threshold, default 5000:
a shared-prefix workload's system prompt), sent there and a miss, or moved to another replica.
A policy that moves a group whose holder still had its prefix shows as moves at gaps where
another policy still hits.
"""
import collections
import json
import sys


def main():
    res = json.load(open(sys.argv[1]))
    hit_at = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    counts = collections.defaultdict(collections.Counter)
    for run in res["runs"]:
        recs = sorted(
            (r for r in run["records"] if r["status"] == 200 and r.get("first_token_ms") is not None),
            key=lambda r: r["sent_ms"],
        )
        last = {}
        for r in recs:
            prev = last.get(r["group"])
            if prev is not None:
                bucket = min(int((r["sent_ms"] - prev[1]) / 1000 // 15), 6)
                same = r["replica"] == prev[0]
                hit = (r.get("cached_tokens") or 0) >= hit_at
                counts[run["label"]][(bucket, same, hit)] += 1
            last[r["group"]] = (r["replica"], r["sent_ms"])
    for label, c in sorted(counts.items()):
        print(label)
        for b in range(7):
            hit, miss = c[(b, True, True)], c[(b, True, False)]
            moved = c[(b, False, False)] + c[(b, False, True)]
            top = "+" if b == 6 else f"-{b * 15 + 15:3d}"
            print(f"  gap {b * 15:3d}{top}s: same-hit {hit:4d} same-miss {miss:4d} moved {moved:4d}"
                  f"  hit% {100 * hit / max(1, hit + miss + moved):.0f}")


if __name__ == "__main__":
    main()
