#!/usr/bin/env python3
"""Repeats scripts/overhead.sh and reports medians with 95% bootstrap intervals.

One round of overhead.sh measures Envoy alone, Envoy + kvrouter and Envoy + a null endpoint
picker (the ext_proc protocol with no work behind it) on the same machine a few seconds apart;
on a noisy 2-core machine one round is not a verdict, so this runs several rounds and summarises
the paired differences (added p50/p99 latency, kept requests/s), for kvrouter and for the null
picker, and kvrouter against the null picker (its own share of the hop).

Usage: scripts/overhead_rounds.py [rounds] [seconds] [connections...]
  e.g. scripts/overhead_rounds.py 5 10 1 8   (needs `make release envoy` and wrk)
With EXTPROC=both in the environment it also reports kvrouter reached over its Unix socket,
against Envoy alone and against the same kvrouter over TCP in the same round. With
ALSO_BODY_MODE=<mode> it reports the same kvrouter with its bodies in that mode against the
BODY_MODE path of the same round (the two run in alternating order, round by round).
"""
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def to_ms(text):
    m = re.fullmatch(r"([0-9.]+)(us|ms|s)", text)
    if not m:
        raise ValueError(f"unreadable wrk latency {text!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def parse(out):
    """{section: {"p50": ms, "p99": ms, "rps": float, "non2xx": int}} from overhead.sh's output."""
    sections, cur = {}, None
    for line in out.splitlines():
        if line.startswith("== "):
            cur = sections.setdefault(line[3:].strip(), {"non2xx": 0})
            continue
        if cur is None:
            continue
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("50%", "99%"):
            cur["p" + parts[0][:-1]] = to_ms(parts[1])
        elif line.strip().startswith("Requests/sec:"):
            cur["rps"] = float(parts[-1])
        elif "Non-2xx" in line:
            cur["non2xx"] = int(parts[-1])
    return sections


def ci(values, stat=statistics.median, n=2000, seed=7):
    rng = random.Random(seed)
    boots = sorted(stat([rng.choice(values) for _ in values]) for _ in range(n))
    return stat(values), boots[int(0.025 * n)], boots[int(0.975 * n) - 1]


def fmt(t, unit=""):
    return f"{t[0]:.3g}{unit} [{t[1]:.3g}, {t[2]:.3g}]"


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    secs = sys.argv[2] if len(sys.argv) > 2 else "10"
    conns = sys.argv[3:] or ["1", "8"]
    rows, unix_rows, also_rows = [], [], []
    also_mode = os.environ.get("ALSO_BODY_MODE", "")
    for c in conns:
        unix_kept, unix_over_tcp, unix_added99 = [], [], []
        also_kept, also_over, also_added99 = [], [], []
        alone, with_, null, added50, added99, kept = [], [], [], [], [], []
        null99, null_kept, over_null99, over_null_kept = [], [], [], []
        for r in range(rounds):
            env = dict(os.environ, SWAP=str(r % 2))
            out = subprocess.run(
                [str(ROOT / "scripts/overhead.sh"), secs, c],
                cwd=ROOT, capture_output=True, text=True, check=True, env=env,
            ).stdout
            s = parse(out)
            a, w, n = s["Envoy alone"], s["Envoy + kvrouter"], s["Envoy + null picker"]
            if a["non2xx"] or w["non2xx"] or n["non2xx"]:
                sys.exit(f"round {r} c={c}: non-2xx answers (alone {a['non2xx']}, with "
                         f"{w['non2xx']}, null {n['non2xx']})")
            u = s.get("Envoy + kvrouter over a Unix socket")
            if u is not None:
                if u["non2xx"]:
                    sys.exit(f"round {r} c={c}: {u['non2xx']} non-2xx answers over the Unix socket")
                unix_kept.append(u["rps"] / a["rps"])
                unix_over_tcp.append(u["rps"] / w["rps"])
                unix_added99.append(u["p99"] - a["p99"])
            if also_mode:
                m = s[f"Envoy + kvrouter, {also_mode} bodies"]
                if m["non2xx"]:
                    sys.exit(f"round {r} c={c}: {m['non2xx']} non-2xx answers with {also_mode} bodies")
                also_kept.append(m["rps"] / a["rps"])
                also_over.append(m["rps"] / w["rps"])
                also_added99.append(m["p99"] - a["p99"])
                print(f"c={c} round {r + 1}/{rounds}: {also_mode} bodies p50 {m['p50']:.2f} "
                      f"p99 {m['p99']:.2f} ms {m['rps']:.0f}/s", flush=True)
            alone.append(a)
            with_.append(w)
            null.append(n)
            added50.append(w["p50"] - a["p50"])
            added99.append(w["p99"] - a["p99"])
            kept.append(w["rps"] / a["rps"])
            null99.append(n["p99"] - a["p99"])
            null_kept.append(n["rps"] / a["rps"])
            over_null99.append(w["p99"] - n["p99"])
            over_null_kept.append(w["rps"] / n["rps"])
            print(f"c={c} round {r + 1}/{rounds}: alone p50 {a['p50']:.2f} p99 {a['p99']:.2f} ms "
                  f"{a['rps']:.0f}/s; with kvrouter p50 {w['p50']:.2f} p99 {w['p99']:.2f} ms "
                  f"{w['rps']:.0f}/s; with the null picker p50 {n['p50']:.2f} p99 {n['p99']:.2f} "
                  f"ms {n['rps']:.0f}/s", flush=True)
        rows.append((c, alone, with_, null, added50, added99, kept, null99, null_kept,
                     over_null99, over_null_kept))
        if unix_kept:
            unix_rows.append((c, unix_added99, unix_kept, unix_over_tcp))
        if also_kept:
            also_rows.append((c, also_added99, also_kept, also_over))
    print()
    print(f"{rounds} rounds of {secs} s per arm; medians over rounds [95% bootstrap interval]")
    print("| c | Envoy alone p50 / p99 ms | req/s | + kvrouter p50 / p99 ms | req/s "
          "| added p50 ms | added p99 ms | req/s kept |")
    print("|---|---|---|---|---|---|---|---|")
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    for c, alone, with_, _, added50, added99, kept, *_ in rows:
        print(f"| {c} | {med(alone, 'p50'):.2f} / {med(alone, 'p99'):.2f} | {med(alone, 'rps'):.0f} "
              f"| {med(with_, 'p50'):.2f} / {med(with_, 'p99'):.2f} | {med(with_, 'rps'):.0f} "
              f"| {fmt(ci(added50))} | {fmt(ci(added99))} | {fmt(ci(kept))} |")
    print()
    print("The null picker (the ext_proc protocol alone), and kvrouter against it:")
    print("| c | + null p50 / p99 ms | req/s | null: added p99 ms | null: req/s kept "
          "| kvrouter over null: p99 ms | kvrouter / null req/s |")
    print("|---|---|---|---|---|---|---|")
    for c, _, _, null, _, _, _, null99, null_kept, over_null99, over_null_kept in rows:
        print(f"| {c} | {med(null, 'p50'):.2f} / {med(null, 'p99'):.2f} | {med(null, 'rps'):.0f} "
              f"| {fmt(ci(null99))} | {fmt(ci(null_kept))} | {fmt(ci(over_null99))} "
              f"| {fmt(ci(over_null_kept))} |")
    if unix_rows:
        print()
        print("kvrouter reached over its Unix socket (the same process, the same round):")
        print("| c | added p99 ms | req/s kept | req/s over the TCP path |")
        print("|---|---|---|---|")
        for c, added99, kept, over_tcp in unix_rows:
            print(f"| {c} | {fmt(ci(added99))} | {fmt(ci(kept))} | {fmt(ci(over_tcp))} |")

    if also_rows:
        print()
        print(f"kvrouter with {also_mode} bodies (the same process, the same round):")
        print(f"| c | added p99 ms | req/s kept | req/s over the "
              f"{os.environ.get('BODY_MODE', 'buffered')} path |")
        print("|---|---|---|---|")
        for c, added99, kept, over in also_rows:
            print(f"| {c} | {fmt(ci(added99))} | {fmt(ci(kept))} | {fmt(ci(over))} |")


if __name__ == "__main__":
    main()
