"""Shared fixtures: the real Shakespeare corpus, and a runner for the CLI with hard timeouts."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from pathlib import Path
from unittest import mock

import pytest

from archipelago.config import faults
from archipelago.launch.processes import kill_until_gone, pids_with_env, rank_threads
from archipelago.metrics.jsonl import iter_records, read_metrics

ROOT = Path(__file__).resolve().parents[1]

# Settings that keep a CPU training run to seconds: the debug model on short sequences.
TINY = ["--model.name", "llama3", "--model.flavor", "debug", "--data.seq_len", "64",
        "--training.batch_size", "8", "--training.val_batches", "2", "--metrics.progress", "plain",
        "--metrics.no_tensorboard", "--lr_scheduler.warmup_steps", "2"]


@pytest.fixture(scope="session")
def shakespeare():
    """The real corpus, prepared (cached) exactly as `make setup` prepares it."""
    from archipelago.config import Config
    from archipelago.data import prepare_from_config

    return prepare_from_config(Config().data, seed=0, log=lambda _msg: None)


@pytest.fixture(scope="session")
def fashion_mnist():
    """The real images' folder, fetched into the cache once (as `make setup` does)."""
    import shutil

    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("needs apt-get and dpkg-deb to fetch the Debian package")
    from archipelago.config import Config
    from archipelago.data import prepare_images_from_config

    return prepare_images_from_config(Config().data, log=lambda _m: None)


@dataclass
class Finished:
    returncode: int
    output: str


# Ranks of in-process multi-rank tests fork from one server that imported these once,
# instead of each spawned interpreter importing torch again (about 2.5 s of CPU each).
# The server is a fresh single-threaded interpreter, so forking it is safe even after
# this process started threads (an in-process lighthouse).
_RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torchft",
                 "archipelago.federation.diloco", "archipelago.island.parallelize"]


def rank_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context ranks start from, its server preloaded with `_RANK_PRELOAD`."""
    multiprocessing.set_forkserver_preload(_RANK_PRELOAD)  # read once, when the server starts
    return multiprocessing.get_context("forkserver")


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), through a forkserver with torch preloaded."""
    import torch.multiprocessing as mp

    rank_context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def rank_manager() -> SyncManager:
    """A manager for the dicts and events ranks report through, forked from the forkserver.

    multiprocessing.Manager() forks the manager from pytest itself, with the garbage of the
    tests before: gloo process groups whose threads did not survive the fork. When the
    manager's collector reached one, its destructor waited forever on those threads, and the
    rank writing its result waited with it (a 240 s timeout, one run in a few)."""
    return rank_context().Manager()


def pids_with_token(token: str) -> list[int]:
    """PIDs of the live processes whose environment carries `token` (the ones a test started)."""
    return pids_with_env("ARCHIPELAGO_TEST_TOKEN", token)


def kill_started_processes(token: str) -> None:
    kill_until_gone(lambda: pids_with_token(token))


@contextlib.contextmanager
def islands_threads(ranks: int):
    """This process's intra-op threads set to what `archipelago local` gives each of `ranks`
    ranks (processes.rank_threads), restored after. The simulator trains the platform's
    weights bit for bit only at the platform's thread count: the CPU's matrix and
    convolution kernels split a product's sum into per-thread chunks, so another count may
    round differently (on a 2-core AVX-512 Xeon the simulator at 2 threads missed
    the 1-thread islands' weights in the last bits; an older machine's kernels had hidden it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(rank_threads(ranks)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_cli(args: list[str], timeout: float = 240, env: dict[str, str] | None = None) -> Finished:
    """Run `archipelago ARGS`; on timeout, and always at the end, kill every process it started."""
    token = uuid.uuid4().hex
    full_env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.RANK_ENV)}
    full_env.update(PYTHONUNBUFFERED="1", ARCHIPELAGO_TEST_TOKEN=token, **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "archipelago.launch.cli", *args], cwd=ROOT,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return finish_started(proc, token, f"archipelago {' '.join(args)}", timeout)


def run_cli_here(args: list[str], env: dict[str, str] | None = None) -> Finished:
    """Run `archipelago ARGS` inside this process: the same code path as `run_cli` for the
    commands that start no other process (a one-rank `train`, `report`), without the
    seconds each new interpreter spends importing torch. Output is stdout and stderr
    together, as `run_cli` gives it; the environment is restored afterwards."""
    from archipelago.launch.cli import main

    out = io.StringIO()
    with mock.patch.dict(os.environ), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        for key in (faults.ENV, faults.RANK_ENV):  # this process's own faults are not the run's
            os.environ.pop(key, None)
        os.environ.update(env or {})
        code = main(args)  # logging is set up inside, on the redirected stderr
    return Finished(code, out.getvalue())


def finish_started(proc: subprocess.Popen, token: str, what: str, timeout: float) -> Finished:
    """Wait for `proc`; on timeout, and always at the end, kill every process carrying `token`."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_started_processes(token)
        out, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout}s:\n{out[-4000:]}")
    finally:
        leftovers = pids_with_token(token)
        kill_started_processes(token)
    assert not leftovers, f"processes outlived `{what}`: {leftovers}\n{out[-3000:]}"
    return Finished(proc.returncode, out)


def make_tar(path: Path, files: dict[str, bytes]) -> Path:
    """A .tar.gz at `path` holding `files` (member name -> bytes), as package archives hold data."""
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def records(run_dir: Path) -> list[dict]:
    """Every record of RUN_DIR/metrics.jsonl in file order (the package's one reader)."""
    return list(iter_records(run_dir / "metrics.jsonl"))


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl, the last record per step (a resumed run re-logs steps)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl").steps if "loss" in r}


def events(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "event" in r]


def assert_crash_resume_reproduces(train: Callable[..., Finished], tmp_path: Path) -> None:
    """`train(run_dir, env=None)` runs 8 steps, checkpointing every 3. A run whose rank is
    killed at step 5 (after the step-3 checkpoint) and restarted resumes from step 3 and
    logs the losses of an uninterrupted run: model, optimizer, scheduler, data position and
    RNG all restored."""
    reference = train(tmp_path / "reference")
    assert reference.returncode == 0, reference.output[-3000:]
    run = tmp_path / "crashy"
    crashed = train(run, env={"ARCHIPELAGO_FAULT": "crash@5"})
    assert crashed.returncode != 0
    assert max(losses(run)) < 8
    resumed = train(run)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [e["step"] for e in events(run) if e["event"] == "resume"] == [3]
    want, got = losses(tmp_path / "reference"), losses(run)
    assert sorted(got) == list(range(1, 9))
    for step in range(4, 9):
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, want, got)


class FinishedWork:
    """A finished collective, as torchft's managed work expects one (for fake process groups)."""

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        import torch

        future = torch.futures.Future()
        future.set_result(None)
        return future


def listening(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc: no tools
    needed); an IPv4-mapped address (grpc listens dual-stack) as its IPv4 form."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))  # host-order 32-bit words
                address = ipaddress.ip_address(raw)
                mapped = getattr(address, "ipv4_mapped", None)
                found.add((str(mapped or address), int(hex_port, 16)))
    return found
