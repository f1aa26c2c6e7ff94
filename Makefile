# The two commands: `make demo` and `make test`. Both set everything up if needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
# SkyPilot's task loader validates deploy/skypilot (`make test-deploy`). It pins click < 8.2,
# which transformers' huggingface-hub (dev extra) refuses, so it gets a venv of its own.
SKYPILOT_VERSION := 0.14.1
SKY_VENV := .venv-skypilot
# Marker files make setup idempotent: each step reruns only when its inputs change.
STAMP := $(VENV)/.installed


.PHONY: setup browser demo demo-island test test-slow test-gpu test-deploy slurm lint bench bench-gpu bench-federation bench-heterogeneous bench-wan bench-quality bench-scale docs clean

setup: $(STAMP) data browser

# Debian's chromium, for the dashboard's browser test (skipped without it; needs root to install).
browser:
	@command -v chromium >/dev/null || (apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
		echo "note: chromium not installed (apt-get failed); the dashboard's browser test will be skipped"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# DaCe (training.backend = "dace") without its declared numpy < 2: requirements-dace.txt says why.
$(STAMP): $(BIN)/python pyproject.toml requirements-dace.txt
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps -r requirements-dace.txt
	touch $(STAMP)

# Fetch the Shakespeare corpus, train the tokenizer, write token files (a no-op when cached);
# fetch Fashion-MNIST for the resnet configs (needs apt-get and dpkg-deb, not root; a
# machine without them can still train the language models, so it only warns).
data: $(STAMP)
	$(BIN)/archipelago data prepare
	$(BIN)/archipelago data prepare --data.dataset fashion_mnist || \
		echo "warning: Fashion-MNIST was not fetched (see above); only the resnet configs need it"
	$(BIN)/archipelago data prepare --config configs/llama3/compute-optimal.toml || \
		echo "warning: the mixed corpus was not fetched (see above); only configs/llama3/compute-optimal.toml needs it"

# The main job: a federation of two islands (2 CPU ranks + 1 CPU rank) with a lighthouse,
# island 1 killed after 45 s and restarted 10 s later; then island 0 alone on the same
# config (the baseline: what it trains without the federation in the same steps), and a
# report that puts the two final validation losses side by side, with a plot.
# A finished run would only resume and stop at once, so a rerun starts over; the previous
# run is kept in runs/demo.previous (replacing the one before).
demo: setup
	@if [ -d runs/demo ]; then rm -rf runs/demo.previous && mv runs/demo runs/demo.previous && \
		echo "moved the previous demo run to runs/demo.previous"; fi
	rm -rf runs/demo-baseline
	$(BIN)/archipelago local --islands 2,1 --config configs/llama3/federation.toml --kill 1@45 --restart-after 10 --job.run_dir runs/demo
	$(BIN)/archipelago train --nproc 2 --config configs/llama3/federation.toml --job.run_dir runs/demo-baseline --metrics.progress plain
	$(BIN)/archipelago report runs/demo --baseline runs/demo-baseline

# The single-island demo of the foundation: one torchrun job with 2 FSDP ranks.
demo-island: setup
	$(BIN)/archipelago train --config configs/llama3/debug.toml --nproc 2 --job.run_dir runs/demo-island
	$(BIN)/archipelago report runs/demo-island

test: setup
	$(BIN)/python -m pytest -q --durations=15

# ruff (lint rules in pyproject.toml) on the package, tests and benchmarks, and mypy on the package;
# .ci/run runs it before the tests.
lint: $(STAMP)
	$(BIN)/ruff check archipelago tests bench
	$(BIN)/mypy archipelago
	$(BIN)/shellcheck run_train.sh deploy/slurm/*.sbatch bench/gpu.sh
	$(BIN)/hadolint deploy/container/Dockerfile

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# deploy/ for real: a one-node SLURM cluster (slurmctld + slurmd, Debian's slurm-wlm) started by
# the test itself, a lighthouse job and two island jobs, one requeued (needs root; ~3 minutes);
# deploy/skypilot through SkyPilot's own loader (nothing launched).
test-deploy: setup slurm $(SKY_VENV)/.installed
	$(BIN)/python -m pytest -q -m deploy

$(SKY_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install --quiet skypilot==$(SKYPILOT_VERSION)
	touch $@

slurm:
	@command -v slurmctld >/dev/null || (apt-get install -y -q --no-install-recommends slurm-wlm >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends slurm-wlm >/dev/null 2>&1)) || \
		echo "note: slurm-wlm not installed (apt-get failed, or not root); the deploy tests will be skipped"

bench: setup
	$(BIN)/python bench/throughput.py

# On a GPU machine: trainer overhead and the 3-seed quality sweep on the small flavor; about 10 minutes.
bench-gpu: $(STAMP) data
	PYTHON=$(BIN)/python bash bench/gpu.sh

# Cross-island bytes (DiLoCo vs DDP, measured on the sockets) and the stall after a kill; a few minutes.
bench-federation: setup
	$(BIN)/python bench/federation.py

# Fast and slow islands (emulated 1:3 and 1:1): fixed steps vs time pacing; about 13 minutes.
bench-heterogeneous: setup
	$(BIN)/python bench/heterogeneous.py

# Validation loss at equal tokens (3 seeds): one island, DDP, DiLoCo and its variants; about 2 hours.
bench-quality: setup
	$(BIN)/python bench/quality.py --out runs/quality.json --plot runs/quality.png

# DDP vs DiLoCo codecs over network namespaces with tbf-shaped links (needs root); about 7 minutes.
bench-wan: setup
	$(BIN)/python bench/wan.py

# Top-k's two exchange paths at 2-8 islands on loopback, then the simulator against measured runs (~16 min).
bench-scale: setup
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/simulate_check.py

docs: $(STAMP)
	$(BIN)/archipelago config reference > docs/configuration.md

clean:
	rm -rf $(VENV) $(SKY_VENV) runs
