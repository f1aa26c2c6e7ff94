"""Shared fixtures: the real Shakespeare corpus, and a runner for the CLI with hard timeouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Settings that keep a CPU training run to seconds: the debug model on short sequences.
TINY = ["--model.name", "llama3", "--model.flavor", "debug", "--data.seq_len", "64",
        "--training.batch_size", "8", "--training.val_batches", "2", "--metrics.progress", "plain",
        "--metrics.no_tensorboard", "--lr_scheduler.warmup_steps", "2"]


@pytest.fixture(scope="session")
def shakespeare():
    """The real corpus, prepared (cached) exactly as `make setup` prepares it."""
    from archipelago.config import Config
    from archipelago.data import default_cache_dir, prepare_dataset

    d = Config().data
    return prepare_dataset(d.path, d.tokenizer, d.vocab_size, d.val_fraction, default_cache_dir(),
                           seed=0, log=lambda _msg: None)


@dataclass
class Finished:
    returncode: int
    output: str


def run_cli(args: list[str], timeout: float = 240, env: dict[str, str] | None = None) -> Finished:
    """Run `archipelago ARGS` in its own process group; kill the whole group on timeout."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("ARCHIPELAGO_FAULT", None) if not env or "ARCHIPELAGO_FAULT" not in env else None
    proc = subprocess.Popen([sys.executable, "-m", "archipelago.launch.cli", *args], cwd=ROOT,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created: torchrun and its ranks
        out, _ = proc.communicate()
        pytest.fail(f"archipelago {' '.join(args)} timed out after {timeout}s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers, if a rank outlived torchrun
        except ProcessLookupError:
            pass
    return Finished(proc.returncode, out)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl, the last record per step (a resumed run re-logs steps)."""
    result: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "loss" in record:
            result[record["step"]] = record["loss"]
    return result


def events(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "event" in r]
