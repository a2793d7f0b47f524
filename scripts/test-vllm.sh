#!/usr/bin/env bash
# `make test-vllm`: a real vLLM (CPU build, two replicas) behind kvrouter and Envoy, the checks of
# tests/real_vllm (see docs/real-vllm.md). Sets vLLM up first (scripts/setup-vllm.sh, skipped
# when done), and kills whatever vLLM process group the test leaves behind, even when the test
# itself is killed. Needs KVROUTER_ENVOY (the Makefile passes .venv's Envoy).
set -euo pipefail

cd "$(dirname "$0")/.."
RUN=.run/real-vllm

# The test writes each vLLM's process group id to $RUN/<name>.pgid while it runs.
kill_leftovers() {
    local f
    for f in "$RUN"/*.pgid; do
        [[ -f "$f" ]] || continue
        # Only processes of that group that are vLLM's (API server, VLLM::EngineCore).
        pkill -KILL -g "$(cat "$f")" -f -i vllm 2>/dev/null || true
        rm -f "$f"
    done
}
kill_leftovers
trap kill_leftovers EXIT

./scripts/setup-vllm.sh
# The test starts kvsim for its comparison; `cargo test --test` builds only the router's binary.
cargo build --quiet -p kvsim --bin kvsim
KVROUTER_VLLM="$PWD/.venv-vllm/bin/vllm" \
KVROUTER_VLLM_MODEL="$PWD/.cache/vllm-model/smollm2" \
    RUST_BACKTRACE=0 cargo test --test real_vllm -- --ignored --nocapture
