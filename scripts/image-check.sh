#!/usr/bin/env bash
# Builds kvrouter's and kvsim's images from deploy/Dockerfile with podman and runs them the way a
# cluster would: read-only root file system, no capabilities, non-root, config and tokenizer files
# mounted read-only, the EDS file on a tmpfs. Checks `--version`, waits for kvrouter's /readyz,
# then sends one request through a real Envoy (rendered by the image's own `kvrouter
# envoy-config`) to the containerised kvrouter and kvsim, and bakes tokenizers into a derived
# image (deploy/tokenizers.Dockerfile) that `check-config` accepts. `make image-check` runs it
# (and installs podman, runc and debootstrap first); it fails, never skips, when a part is missing.
#
# Base images cannot be pulled on these machines, so the script makes them from Debian's packages
# the first time (debootstrap, about 1-2 minutes) and tags them with the names the Dockerfile's
# FROM lines use; the Rust builder base is that plus the host's own toolchain
# (scripts/image-bases/rust-builder.Containerfile). Images and the build cache are kept in
# podman's storage, so later runs rebuild only what changed.
#
# Environment: ENVOY (default .venv/bin/envoy), TOKENIZERS (default .cache/tokenizers),
# IMAGE_TAG: keep the built images under this tag (by default they get a tag unique to this run,
# removed at the end, so concurrent checks on one machine never test each other's images).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${ENVOY:-.venv/bin/envoy}
TOKENIZERS=${TOKENIZERS:-.cache/tokenizers}
TAG=${IMAGE_TAG:-check-$$}
KVROUTER_IMAGE=localhost/kvrouter:$TAG
KVSIM_IMAGE=localhost/kvsim:$TAG
BAKED_IMAGE=localhost/kvrouter-tokenizers:$TAG

fail() {
  echo "image-check: $*" >&2
  exit 1
}
for tool in podman runc curl python3; do
  command -v "$tool" >/dev/null || fail "$tool is missing (make image-check installs podman and runc: apt-get install podman runc debootstrap)"
done
[ -x "$ENVOY" ] || fail "no Envoy at $ENVOY (make envoy)"
[ -f "$TOKENIZERS/qwen3/tokenizer.json" ] || fail "no tokenizer at $TOKENIZERS/qwen3 (make tokenizers)"
TOKENIZERS=$(readlink -f "$TOKENIZERS")

started=$(date +%s)
phase_start=$started
phase() {
  local now
  now=$(date +%s)
  echo "image-check: $1 ($((now - phase_start)) s)"
  phase_start=$now
}

work=$(mktemp -d /tmp/kvrouter-image-check.XXXXXX)
containers=()
envoy_pid=
cleanup() {
  local rc=$?
  if [ $rc -ne 0 ]; then
    for c in "${containers[@]}"; do
      echo "--- logs of $c" >&2
      pod logs "$c" 2>&1 | tail -n 30 >&2 || true
    done
    [ -f "$work/envoy.log" ] && { echo "--- Envoy log" >&2; tail -n 30 "$work/envoy.log" >&2; }
  fi
  [ -n "$envoy_pid" ] && kill "$envoy_pid" 2>/dev/null || true
  for c in "${containers[@]}"; do pod rm -f "$c" >/dev/null 2>&1 || true; done
  if [ -z "${IMAGE_TAG:-}" ]; then
    # The derived image first: it is built on the kvrouter image. The build cache stays.
    pod rmi "$BAKED_IMAGE" "$KVROUTER_IMAGE" "$KVSIM_IMAGE" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT

# podman as it works on these machines (see FACTS: no systemd cgroups, no ulimit defaults).
printf '[containers]\ndefault_ulimits = []\n' >"$work/containers.conf"
export CONTAINERS_CONF=$work/containers.conf
pod() { podman --runtime runc --cgroup-manager cgroupfs "$@"; }

# The base image names, as the Dockerfile's ARG defaults spell them, fully qualified the way
# podman resolves a short name.
arg_default() { sed -n "s/^ARG $1=//p" deploy/Dockerfile | head -n 1; }
qualify() { case $1 in */*) echo "$1" ;; *) echo "docker.io/library/$1" ;; esac; }
RUNTIME_BASE=$(qualify "$(arg_default RUNTIME_IMAGE)")
RUST_BASE=$(qualify "$(arg_default RUST_IMAGE)")
[ "$RUNTIME_BASE" != docker.io/library/ ] && [ "$RUST_BASE" != docker.io/library/ ] ||
  fail "cannot read the base image names from deploy/Dockerfile"

# --- Base images -------------------------------------------------------------------------------
if ! pod image exists "$RUNTIME_BASE"; then
  command -v debootstrap >/dev/null || fail "debootstrap is missing (apt-get install debootstrap)"
  echo "image-check: making $RUNTIME_BASE from Debian packages (debootstrap, once)"
  rootfs=$work/rootfs
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
    { tail -n 20 "$work/debootstrap.log" >&2; fail "debootstrap failed"; }
  # Trim it toward the official slim image: no package cache, lists, docs or man pages.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
  tar -C "$rootfs" -c . | pod import --change 'CMD ["bash"]' - "$RUNTIME_BASE" >/dev/null
  rm -rf "$rootfs"
  phase "base image $RUNTIME_BASE made"
fi

sysroot=$(rustc --print sysroot)
toolchain=$(rustc --version)
host_minor=$(rustc --version | sed -E 's/^rustc ([0-9]+\.[0-9]+).*/\1/')
case $RUST_BASE in
  *":$host_minor-"*) ;;
  *)
    # The host has another toolchain than the Dockerfile names: stand in under the host's name.
    RUST_BASE=docker.io/library/rust:$host_minor-bookworm
    echo "image-check: host toolchain is $toolchain; building with --build-arg RUST_IMAGE=$RUST_BASE"
    ;;
esac
# Our stand-in carries the toolchain it was made from; a real rust image (no label) is kept.
made_from=$(pod image inspect --format '{{index .Labels "kvrouter.toolchain"}}' "$RUST_BASE" 2>/dev/null || echo missing)
if [ "$made_from" = missing ] || { [ -n "$made_from" ] && [ "$made_from" != "$toolchain" ]; }; then
  echo "image-check: making $RUST_BASE from $RUNTIME_BASE and the host toolchain ($toolchain)"
  host_ca=()
  [ -d /usr/local/share/ca-certificates ] && host_ca=(-v /usr/local/share/ca-certificates:/tmp/host-ca:ro)
  pod build --quiet --pull=never --network host --build-arg "BASE=$RUNTIME_BASE" "${host_ca[@]}" \
    --label "kvrouter.toolchain=$toolchain" \
    -f "$PWD/scripts/image-bases/rust-builder.Containerfile" -t "$RUST_BASE" "$sysroot" >/dev/null
  phase "builder base $RUST_BASE made"
fi

# --- The images --------------------------------------------------------------------------------
build() {
  pod build --pull=never --network host --layers --build-arg "RUST_IMAGE=$RUST_BASE" \
    -f deploy/Dockerfile "$@" . >"$work/build.log" 2>&1 ||
    { tail -n 40 "$work/build.log" >&2; fail "podman build $* failed"; }
}
# The builder and runtime stages keep tags of their own, so removing this run's images at the
# end leaves the layer cache (the compile, the runtime's packages) for the next run.
build --target builder -t localhost/kvrouter-image-check-builder:cache
build --target runtime -t localhost/kvrouter-image-check-runtime:cache
build --target kvsim -t "$KVSIM_IMAGE"
build --target kvrouter -t "$KVROUTER_IMAGE"
phase "images built: $KVROUTER_IMAGE, $KVSIM_IMAGE"

# Image metadata: the non-root user, the exposed ports, no HEALTHCHECK (Kubernetes probes).
user=$(pod image inspect --format '{{.Config.User}}' "$KVROUTER_IMAGE")
[ "$user" = "65532:65532" ] || fail "kvrouter image runs as '$user', expected 65532:65532"
ports=$(pod image inspect --format '{{range $p, $_ := .Config.ExposedPorts}}{{$p}} {{end}}' "$KVROUTER_IMAGE")
for p in 9002/tcp 9090/tcp; do
  [[ " $ports " == *" $p "* ]] || fail "kvrouter image does not expose $p (exposes: $ports)"
done
healthcheck=$(pod image inspect --format '{{.Config.Healthcheck}}' "$KVROUTER_IMAGE")
[ "$healthcheck" = "<nil>" ] || fail "kvrouter image has a HEALTHCHECK ($healthcheck): probes belong to Kubernetes"
size=$(pod image inspect --format '{{.Size}}' "$KVROUTER_IMAGE")
echo "image-check: kvrouter image $((size / 1000000)) MB, user $user, ports $ports"

# Hardened like the manifests' securityContext.
# --read-only-tmpfs=false: no writable /tmp or /run either, as with Kubernetes'
# readOnlyRootFilesystem; only the mounts given below are writable.
hardened=(--read-only --read-only-tmpfs=false --network host --cap-drop ALL --security-opt no-new-privileges)

version=$(pod run --rm "${hardened[@]}" "$KVROUTER_IMAGE" --version)
[[ $version == "kvrouter "* ]] || fail "kvrouter --version printed '$version'"
sim_version=$(pod run --rm "${hardened[@]}" "$KVSIM_IMAGE" --version)
[[ $sim_version == "kvsim "* ]] || fail "kvsim --version printed '$sim_version'"
echo "image-check: $version; $sim_version"

# --- Serving: kvsim + kvrouter in containers, Envoy on the host -------------------------------
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
read -r SIM_PORT ZMQ_PORT GRPC_PORT ADMIN_PORT LISTEN_PORT ENVOY_ADMIN_PORT <<<"$(free_ports 6)"

# The replica publishes KV events to kvrouter's bound socket (a loopback address connects).
sim=kvsim-check-$$
containers+=("$sim")
pod run -d --name "$sim" "${hardened[@]}" \
  -v "$TOKENIZERS:/var/lib/kvrouter/tokenizers:ro" \
  "$KVSIM_IMAGE" --listen "127.0.0.1:$SIM_PORT" --kv-events "tcp://127.0.0.1:$ZMQ_PORT" \
  --model demo-model --tokenizer /var/lib/kvrouter/tokenizers/qwen3 >/dev/null

mkdir -p "$work/config"
cat >"$work/config/kvrouter.yaml" <<YAML
server:
  grpc_listen: 127.0.0.1:$GRPC_PORT
  admin_listen: 127.0.0.1:$ADMIN_PORT
models:
  - name: demo-model
    tokenizer: /var/lib/kvrouter/tokenizers/qwen3
envoy:
  eds_path: /run/kvrouter/eds.json
pools:
  - name: check
    models: [demo-model]
    endpoints:
      - address: 127.0.0.1:$SIM_PORT
        kv_events: {bind: "tcp://127.0.0.1:$ZMQ_PORT"}
YAML
# The container's user (65532) reads the mounted config.
chmod 755 "$work" "$work/config"
chmod 644 "$work/config/kvrouter.yaml"

router=kvrouter-check-$$
containers+=("$router")
pod run -d --name "$router" "${hardened[@]}" \
  -v "$work/config:/etc/kvrouter:ro" \
  -v "$TOKENIZERS:/var/lib/kvrouter/tokenizers:ro" \
  --tmpfs /run/kvrouter:rw,size=1m,U \
  "$KVROUTER_IMAGE" >/dev/null

# Waits until $2 answers 200, or fails after $3 seconds (default 60); container $1 must stay up.
wait_200() {
  local container=$1 url=$2 deadline=$(($(date +%s) + ${3:-60}))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "$url" 2>/dev/null)" = 200 ]; then return 0; fi
    if [ -n "$container" ] && [ "$(pod inspect --format '{{.State.Running}}' "$container")" != true ]; then
      fail "$container exited while waiting for $url"
    fi
    sleep 0.2
  done
  fail "$url did not answer 200 in time"
}
wait_200 "$sim" "http://127.0.0.1:$SIM_PORT/health"
wait_200 "$router" "http://127.0.0.1:$ADMIN_PORT/readyz"
phase "kvrouter ready on /readyz (read-only root, no capabilities)"

uid=$(pod exec "$router" sh -c 'id -u')
[ "$uid" = 65532 ] || fail "kvrouter runs as uid $uid"
for dir in / /tmp /etc/kvrouter; do
  pod exec "$router" sh -c "touch $dir/probe-write 2>/dev/null" && fail "$dir is writable in the container"
done
eds=$(pod exec "$router" cat /run/kvrouter/eds.json)
[[ $eds == *"\"port_value\":$SIM_PORT"* ]] || fail "EDS file on the tmpfs does not list the replica: $eds"

# A real Envoy on the host, configured by the image's own generator, routes one request through
# the containerised kvrouter to the containerised replica.
pod run --rm "${hardened[@]}" "$KVROUTER_IMAGE" envoy-config \
  --listen "127.0.0.1:$LISTEN_PORT" --admin "127.0.0.1:$ENVOY_ADMIN_PORT" \
  --extproc "127.0.0.1:$GRPC_PORT" --replica "127.0.0.1:$SIM_PORT" >"$work/envoy.yaml"
"$ENVOY" -c "$work/envoy.yaml" --disable-hot-restart -l warning >"$work/envoy.log" 2>&1 </dev/null &
envoy_pid=$!
wait_200 "" "http://127.0.0.1:$ENVOY_ADMIN_PORT/ready"
status=$(curl -s -o "$work/response.json" -D "$work/headers.txt" -w '%{http_code}' \
  "http://127.0.0.1:$LISTEN_PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"demo-model","messages":[{"role":"user","content":"hello from the image check"}],"max_tokens":4}')
[ "$status" = 200 ] || fail "request through Envoy got $status: $(cat "$work/response.json")"
grep -qi "^x-kvrouter-upstream: 127.0.0.1:$SIM_PORT" "$work/headers.txt" ||
  fail "the response did not come from the replica: $(cat "$work/headers.txt")"
decisions=$(curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" |
  awk '/^kvrouter_decisions_total/ {n += $NF} END {print n + 0}')
[ "$decisions" -ge 1 ] || fail "kvrouter made no decision (kvrouter_decisions_total = $decisions): Envoy failed open"
phase "a request through Envoy was routed by the containerised kvrouter ($decisions decision)"

# --- Tokenizers baked into a derived image -----------------------------------------------------
pod build --quiet --pull=never --build-arg "BASE_IMAGE=$KVROUTER_IMAGE" \
  -f "$PWD/deploy/tokenizers.Dockerfile" -t "$BAKED_IMAGE" "$TOKENIZERS" >/dev/null
checked=$(pod run --rm "${hardened[@]}" -v "$work/config:/etc/kvrouter:ro" "$BAKED_IMAGE" \
  check-config /etc/kvrouter/kvrouter.yaml)
[[ $checked == *": ok "* ]] || fail "check-config in $BAKED_IMAGE: $checked"
phase "tokenizers baked into $BAKED_IMAGE load (check-config ok)"

echo "image-check: passed in $(($(date +%s) - started)) s"
