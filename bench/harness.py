"""What the benchmarks share: starting and stopping their processes, reading the runs they
leave behind, table cells and JSON, and how they end after Ctrl-C or SIGTERM.

Every process a benchmark starts carries a token of its own in its environment
(BENCH_TOKEN_ENV): islands and torchrun ranks start sessions of their own, so neither our
process group nor the process tree finds them all, and processes are never matched by
name. Whatever happens (timeout, exception, Ctrl-C), everything carrying the token is
killed before a run is reported. The traffic meter is in meter.py, the emulated WAN of
bench/wan.py in netns.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from archipelago.launch.processes import kill_until_gone, pids_with_env  # noqa: E402
from archipelago.metrics.islands import island_records, outer_records  # noqa: E402
from archipelago.metrics.jsonl import iter_records  # noqa: E402

# Inherited by every process a run starts (islands and torchrun ranks start sessions of
# their own, so neither our process group nor the process tree finds them all).
BENCH_TOKEN_ENV = "ARCHIPELAGO_BENCH_TOKEN"
STOP_GRACE_S = 5.0
# Inherited settings that would point a process at another job or address.
STRIP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "TORCHELASTIC_RUN_ID", "TORCHFT_LIGHTHOUSE", "TORCHFT_MANAGER_PORT", "LOCAL_ADDR",
             "GLOO_SOCKET_IFNAME", "ARCHIPELAGO_FAULT", "ARCHIPELAGO_FAULT_RANK", "NGPU", "CONFIG_FILE")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# ------------------------------------------------------------------ processes


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, family/model numbers and widest vector extension, from
    /proc/cpuinfo (`platform.processor()` elsewhere). Runs of the same code and seed agree
    to the last digit only on the same CPU class (cores with other vector units can sum
    floats in other orders), so results files name it to say which runs pair."""
    import platform

    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if not key.strip():
            break  # the first processor's block is enough: the cores of one machine agree
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags", "").split()
    vector = next((v for v in ("avx512f", "avx2", "avx", "sse4_2", "asimd") if v in flags), "none")
    return (f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')}, {vector})")


def where_measured(device: str = "cpu", **extra: Any) -> dict[str, Any]:
    """Machine, CPU, cores, threads, torch and the commit a result comes from, with `extra`
    facts of the run (threads per run, workers, ...). A run on a CUDA `device` also records
    the GPU's name (`gpu`)."""
    import platform

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return {"machine": platform.processor() or platform.machine(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "device": device,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"), "torch": torch.__version__,
            "python": platform.python_version(),
            "commit": commit.stdout.strip() + (" (with uncommitted changes)" if dirty else ""),
            "load_average_at_start": list(os.getloadavg()), **_gpu_name(device), **extra}


def _gpu_name(device: str) -> dict[str, str]:
    """{"gpu": its name} for a CUDA device (the results of one flavor differ by card), else {}."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {}
    return {"gpu": torch.cuda.get_device_name(torch.device(device))}


def python_bin() -> str:
    venv = REPO / ".venv/bin/python"
    return str(venv) if venv.is_file() else sys.executable


def pids_with_token(token: str, prefix: bool = False) -> list[int]:
    """Live processes (never this one) whose benchmark token is `token` or, with `prefix`,
    starts with it (every run of one benchmark, a crashed earlier one's included)."""
    if not token:
        raise ValueError("an empty token would match every process")
    pids = pids_with_env(BENCH_TOKEN_ENV, token, prefix=prefix)
    return [pid for pid in pids if pid != os.getpid()]


def kill_token(token: str, timeout_s: float = 10.0, prefix: bool = False) -> int:
    """SIGKILL every process carrying our token (see pids_with_token) until none is left;
    returns how many kills landed."""
    return kill_until_gone(lambda: pids_with_token(token, prefix), timeout_s)


def base_env(token: str, threads: int) -> dict[str, str]:
    """Our environment for a process of our own job: `token` set, nothing inherited that
    points at another job, `threads` OpenMP threads."""
    env = {k: v for k, v in os.environ.items() if k not in STRIP_ENV}
    env.update({BENCH_TOKEN_ENV: token, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
                "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def code(self) -> int | None:
        return self.popen.poll()


def start(name: str, cmd: list[str], env: dict[str, str], log: Path) -> Proc:
    """Start `cmd` in the repository, stdout and stderr to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        # Own session: a terminal Ctrl-C reaches only us; we stop everything in order.
        popen = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(name, popen, log)


def stop_process(*popens: subprocess.Popen[Any]) -> None:
    """SIGTERM the processes we started (all at once: each may be waiting on another), then
    SIGKILL those still running STOP_GRACE_S later (by pid, never by name)."""
    for popen in popens:
        if popen.poll() is None:
            popen.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for popen in popens:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=STOP_GRACE_S)


def stop_all(procs: Sequence[Proc], token: str) -> None:
    """stop_process every process we started, then kill anything carrying `token`."""
    stop_process(*(proc.popen for proc in procs))
    kill_token(token)


def gloo_ranks(target: Callable[..., None], ranks: int, args: tuple[Any, ...], expected: int,
               result_timeout_s: float, join_timeout_s: float = 10.0) -> dict[int, Any]:
    """Run `target(rank, store_port, *args, results)` in `ranks` spawned processes that meet
    on one TCPStore (torchft's gloo groups rendezvous on it), and collect `expected`
    `(rank, value)` pairs from the `results` queue, waiting at most `result_timeout_s` for
    each. Every process is joined, or killed by PID, before this returns or raises."""
    import multiprocessing as mp

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=target, args=(rank, store.port, *args, results)) for rank in range(ranks)]
    for proc in procs:
        proc.start()
    found: dict[int, Any] = {}
    try:
        while len(found) < expected:
            rank, value = results.get(timeout=result_timeout_s)
            found[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=join_timeout_s)
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=10)
    return found


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


def wait_for_line(proc: Proc, needle: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in proc.log.read_text(errors="replace"):
            return
        if proc.code is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} did not report {needle!r} (exit code {proc.code}); log {proc.log}:\n"
                       f"{log_tail(proc.log)}")


# ------------------------------------------------------------------- one job


class Monitor(Protocol):
    """A traffic meter of one job (meter.py): started before it, stopped after it."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def summary(self) -> dict[str, Any]: ...


@dataclass
class RunResult:
    cmd: list[str]
    exit_code: int
    wall_s: float
    monitor: Monitor | None = None

    @property
    def traffic(self) -> dict[str, Any]:
        return self.monitor.summary() if self.monitor is not None else {}


def run_job(cmd: list[str], log_path: Path, timeout_s: float,
            monitor: Callable[[str, float], Monitor] | None = None, env: dict[str, str] | None = None) -> RunResult:
    """Run `cmd` with a hard timeout (and `env` over this process's environment), its
    traffic metered by `monitor(token, longest life in seconds)` unless that is None;
    whatever happens (timeout, exception, Ctrl-C), every process it started is gone on return."""
    return run_jobs([(cmd, log_path)], timeout_s, monitor, env)[0]


def run_jobs(jobs: Sequence[tuple[list[str], Path]], timeout_s: float,
             monitor: Callable[[str, float], Monitor] | None = None,
             env: dict[str, str] | None = None) -> list[RunResult]:
    """run_job for several (command, log) at once, all started together and all waited for
    within `timeout_s` (one meter for all of them); every process gone on return."""
    token = uuid.uuid4().hex
    env = {**os.environ, **(env or {}), BENCH_TOKEN_ENV: token}
    meter = monitor(token, timeout_s + 60) if monitor is not None else None
    for cmd, log_path in jobs:
        print(f"$ {' '.join(cmd)}\n  (output: {log_path})", flush=True)
    procs: list[Proc] = []
    t0 = time.monotonic()
    codes = []
    try:
        if meter is not None:
            meter.start()
        procs.extend(start(log_path.stem, cmd, env, log_path) for cmd, log_path in jobs)
        for proc, (cmd, log_path) in zip(procs, jobs):
            try:
                codes.append(proc.popen.wait(timeout=max(0.0, timeout_s - (time.monotonic() - t0))))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"timed out after {timeout_s:.0f}s: {' '.join(cmd)} (see {log_path})") from None
    finally:
        # A second Ctrl-C must not cut the clean-up short and leave islands running.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            # `archipelago local` stops its islands on SIGTERM; the token finds anything left
            # over (ranks outliving torchrun, islands).
            stop_all(procs, token)
            if meter is not None:
                meter.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
    elapsed = time.monotonic() - t0
    return [RunResult(cmd, code, elapsed, meter) for (cmd, _), code in zip(jobs, codes)]


# ------------------------------------------------------------- run results


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (the package's reader; a line cut by a kill is skipped)."""
    return list(iter_records(path)) if path.is_file() else []


def seq_len_of(run_dir: Path) -> int:
    return int(json.loads((run_dir / "config.json").read_text())["data"]["seq_len"])


def outer_steps(island_dir: Path) -> list[dict[str, Any]]:
    return outer_records(island_records(island_dir))


def read_summary(run_dir: Path, required: bool = False) -> dict[str, Any]:
    """summary.json of one island / job: {} when there is none, unless `required`."""
    path = run_dir / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    if required:
        raise RuntimeError(f"{path} is missing: the run ended without its summary")
    return {}


def tokens_trained(run_dir: Path) -> int:
    """Tokens of one island / job: summary.json, else its last step record."""
    summary = read_summary(run_dir)
    if summary:
        return int(summary["tokens"])
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r and "tokens" in r]
    return int(steps[-1]["tokens"]) if steps else 0


# ------------------------------------------------------------------- report


def num(value: float | None, fmt: str) -> str:
    """`value` formatted for a table cell; "-" when there is none."""
    return "-" if value is None else format(value, fmt)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def write_json(path: Path, data: Any, announce: bool = True) -> None:
    """`data` as indented JSON at `path` (folders made as needed); says so unless told not to."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    if announce:
        print(f"\nwrote {path}")


# ------------------------------------------------------------------- main


def work_root(chosen: Path | None, prefix: str) -> Path:
    """The folder for a benchmark's run directories: `chosen`, or a new one under /tmp."""
    import tempfile

    root = chosen or Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    print(f"run directories under {root}", flush=True)
    return root


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGHUP, handled as Ctrl-C is."""


def interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def set_signals(handler: Any, signums: Sequence[int] = STOP_SIGNALS) -> None:
    for sig in signums:
        signal.signal(sig, handler)


def run_main(main: Callable[[], None]) -> None:
    """Run a benchmark's main; after Ctrl-C or SIGTERM (every started process already
    stopped by run_job) say so and exit 130."""
    set_signals(interrupt, [signal.SIGTERM])  # SIGTERM cleans up like Ctrl-C (run_job's finally)
    try:
        main()
    except KeyboardInterrupt:
        print("\ninterrupted: every process this benchmark started has been stopped", file=sys.stderr)
        sys.exit(130)
