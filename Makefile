# slotserve — each target sets up what it needs, so it works as the first
# command on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Runtime dependencies only: enough for the demo.
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# Development extra: pytest, ruff, mypy and llama-cpp-python (built from source,
# ~7 minutes on 2 cores the first time; pip caches the wheel afterwards).
$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	touch $(VENV)/.runtime $@

demo: $(VENV)/.runtime
	$(BIN)/slotserve demo

lint: $(VENV)/.dev
	$(BIN)/ruff check engine scheduler transport tests bench tools
	$(BIN)/ruff format --check engine scheduler transport tests bench tools

typecheck: $(VENV)/.dev
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(VENV)/.dev
	$(BIN)/python bench/single_stream.py

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
