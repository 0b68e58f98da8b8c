# Every target creates .venv on first use and installs the project (editable) with its dev tools.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/poolkeeper quickstart

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(VENV)/bin/pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(VENV)/bin/poolkeeper bench all --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
