"""`archipelago lighthouse` and `run_train.sh`: the two ways in to a federation.

Every process a test starts is killed by its PID in a `finally` block; ports are ephemeral.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import timedelta

import pytest
from conftest import ROOT


def start(args: list[str], **kwargs) -> tuple[subprocess.Popen, queue.Queue]:
    """Start `archipelago ARGS`; a thread feeds its output lines into the returned queue."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Separate pipes: torchft's Rust logger writes partial lines to stderr from its own
    # thread; merged into one pipe they can land in the middle of one of our stdout lines.
    proc = subprocess.Popen([sys.executable, "-m", "archipelago.launch.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    lines: queue.Queue = queue.Queue()
    open_pipes = [2]
    lock = threading.Lock()

    def pump(pipe) -> None:
        for line in pipe:
            lines.put(line)
        with lock:  # one None, after both pipes are drained
            open_pipes[0] -= 1
            if open_pipes[0] == 0:
                lines.put(None)

    for pipe in (proc.stdout, proc.stderr):
        threading.Thread(target=pump, args=(pipe,), daemon=True).start()
    return proc, lines


def wait_for_line(lines: queue.Queue, prefix: str, timeout: float, seen: list[str]) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    pytest.fail(f"no line starting with {prefix!r} within {timeout}s:\n{''.join(seen)}")


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def rest_of(lines: queue.Queue, seen: list[str]) -> str:
    while True:
        try:
            line = lines.get(timeout=5)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
    return "".join(seen)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_lighthouse_serves_a_quorum_and_stops_cleanly(sig):
    from torchft.coordination import LighthouseClient

    proc, lines = start(["lighthouse", "--bind", "127.0.0.1:0", "--min-replicas", "1",
                         "--join-timeout-ms", "100", "--quorum-tick-ms", "50"])
    seen: list[str] = []
    try:
        url = wait_for_line(lines, "address:", 60, seen)
        assert url.startswith("http://127.0.0.1:") and int(url.rsplit(":", 1)[1]) > 0, url
        wait_for_line(lines, "dashboard:", 10, seen)
        printed = "".join(seen)
        assert f"export TORCHFT_LIGHTHOUSE={url}" in printed, printed
        assert f"--fault_tolerance.lighthouse {url}" in printed, printed

        with urllib.request.urlopen(url, timeout=10) as page:  # the dashboard
            assert page.status == 200 and b"Lighthouse" in page.read()
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=10))
        quorum = client.quorum(replica_id="island-0", timeout=timedelta(seconds=20), address="a",
                               store_address="s", step=0, world_size=1)
        assert [m.replica_id for m in quorum.participants] == ["island-0"]

        os.kill(proc.pid, sig)
        assert proc.wait(timeout=30) == 0, rest_of(lines, seen)
        assert "lighthouse stopped" in rest_of(lines, seen)
    finally:
        kill(proc)


def run_lighthouse(args: list[str], timeout: float = 60) -> tuple[int, str]:
    proc, lines = start(["lighthouse", *args])
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"archipelago lighthouse {' '.join(args)} did not exit: {rest_of(lines, [])}")
    finally:
        kill(proc)
    return proc.returncode, rest_of(lines, [])


@pytest.mark.timeout(90)
def test_a_port_in_use_is_refused_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = run_lighthouse(["--bind", f"127.0.0.1:{port}"])
    assert code == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "already in use" in errors[0] and "--bind" in errors[0], out
    assert "Traceback" not in out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bind", ["localhost", "127.0.0.1:http", "127.0.0.1:70000", "::1:29510"])
def test_a_malformed_bind_is_refused_with_one_line(bind):
    code, out = run_lighthouse(["--bind", bind])
    assert code == 2, out
    assert out.startswith("error: --bind") and out.count("\n") == 1, out
    assert "e.g." in out or "use" in out


def test_start_lighthouse_is_reusable_in_process():
    from archipelago.launch.lighthouse import island_urls, start_lighthouse

    server = start_lighthouse("127.0.0.1:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=50,
                              heartbeat_timeout_ms=1000)
    try:
        url, local = island_urls("127.0.0.1:0", server)
        assert url.startswith("http://127.0.0.1:") and local is None
        with urllib.request.urlopen(url, timeout=10) as page:
            assert page.status == 200
    finally:
        server.shutdown()


def test_the_lighthouse_listens_on_loopback_unless_told_otherwise():
    from archipelago.launch.lighthouse import _parser, split_bind

    assert split_bind(_parser().parse_args([]).bind) == ("127.0.0.1", 29510)
    assert split_bind(_parser().parse_args(["--bind", "10.0.0.1:29510"]).bind) == ("10.0.0.1", 29510)


# run_train.sh: the reference platform's launch script. These runs stop at the
# configuration check, before torchrun starts; no training happens here.

def run_train_sh(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("NGPU", "NNODES", "MASTER_ADDR", "MASTER_PORT", "CONFIG_FILE", "ISHOST")}
    full_env.update(env)
    proc = subprocess.Popen([str(ROOT / "run_train.sh"), *args], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        kill(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(120)
def test_run_train_sh_passes_config_file_and_arguments_to_train():
    done = run_train_sh(["--fault_tolerance.enable", "--fault_tolerance.replica_id=0",
                         "--fault_tolerance.group_size=2", "--training.steps", "0"],
                        NGPU="1", CONFIG_FILE="configs/llama3/debug.toml")
    assert done.returncode == 2, done.stderr
    assert "training.steps = 0" in done.stderr and "Traceback" not in done.stderr
    # The warmup of the file (20 steps) is named: CONFIG_FILE was read.
    assert "warmup_steps = 20" in done.stderr

    done = run_train_sh(["--training.steps", "0"], CONFIG_FILE="configs/does-not-exist.toml")
    assert done.returncode == 2 and "configs/does-not-exist.toml does not exist" in done.stderr

    done = run_train_sh(["--training.batch_size", "3"], NGPU="2")  # NGPU sizes the island
    assert done.returncode == 2 and "2 ranks" in done.stderr, done.stderr


@pytest.mark.timeout(120)
def test_run_train_sh_help_and_environment_checks():
    done = run_train_sh(["--help"])
    assert done.returncode == 0 and "--fault_tolerance.replica_id" in done.stdout
    assert "torch.distributed.run" not in done.stdout  # --help never starts torchrun

    done = run_train_sh([], NGPU="two")
    assert done.returncode == 2 and "NGPU=two" in done.stderr
    done = run_train_sh([], NNODES="2", MASTER_ADDR="10.0.0.1")
    assert done.returncode == 2 and "MASTER_PORT" in done.stderr
