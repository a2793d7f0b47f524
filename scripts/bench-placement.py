#!/usr/bin/env python3
"""Where each policy put a kvbench run's requests, from its per-request records.

Usage: scripts/bench-placement.py OUT/results.json [CACHED_TOKENS_FOR_A_HIT]

Per run (policy, seed): TTFT p50 / p90 / mean over every answered request (warm-up included,
unlike the report), hits (the replica's cached tokens at least the threshold, default 5000: a
shared-prefix workload's system prompt) and misses with their TTFT, per replica the requests,
the uncached (computed) prompt kilotokens and the decoded kilotokens, how many replicas each
prefix group was sent to, and the prefill tokens in flight on the pick when a request was sent
against the least on any replica then (from the records' send and first-token times).
"""
import collections
import json
import statistics as st
import sys


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    res = json.load(open(sys.argv[1]))
    hit_at = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    runs = res["runs"] if isinstance(res, dict) and "runs" in res else res
    for run in sorted(runs, key=lambda r: (r["seed"], r["label"])):
        recs = [r for r in run["records"] if r["status"] == 200 and r.get("first_token_ms") is not None]
        if not recs:
            print(f"{run['label']} seed {run['seed']}: no answered requests")
            continue
        ttft = lambda r: r["first_token_ms"] - r["sent_ms"]
        cached = lambda r: r.get("cached_tokens") or 0
        reps = sorted({r["replica"] for r in recs})
        n, work, dec = collections.Counter(), collections.Counter(), collections.Counter()
        groups = collections.defaultdict(set)
        for r in recs:
            n[r["replica"]] += 1
            work[r["replica"]] += (r.get("prompt_tokens") or 0) - cached(r)
            dec[r["replica"]] += r.get("completion_tokens") or 0
            groups[r["group"]].add(r["replica"])
        hits = [ttft(r) for r in recs if cached(r) >= hit_at]
        misses = [ttft(r) for r in recs if cached(r) < hit_at]
        by_sent = sorted(recs, key=lambda r: r["sent_ms"])
        ahead_pick, ahead_min = [], []
        for i, r in enumerate(by_sent):
            t = r["sent_ms"]
            ahead = collections.Counter()
            for o in by_sent[:i]:
                if o["first_token_ms"] > t:
                    ahead[o["replica"]] += (o.get("prompt_tokens") or 0) - cached(o)
            ahead_pick.append(ahead[r["replica"]])
            ahead_min.append(min(ahead[x] for x in reps))
        t = [ttft(r) for r in recs]
        spread = dict(sorted(collections.Counter(len(v) for v in groups.values()).items()))
        mean = lambda xs: st.mean(xs) if xs else float("nan")
        print(f"{run['label']} seed {run['seed']}: {len(recs)} answered, TTFT p50 {pct(t, .5):.0f} "
              f"p90 {pct(t, .9):.0f} mean {mean(t):.0f}; hits {len(hits)} (mean {mean(hits):.0f}), "
              f"misses {len(misses)} (mean {mean(misses):.0f})")
        print(f"  per replica: requests {[n[x] for x in reps]}, computed ktok "
              f"{[round(work[x] / 1000) for x in reps]}, decoded ktok {[round(dec[x] / 1000) for x in reps]}")
        print(f"  groups by replicas used {spread}; prefill tokens ahead on the pick at send "
              f"{mean(ahead_pick):.0f} vs least on any replica {mean(ahead_min):.0f}")


if __name__ == "__main__":
    main()
