# The two commands: `make demo` and `make test`. Both set everything up if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
# Marker files make setup idempotent: each step reruns only when its inputs change.
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow test-gpu bench docs clean

setup: $(STAMP) data

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Fetch the Shakespeare corpus, train the tokenizer, write token files (a no-op when cached).
data: $(STAMP)
	$(BIN)/archipelago data prepare

demo: setup
	$(BIN)/archipelago train --config configs/llama3/debug.toml --nproc 2 --job.run_dir runs/demo
	$(BIN)/archipelago report runs/demo

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

bench: setup
	$(BIN)/python bench/throughput.py

docs: $(STAMP)
	$(BIN)/archipelago config reference > docs/configuration.md

clean:
	rm -rf $(VENV) runs
