# MatrixServe — the two commands a new user needs are `make demo` and `make test`.
# Both do their own set-up: a virtual environment, Debian packages, the Kubernetes build (cached
# under ~/.cache/matrixserve), helm and kubectl.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEVCLUSTER := $(PY) -m matrixserve.devcluster
PYTEST_ARGS ?=
# checkov (a dev tool: the chart's security checks) pins many packages of its own: it lives in its
# own virtual environment, never in $(VENV).
CHECKOV_VENV := .venv-checkov
CHECKOV_VERSION := 3.3.30
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION)

.DEFAULT_GOAL := help
.PHONY: help venv setup test test-unit lint checkov checkov-venv helm demo cluster-up cluster-down \
        cluster-status bench \
        bench-node-emulator bench-engine-streams bench-operator-setup bench-gateway-overhead bench-ttft-slo \
        bench-recovery bench-scale-out bench-ratio bench-placement bench-expertpool kind-up kind-down kind-load e2e-kind images clean

help:
	@echo "make demo          bring up the local control plane + ZooKeeper and show what runs"
	@echo "make test          the whole suite (unit + real local cluster), all set-up included"
	@echo "make test-unit     pure tests only (no cluster)"
	@echo "make lint          ruff, mypy, import-linter"
	@echo "make checkov       checkov's Kubernetes checks on the rendered Helm chart"
	@echo "make bench         every benchmark (each alone: make bench-<name>)"
	@echo "make cluster-up    start the dev cluster (see 'python -m matrixserve.devcluster env')"
	@echo "make cluster-down  stop exactly what cluster-up started"
	@echo "make images        build the operator/gateway and engine-stub images"
	@echo "make kind-up       a kind cluster for users with Docker (then make kind-load, make e2e-kind)"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $@

venv: $(STAMP)

setup: venv
	$(DEVCLUSTER) setup

# helm alone, from the dev cluster's tool cache (the chart's unit tests render the chart).
helm: venv
	@$(PY) -c 'from pathlib import Path; from matrixserve.devcluster import tools; tools.ensure_helm(Path("$(VENV)/helm.log"))'

$(CHECKOV_STAMP):
	@test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --disable-pip-version-check 'checkov==$(CHECKOV_VERSION)'
	@touch $@

checkov-venv: $(CHECKOV_STAMP)

# The chart as `helm template` renders it, checked by checkov (skips are in the chart, each with
# its reason); tests/unit/test_chart_hardening.py does the same in `make test`, with more values.
checkov: checkov-venv helm
	@out=$$(mktemp -d) && trap 'rm -rf "$$out"' EXIT && \
	  helm=$$($(PY) -c 'from matrixserve.devcluster import tools; print(tools.helm_path())') && \
	  "$$helm" template matrixserve charts/matrixserve -n matrixserve > "$$out/chart.yaml" && \
	  CKV_SKIP_PACKAGE_UPDATE_CHECK=true $(CHECKOV_VENV)/bin/checkov -f "$$out/chart.yaml" \
	    --framework kubernetes --skip-download --compact

# The whole suite: lint (layering is part of correctness), then unit and cluster tests; in CI
# (CI=true, root) the two images are built and checked as well (podman; see `make images`).
test: setup lint checkov-venv
	$(PY) -m pytest $(PYTEST_ARGS)
	@if [ "$$CI" = "true" ]; then $(MAKE) --no-print-directory images; fi

# The operator/gateway and engine-stub images: docker build with a Docker engine, else podman
# (vfs, chroot isolation) on a debootstrap base, each checked by running its entrypoint.
images: setup
	$(DEVCLUSTER) images

# kind, for users with Docker: load the images into the kind cluster and run the end-to-end
# check there (helm install with the node-emulator DaemonSet, a group Ready, a chat completion).
kind-load: images
	@command -v kind >/dev/null || { echo "kind-load needs kind on PATH"; exit 1; }
	kind load docker-image --name matrixserve matrixserve/matrixserve:0.1.0 matrixserve/engine-stub:0.1.0

e2e-kind: kind-up kind-load
	kubectl config use-context kind-matrixserve
	bash scripts/e2e-kind.sh

test-unit: venv helm checkov-venv
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check operator engine-stub tests bench testkit
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --explicit-package-bases tests bench testkit
	$(VENV)/bin/lint-imports

demo: setup
	$(DEVCLUSTER) demo
	@echo
	@echo "The cluster keeps running: eval \"\$$($(DEVCLUSTER) env)\"; $(VENV)/bin/kubectl get pods -A"
	@echo "Stop it with: make cluster-down"

cluster-up: setup
	$(DEVCLUSTER) up

cluster-down: venv
	$(DEVCLUSTER) down

cluster-status: venv
	$(DEVCLUSTER) status

# --- benchmarks: each starts its own cluster and processes (bench-placement: pure, none), prints
# ours vs the baseline and writes bench/results/<name>.json ------------------------------------
bench: bench-node-emulator bench-engine-streams bench-operator-setup bench-gateway-overhead bench-ttft-slo \
       bench-recovery bench-scale-out bench-ratio bench-placement bench-expertpool

bench-node-emulator: setup
	$(PY) bench/node_emulator_scale.py

bench-engine-streams: setup
	$(PY) bench/engine_streams.py

bench-operator-setup: setup
	$(PY) bench/operator_setup.py

bench-gateway-overhead: setup
	$(PY) bench/gateway_overhead.py

bench-ttft-slo: setup
	$(PY) bench/ttft_slo.py

bench-recovery: setup
	$(PY) bench/recovery.py

bench-scale-out: setup
	$(PY) bench/scale_out.py

bench-ratio: setup
	$(PY) bench/ratio.py

bench-placement: setup
	$(PY) bench/placement.py

bench-expertpool: setup
	$(PY) bench/expertpool.py

# --- kind (needs Docker; not available on the project's own CI machines) -------------------
kind-up:
	@command -v docker >/dev/null && docker info >/dev/null 2>&1 || \
	  { echo "kind-up needs a running Docker engine"; exit 1; }
	@command -v kind >/dev/null || { echo "kind-up needs kind on PATH (https://kind.sigs.k8s.io)"; exit 1; }
	kind create cluster --name matrixserve --config kind-config.yaml

kind-down:
	kind delete cluster --name matrixserve

clean: cluster-down
	rm -rf $(VENV) $(CHECKOV_VENV) .pytest_cache .mypy_cache .ruff_cache
