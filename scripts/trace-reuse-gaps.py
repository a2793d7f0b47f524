#!/usr/bin/env python3
"""How long after a turn its follow-up comes, in a Mooncake-format trace.

For each request of the window [start_s, end_s) that shares more than its first block with an
earlier request of the trace, the time since the last request holding that longest shared
prefix (hash-id chain); and how many seconds of the window's input a token cache of N tokens
holds. Sizes `models[].token_cache_tokens` (docs/envoy.md, "One long message").

  scripts/trace-reuse-gaps.py ../shared/traces/mooncake-conversation.jsonl 600 900 1048576 4194304
"""
import json
import sys


def main() -> None:
    path, start_s, end_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    caches = [int(c) for c in sys.argv[4:]]
    seen: dict[tuple, float] = {}
    gaps, inputs = [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            t = r["timestamp"] / 1000.0
            ids = r["hash_ids"]
            shared, last = 0, None
            for i in range(len(ids)):
                key = tuple(ids[: i + 1])
                if key not in seen:
                    break
                shared, last = i + 1, seen[key]
            if start_s <= t < end_s:
                inputs.append(r["input_length"])
                if shared > 1:
                    gaps.append(t - last)
            for i in range(len(ids)):
                seen[tuple(ids[: i + 1])] = t
    gaps.sort()
    q = lambda p: gaps[min(len(gaps) - 1, int(len(gaps) * p))]
    print(f"{len(inputs)} requests, {len(gaps)} share more than the first block with an earlier one")
    print("gap s: p10 %.0f p25 %.0f p50 %.0f p75 %.0f p90 %.0f" % tuple(q(p) for p in (0.1, 0.25, 0.5, 0.75, 0.9)))
    per_s = sum(inputs) / (end_s - start_s)
    print(f"input tokens per second of trace time: {per_s:.0f}")
    for c in caches:
        print(f"a {c}-token cache holds {c / per_s:.0f} s of it")


if __name__ == "__main__":
    main()
