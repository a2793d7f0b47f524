#!/usr/bin/env bash
# The local stack, in the foreground: four simulated replicas (8001-8004), kvrouter (ext_proc on
# 9002, admin on 9090) and Envoy (8080). Ctrl-C stops everything this script started.
# kvrouter is supervised: when it exits (crash, kill -9) it is restarted after a short backoff,
# and Envoy keeps serving meanwhile through its fail-open fallback (least-request over the
# replicas). Envoy or the replicas exiting stops the stack.
# Run from the repository root after `make release envoy` (`make run` does both).
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release}
ENVOY=${ENVOY:-.venv/bin/envoy}
RUN=.run
mkdir -p "$RUN"
pids=()

stop() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'echo; echo "stopping..."; stop; exit 0' INT TERM
trap stop EXIT

# Waits until $1 answers HTTP on $2 (a URL), or fails after 30 s.
wait_http() {
  local what=$1 url=$2
  for _ in $(seq 1 300); do
    if curl -fsS -o /dev/null "$url" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$what did not come up ($url); logs are in $RUN/" >&2
  exit 1
}

"$BIN/kvsim" --fleet examples/fleet.yaml > "$RUN/kvsim.out" 2> "$RUN/kvsim.log" &
pids+=($!)
for port in 8001 8002 8003 8004; do wait_http "replica :$port" "http://127.0.0.1:$port/health"; done

# Runs kvrouter, and again whenever it exits: after 1 s, doubling up to 8 s while it keeps
# failing, back to 1 s once a run lasted 30 s. Its pid is in $RUN/kvrouter.pid.
supervise_kvrouter() {
  local pid= backoff=1 started status
  trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; exit 0' INT TERM
  : > "$RUN/kvrouter.out"
  : > "$RUN/kvrouter.log"
  while true; do
    started=$(date +%s)
    "$BIN/kvrouter" serve --config examples/kvrouter.yaml >> "$RUN/kvrouter.out" 2>> "$RUN/kvrouter.log" &
    pid=$!
    echo "$pid" > "$RUN/kvrouter.pid"
    status=0
    wait "$pid" || status=$?
    if [ $(($(date +%s) - started)) -ge 30 ]; then backoff=1; fi
    echo "$(date '+%H:%M:%S') kvrouter exited (status $status); restarting it in ${backoff} s," \
      "Envoy serves through its fallback meanwhile" | tee -a "$RUN/kvrouter.log" >&2
    sleep "$backoff" &
    wait $! || true
    backoff=$((backoff < 8 ? backoff * 2 : 8))
  done
}
supervise_kvrouter &
pids+=($!)
wait_http kvrouter http://127.0.0.1:9090/readyz

"$ENVOY" -c envoy/local-stack.yaml --disable-hot-restart -l warning > "$RUN/envoy.log" 2>&1 &
pids+=($!)
wait_http Envoy http://127.0.0.1:9901/ready

cat <<MSG
kvrouter local stack is up (logs in $RUN/):
  Envoy            http://127.0.0.1:8080   (admin http://127.0.0.1:9901)
  kvrouter admin   http://127.0.0.1:9090/metrics  /debug/endpoints
  replicas         http://127.0.0.1:8001-8004 (demo-model)
Try:
  curl -s http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"demo-model","messages":[{"role":"user","content":"hello"}],"max_tokens":8}' -i
kvrouter is supervised: kill it (kill -9 \$(cat $RUN/kvrouter.pid)) and requests keep getting
answered through Envoy's fallback until it is back.
Ctrl-C stops everything.
MSG

# Exit (stopping the rest) as soon as Envoy or the replicas die; kvrouter's supervisor never does.
wait -n "${pids[@]}"
echo "a component exited; stopping the stack (see $RUN/*.log)" >&2
exit 1
