#!/usr/bin/env bash
# First-figure router overhead: the same light load through (a) Envoy alone, (b) Envoy +
# kvrouter and (c) Envoy + a null endpoint picker (`kvbench null-extproc`: the same ext_proc
# messages, no work; what the protocol itself costs), to two simulated replicas whose clock runs
# 1000x fast (a near-zero-latency backend). Needs `wrk` (Debian: apt-get install wrk) and
# release binaries (`make release envoy`). Usage: scripts/overhead.sh [seconds] [connections]
# NO_OBSERVER=1 renders both attached Envoys without the response observer filter (one ext_proc
# stream per request instead of two), to measure what the observer costs.
# BODY_MODE=full-duplex renders the Envoy + kvrouter path with FULL_DUPLEX_STREAMED bodies (headers
# and body sent without waiting for the headers' reply: one round trip instead of two).
# EXTPROC=unix: both attached Envoys reach their picker (kvrouter's server.grpc_unix_socket, the
# null picker) over a Unix socket instead of loopback TCP, as a sidecar or same-host deployment can.
# EXTPROC=both: as by default, plus a fourth path, Envoy + the same kvrouter over its Unix socket.
# ALSO_BODY_MODE=streamed (or buffered, full-duplex): one more path, Envoy + the same kvrouter with
# its bodies in that mode, side by side with BODY_MODE's; SWAP=1 runs it before BODY_MODE's path.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
CONNS=${2:-8}
BIN=${BIN:-target/release}
ENVOY=.venv/bin/envoy
OBSERVER_FLAG=()
[ "${NO_OBSERVER:-0}" = 1 ] && OBSERVER_FLAG=(--no-observer)
BODY_MODE=${BODY_MODE:-buffered}
DIR=$(mktemp -d)
pids=()
EXTPROC=${EXTPROC:-tcp}
case "$EXTPROC" in tcp|unix|both) ;; *) echo "EXTPROC must be tcp, unix or both, not $EXTPROC" >&2; exit 2;; esac
ROUTER_AT=127.0.0.1:18310; NULL_AT=127.0.0.1:18312; UNIX_LINE=
[ "$EXTPROC" = tcp ] || UNIX_LINE="grpc_unix_socket: $DIR/kvrouter.sock, "
[ "$EXTPROC" = unix ] && ROUTER_AT="unix:$DIR/kvrouter.sock" && NULL_AT="unix:$DIR/null.sock"
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$DIR"' EXIT

cat > "$DIR/fleet.yaml" <<YAML
replicas:
  - {name: r1, listen: 127.0.0.1:18301, models: [demo-model], time_scale: 1000}
  - {name: r2, listen: 127.0.0.1:18302, models: [demo-model], time_scale: 1000}
YAML
cat > "$DIR/kvrouter.yaml" <<YAML
server: {${UNIX_LINE}grpc_listen: 127.0.0.1:18310, admin_listen: 127.0.0.1:18311}
envoy: {eds_path: $DIR/eds.json}
pools: [{name: p, models: [demo-model], endpoints: [{address: 127.0.0.1:18301}, {address: 127.0.0.1:18302}]}]
YAML
cat > "$DIR/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"model":"demo-model","max_tokens":1,"messages":[{"role":"system","content":"You are a helpful assistant that answers briefly."},{"role":"user","content":"What is the capital of France? Answer in one word."}]}'
LUA

"$BIN/kvsim" --fleet "$DIR/fleet.yaml" > /dev/null 2> "$DIR/kvsim.log" & pids+=($!)
"$BIN/kvrouter" serve -c "$DIR/kvrouter.yaml" > /dev/null 2> "$DIR/kvrouter.log" & pids+=($!)
"$BIN/kvbench" null-extproc --listen "$NULL_AT" --replica 127.0.0.1:18301 --replica 127.0.0.1:18302 \
  > /dev/null 2> "$DIR/null.log" & pids+=($!)
for u in http://127.0.0.1:18301/health http://127.0.0.1:18302/health http://127.0.0.1:18311/readyz; do
  for _ in $(seq 100); do curl -fs -o /dev/null "$u" && break; sleep 0.1; done
done
"$BIN/kvrouter" envoy-config --listen 127.0.0.1:18320 --admin 127.0.0.1:18321 --without-kvrouter \
  --replica 127.0.0.1:18301 --replica 127.0.0.1:18302 > "$DIR/alone.yaml"
"$BIN/kvrouter" envoy-config --listen 127.0.0.1:18330 --admin 127.0.0.1:18331 --extproc "$ROUTER_AT" \
  --eds "$DIR/eds.json" --body-mode "$BODY_MODE" "${OBSERVER_FLAG[@]}" > "$DIR/with.yaml"
"$BIN/kvrouter" envoy-config --listen 127.0.0.1:18340 --admin 127.0.0.1:18341 --extproc "$NULL_AT" \
  --replica 127.0.0.1:18301 --replica 127.0.0.1:18302 "${OBSERVER_FLAG[@]}" > "$DIR/null.yaml"
"$ENVOY" -c "$DIR/alone.yaml" --disable-hot-restart --concurrency 1 -l error --base-id 11 > "$DIR/e1.log" 2>&1 & pids+=($!)
"$ENVOY" -c "$DIR/with.yaml" --disable-hot-restart --concurrency 1 -l error --base-id 12 > "$DIR/e2.log" 2>&1 & pids+=($!)
"$ENVOY" -c "$DIR/null.yaml" --disable-hot-restart --concurrency 1 -l error --base-id 13 > "$DIR/e3.log" 2>&1 & pids+=($!)
READY=(http://127.0.0.1:18321/ready http://127.0.0.1:18331/ready http://127.0.0.1:18341/ready)
if [ "$EXTPROC" = both ]; then
  "$BIN/kvrouter" envoy-config --listen 127.0.0.1:18350 --admin 127.0.0.1:18351 --extproc "unix:$DIR/kvrouter.sock" \
    --eds "$DIR/eds.json" --body-mode "$BODY_MODE" "${OBSERVER_FLAG[@]}" > "$DIR/unix.yaml"
  "$ENVOY" -c "$DIR/unix.yaml" --disable-hot-restart --concurrency 1 -l error --base-id 14 > "$DIR/e4.log" 2>&1 & pids+=($!)
  READY+=(http://127.0.0.1:18351/ready)
fi
ALSO_BODY_MODE=${ALSO_BODY_MODE:-}
if [ -n "$ALSO_BODY_MODE" ]; then
  "$BIN/kvrouter" envoy-config --listen 127.0.0.1:18360 --admin 127.0.0.1:18361 --extproc "$ROUTER_AT" \
    --eds "$DIR/eds.json" --body-mode "$ALSO_BODY_MODE" "${OBSERVER_FLAG[@]}" > "$DIR/also.yaml"
  "$ENVOY" -c "$DIR/also.yaml" --disable-hot-restart --concurrency 1 -l error --base-id 15 > "$DIR/e5.log" 2>&1 & pids+=($!)
  also_pid=$!
  READY+=(http://127.0.0.1:18361/ready)
fi
for u in "${READY[@]}"; do
  for _ in $(seq 100); do curl -fs -o /dev/null "$u" && break; sleep 0.1; done
done
# pids: 0 kvsim, 1 kvrouter, 2 null picker, 3 Envoy alone, 4 Envoy + kvrouter, 5 Envoy + null,
# 6 Envoy + kvrouter over its Unix socket (EXTPROC=both).

# utime+stime ticks of the given pids.
cpu() {
  for pid in "$@"; do
    awk '{print $14 + $15}' "/proc/$pid/stat"
  done | tr '\n' ' '
}
# CPU seconds between two `cpu` readings.
spent() {
  paste <(echo "$1" | tr ' ' '\n') <(echo "$2" | tr ' ' '\n') | awk -v hz="$(getconf CLK_TCK)" 'NF == 2 {printf "%.2f ", ($2-$1)/hz} END {print ""}'
}

run() {
  local name=$1 port=$2
  wrk -t1 -c"$CONNS" -d2s -s "$DIR/post.lua" "http://127.0.0.1:$port/v1/chat/completions" > /dev/null  # warm-up
  echo "== $name"
  wrk -t1 -c"$CONNS" -d"${SECS}s" --latency -s "$DIR/post.lua" "http://127.0.0.1:$port/v1/chat/completions" \
    | grep -E "Requests/sec|Latency |50%|75%|90%|99%|Non-2xx"
}
echo "== direct to a replica"
wrk -t1 -c"$CONNS" -d"${SECS}s" --latency -s "$DIR/post.lua" http://127.0.0.1:18301/v1/chat/completions \
  | grep -E "Requests/sec|Latency |50%|99%|Non-2xx"
run "Envoy alone" 18320
run_also() {
  before=$(cpu "${pids[0]}" "${pids[1]}" "$also_pid")
  run "Envoy + kvrouter, $ALSO_BODY_MODE bodies" 18360
  after=$(cpu "${pids[0]}" "${pids[1]}" "$also_pid")
  echo "== CPU seconds during the $ALSO_BODY_MODE bodies run (kvsim kvrouter envoy):"
  spent "$before" "$after"
}
[ -n "$ALSO_BODY_MODE" ] && [ "${SWAP:-0}" = 1 ] && run_also
before=$(cpu "${pids[0]}" "${pids[1]}" "${pids[4]}")
run "Envoy + kvrouter" 18330
after=$(cpu "${pids[0]}" "${pids[1]}" "${pids[4]}")
echo "== CPU seconds during the Envoy + kvrouter run (kvsim kvrouter envoy):"
spent "$before" "$after"
[ -n "$ALSO_BODY_MODE" ] && [ "${SWAP:-0}" != 1 ] && run_also
before=$(cpu "${pids[0]}" "${pids[2]}" "${pids[5]}")
run "Envoy + null picker" 18340
after=$(cpu "${pids[0]}" "${pids[2]}" "${pids[5]}")
echo "== CPU seconds during the Envoy + null picker run (kvsim picker envoy):"
spent "$before" "$after"
if [ "$EXTPROC" = both ]; then
  before=$(cpu "${pids[0]}" "${pids[1]}" "${pids[6]}")
  run "Envoy + kvrouter over a Unix socket" 18350
  after=$(cpu "${pids[0]}" "${pids[1]}" "${pids[6]}")
  echo "== CPU seconds during the Unix socket run (kvsim kvrouter envoy):"
  spent "$before" "$after"
fi
echo "== kvrouter decision time"
curl -s http://127.0.0.1:18331/stats | grep -E "ext_proc.kvrouter\.(streams_started|streams_closed|failure_mode_allowed|message_timeouts|stream_msgs_sent|spurious)|upstream_rq_2xx|downstream_rq_2xx"
curl -s http://127.0.0.1:18311/metrics | grep -E "^kvrouter_decision_duration_seconds_(sum|count)|^kvrouter_streams"
