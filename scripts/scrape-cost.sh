#!/usr/bin/env bash
# Scrape cost: kvrouter's CPU time per endpoint per second while it scrapes N idle simulated
# replicas (one kvsim process) at the configured interval (default 50 ms) and probes them
# (default 1 s). Usage: scripts/scrape-cost.sh [endpoints] [seconds] [kvrouter binary] [kvsim binary]
# Defaults: 64 endpoints, 60 s, target/release/kvrouter, target/release/kvsim. Linux only
# (reads /proc/PID/stat). Prints one line of JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-64}
SECS=${2:-60}
ROUTER=${3:-target/release/kvrouter}
KVSIM=${4:-target/release/kvsim}
BASE=19000
DIR=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$DIR"' EXIT

{
  echo "replicas:"
  for i in $(seq 1 "$N"); do
    echo "  - {name: r$i, listen: 127.0.0.1:$((BASE + i)), models: [demo-model]}"
  done
} > "$DIR/fleet.yaml"
{
  echo "server: {grpc_listen: 127.0.0.1:$BASE, admin_listen: 127.0.0.1:$((BASE + 999))}"
  echo "pools:"
  echo "  - name: p"
  echo "    models: [demo-model]"
  echo "    endpoints:"
  for i in $(seq 1 "$N"); do echo "      - address: 127.0.0.1:$((BASE + i))"; done
} > "$DIR/kvrouter.yaml"

"$KVSIM" --fleet "$DIR/fleet.yaml" > /dev/null 2> "$DIR/kvsim.log" & pids+=($!)
for _ in $(seq 100); do curl -fs -o /dev/null "http://127.0.0.1:$((BASE + N))/health" && break; sleep 0.1; done
"$ROUTER" serve -c "$DIR/kvrouter.yaml" > /dev/null 2> "$DIR/kvrouter.log" & pids+=($!)
RPID=$!
for _ in $(seq 100); do curl -fs -o /dev/null "http://127.0.0.1:$((BASE + 999))/readyz" && break; sleep 0.1; done
sleep 3 # every endpoint's loops started and their connections open

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
scrapes() {
  curl -fs "http://127.0.0.1:$((BASE + 999))/metrics" |
    awk '/^kvrouter_scrape_duration_seconds_count/ {s += $2} END {print s + 0}'
}
HZ=$(getconf CLK_TCK)
t0=$(ticks "$RPID"); k0=$(ticks "${pids[0]}"); s0=$(scrapes)
sleep "$SECS"
t1=$(ticks "$RPID"); k1=$(ticks "${pids[0]}"); s1=$(scrapes)
errors=$(curl -fs "http://127.0.0.1:$((BASE + 999))/metrics" | awk '/^kvrouter_scrape_errors_total/ {s += $2} END {print s + 0}')
python3 - "$N" "$SECS" "$HZ" "$t0" "$t1" "$k0" "$k1" "$s0" "$s1" "$errors" "$ROUTER" <<'PY'
import json, sys
n, secs, hz, t0, t1, k0, k1, s0, s1, errors, router = sys.argv[1:]
n, secs, hz = int(n), float(secs), float(hz)
cpu = (float(t1) - float(t0)) / hz
scrapes = float(s1) - float(s0)
print(json.dumps({
    "router": router,
    "endpoints": n,
    "seconds": secs,
    "router_cpu_s": round(cpu, 3),
    "router_cpu_fraction_of_one_core": round(cpu / secs, 4),
    "router_cpu_ms_per_endpoint_per_s": round(cpu / secs / n * 1e3, 4),
    "scrapes_per_s": round(scrapes / secs, 1),
    "router_cpu_us_per_scrape": round(cpu / scrapes * 1e6, 1) if scrapes else None,
    "scrape_errors_total": float(errors),
    "kvsim_cpu_fraction_of_one_core": round((float(k1) - float(k0)) / hz / secs, 4),
}))
PY
