"""`archipelago lighthouse` and `run_train.sh`: the two ways in to a federation.

Every process a test starts is killed by its PID in a `finally` block; ports are ephemeral.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import ROOT


def start(args: list[str], env_extra: dict[str, str] | None = None, **kwargs) -> tuple[subprocess.Popen, queue.Queue]:
    """Start `archipelago ARGS` (with `env_extra` in its environment; an empty value
    removes a variable); a thread feeds its output lines into the returned queue."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env = {k: v for k, v in env.items() if v}
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


@pytest.mark.timeout(90)
def test_lighthouse_dashboard_takes_pushes_and_serves_them_and_prometheus():
    import json

    from prometheus_client.parser import text_string_to_metric_families

    port = _free_port()
    proc, lines = start(["lighthouse", "--bind", "127.0.0.1:0", "--min-replicas", "1",
                         "--dashboard", f"127.0.0.1:{port}"])
    seen: list[str] = []
    try:
        url = wait_for_line(lines, "federation dashboard:", 60, seen).split()[0]
        assert url == f"http://127.0.0.1:{port}", url
        push = {"island": 3, "info": {"ranks": 2, "device": "cpu"}, "records": [{"step": 7, "loss": 4.5, "tokens": 99}]}
        request = urllib.request.Request(f"{url}/push", data=json.dumps(push).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200
        with urllib.request.urlopen(f"{url}/api/state", timeout=10) as answer:
            island = json.loads(answer.read())["islands"][0]
        assert (island["island"], island["step"], island["loss"], island["ranks"]) == (3, 7.0, 4.5, 2.0)
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            families = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}
        assert [s.value for s in families["archipelago_island_step"].samples] == [7.0]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, rest_of(lines, seen)
    finally:
        kill(proc)


def run_lighthouse(args: list[str], timeout: float = 60, env_extra: dict[str, str] | None = None) -> tuple[int, str]:
    proc, lines = start(["lighthouse", *args], env_extra)
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

def run_train_sh(args: list[str], via: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    """./run_train.sh ARGS (started by the command `via`, e.g. `uv run`, when given) with
    the launcher variables of this environment cleared and `env` set."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("NGPU", "NNODES", "MASTER_ADDR", "MASTER_PORT", "CONFIG_FILE", "ISHOST", "VIRTUAL_ENV")}
    full_env.update(env)
    proc = subprocess.Popen([*via, "./run_train.sh", *args], cwd=ROOT, env=full_env,
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
    # ISHOST as the reference platform's README writes it (yes/no), or torchrun's 1/0.
    for value, expected in [("yes", "is_host=1"), ("no", "is_host=0"), ("TRUE", "is_host=1"), ("false", "is_host=0"),
                            ("1", "is_host=1"), ("0", "is_host=0")]:
        done = run_train_sh([], NNODES="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29600", ISHOST=value,
                            ARCHIPELAGO_DRY_RUN="1")
        assert done.returncode == 0 and f"--rdzv-conf={expected} " in done.stdout, (value, done.stderr)
        assert "--nnodes=2" in done.stdout and "--rdzv-endpoint=10.0.0.1:29600" in done.stdout
    done = run_train_sh([], ISHOST="maybe")
    assert done.returncode == 2 and "ISHOST=maybe: expected 1 or yes" in done.stderr
    done = run_train_sh([], NNODES="2", MASTER_ADDR="10.0.0.1")
    assert done.returncode == 2 and "MASTER_PORT" in done.stderr


@pytest.mark.slow  # two islands train: make test-slow
@pytest.mark.timeout(300)
def test_the_reference_platforms_three_commands_run_a_federation(shakespeare, tmp_path):
    # Its README: `RUST_BACKTRACE=1 torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
    # --join_timeout_ms 10000` (torchft's own binary, here with --bind: its default is every
    # interface at a fixed port), then per island `TORCHFT_LIGHTHOUSE=... NGPU=1 LOCAL_ADDR=...
    # MASTER_ADDR=... MASTER_PORT=... NNODES=1 ISHOST=yes CONFIG_FILE=... ./run_train.sh
    # --fault_tolerance.enable --fault_tolerance.replica_id=K --fault_tolerance.group_size=2`,
    # only addresses filled in (and a short run: the debug config's steps cut to 8).
    from conftest import kill_started_processes, records

    token = f"ref-{uuid.uuid4().hex}"
    port = _free_port()
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100",
         "--join_timeout_ms", "10000", "--bind", f"127.0.0.1:{port}"],
        env={**os.environ, "RUST_BACKTRACE": "1", "ARCHIPELAGO_TEST_TOKEN": token},
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "lighthouse.log").open("w"))
    procs = []
    try:
        _wait_listening(port, lighthouse)
        for replica, ishost in ((0, "yes"), (1, "true")):
            env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "NNODES", "MASTER_ADDR", "MASTER_PORT",
                                                                    "CONFIG_FILE", "ISHOST", "VIRTUAL_ENV")}
            env.update(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", NGPU="1", LOCAL_ADDR="127.0.0.1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NNODES="1", ISHOST=ishost,
                       CONFIG_FILE="configs/llama3/debug.toml", ARCHIPELAGO_TEST_TOKEN=token)
            procs.append(subprocess.Popen(
                ["./run_train.sh", "--fault_tolerance.enable", f"--fault_tolerance.replica_id={replica}",
                 "--fault_tolerance.group_size=2", "--training.steps", "8", "--lr_scheduler.warmup_steps", "2",
                 "--fault_tolerance.sync_steps", "4", "--training.val_every", "0", "--metrics.progress", "plain",
                 "--metrics.no_tensorboard", "--job.run_dir", str(tmp_path / f"island-{replica}")],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        kill_started_processes(token)  # the islands and the lighthouse, by PID
        lighthouse.kill()  # by its own PID too, should the token miss it
        lighthouse.wait(timeout=30)
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    rounds = [[r for r in records(tmp_path / f"island-{k}") if r.get("event") == "outer_step"] for k in (0, 1)]
    assert [r["participants"] for r in rounds[0]] == [2, 2, 2], rounds[0]  # the start, then two rounds of 4 steps
    assert [r["global_hash"] for r in rounds[0]] == [r["global_hash"] for r in rounds[1]]


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until something accepts on 127.0.0.1:port (or `proc` exits: an error naming it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the lighthouse exited with {proc.returncode} before listening (its log is "
                                 "lighthouse.log in the test's folder)")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise AssertionError(f"nothing listened on 127.0.0.1:{port} within {timeout_s} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_uv_run_starts_run_train_sh_in_the_setup_venv_without_locking_or_syncing(tmp_path):
    # The reference platform's README starts islands with `uv run ./run_train.sh ...`.
    uv = shutil.which("uv") or (Path(sys.executable).parent / "uv")  # the dev extra pins one
    if not Path(uv).exists():
        pytest.skip("uv is not installed")
    site = Path(sysconfig.get_paths()["purelib"])
    before = sorted(p.name for p in site.iterdir())
    done = run_train_sh(["--fault_tolerance.enable", "--fault_tolerance.replica_id=0",
                         "--fault_tolerance.group_size=2"], via=(str(uv), "run"), ARCHIPELAGO_DRY_RUN="1",
                        UV_CACHE_DIR=str(tmp_path / "uv-cache"), UV_OFFLINE="1", NGPU="2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--nproc-per-node=2" in done.stdout and "--fault_tolerance.replica_id=0" in done.stdout
    assert sorted(p.name for p in site.iterdir()) == before  # nothing installed or removed
    assert not (ROOT / "uv.lock").exists()


# ---- the gate: a lighthouse with the federation's key admits members only ----------


def _keys():
    from archipelago.federation.trust import FederationKey, new_secret

    return FederationKey(bytes.fromhex(new_secret())), FederationKey(bytes.fromhex(new_secret()))


def _flipped(replica_id: str) -> str:
    """`replica_id` with its last character changed (a forged tag)."""
    return replica_id[:-1] + ("0" if replica_id[-1] != "0" else "1")


@pytest.mark.timeout(90)
def test_with_a_key_only_members_enter_a_quorum_and_outsiders_are_logged(caplog):
    from torchft.coordination import LighthouseClient

    from archipelago.federation.gate import check_admission
    from archipelago.federation.trust import member_id
    from archipelago.launch.lighthouse import start_lighthouse

    key, other = _keys()
    gate = start_lighthouse("127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20, key=key)
    try:
        assert gate.address().startswith("http://127.0.0.1:")
        client = LighthouseClient(gate.address(), connect_timeout=timedelta(seconds=10))
        member = f"{member_id(key, 0)}:{uuid.uuid4()}"  # torchft appends its own suffix
        outsiders = ["island_1", member_id(other, 1), _flipped(member_id(key, 1)), "island_1:" + "0" * 48]
        for rogue in outsiders:  # no token, another federation's, a forged tag, a made-up one
            with pytest.raises(RuntimeError, match="PermissionDenied"):
                client.quorum(replica_id=rogue, timeout=timedelta(seconds=5), address="a", store_address="s",
                              step=10**9, world_size=1)
            with pytest.raises(RuntimeError, match="PermissionDenied"):
                client.heartbeat(rogue)
        assert check_admission(gate.address(), member, 10)  # the island proves its key, as check_membership does
        client.heartbeat(member)
        quorum = client.quorum(replica_id=member, timeout=timedelta(seconds=10), address="a",
                               store_address="s", step=3, world_size=1)
        # The outsider that claimed step 10^9 never entered: the member is alone, at its own step.
        assert [(m.replica_id, m.step) for m in quorum.participants] == [(member, 3)]
        logged = caplog.text
        assert logged.count("refused an unauthenticated member") == len(outsiders), logged
        assert not any(o[13:] in logged for o in outsiders if ":" in o)  # no token past its first 4 characters

        from archipelago.federation.trust import redacted

        assert sorted(gate.refused) == sorted(redacted(o) for o in outsiders)
        # torchft's dashboard (and its kill endpoint) is reachable on loopback only.
        assert gate.dashboard().startswith("http://127.0.0.1:")
        with urllib.request.urlopen(gate.dashboard(), timeout=10) as page:
            assert page.status == 200 and b"Lighthouse" in page.read()
    finally:
        gate.shutdown()


def test_the_gate_reads_replica_ids_from_torchfts_messages_and_refuses_garbage():
    from archipelago.federation.gate import replica_id

    # Hand-encoded protobuf: LighthouseQuorumRequest{requester: QuorumMember{replica_id,
    # address, step}} and LighthouseHeartbeatRequest{replica_id}, as torchft's proto defines them.
    member = b"\x0a\x08island_7" + b"\x12\x01a" + b"\x20\x80\x94\xeb\xdc\x03"
    assert replica_id("Quorum", b"\x0a" + bytes([len(member)]) + member) == "island_7"
    assert replica_id("Heartbeat", b"\x0a\x08island_7") == "island_7"
    for garbage in (b"", b"\x0a\x20island", b"\x0b", b"\x20\xff\xff"):
        with pytest.raises(ValueError):
            replica_id("Heartbeat", garbage)


@pytest.mark.timeout(90)
def test_archipelago_lighthouse_with_a_key_file_says_members_only(tmp_path):
    from torchft.coordination import LighthouseClient

    from archipelago.federation.gate import check_admission
    from archipelago.federation.trust import load_key, member_id, new_secret

    key_file = tmp_path / "fed.key"
    key_file.write_text(new_secret())
    key_file.chmod(0o600)
    proc, lines = start(["lighthouse", "--bind", "127.0.0.1:0", "--key-file", str(key_file),
                         "--join-timeout-ms", "100", "--quorum-tick-ms", "50"])
    seen: list[str] = []
    try:
        url = wait_for_line(lines, "address:", 60, seen)
        wait_for_line(lines, "dashboard:", 10, seen)
        assert "members only" in "".join(seen), seen
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=10))
        with pytest.raises(RuntimeError, match="PermissionDenied"):
            client.quorum(replica_id="island_9", timeout=timedelta(seconds=5), step=0, world_size=1)
        member = member_id(load_key(str(key_file)), 0)
        assert check_admission(url, member, 10)
        quorum = client.quorum(replica_id=member, timeout=timedelta(seconds=20), step=0, world_size=1)
        assert [m.replica_id for m in quorum.participants] == [member]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        output = rest_of(lines, seen)
        assert "refused an unauthenticated member (replica id 'island_9'" in output
        assert member.split(":")[1][4:] not in output, output  # torchft's log names members: quiet with a key
    finally:
        kill(proc)


def test_the_gate_names_a_port_in_use_like_the_lighthouse():
    from archipelago.config import ConfigError
    from archipelago.launch.lighthouse import start_lighthouse

    key, _ = _keys()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is already in use"):
            start_lighthouse(f"127.0.0.1:{port}", key=key)


@pytest.mark.timeout(60)
def test_an_island_learns_before_joining_whether_the_gate_admits_it():
    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation.membership import FederationMismatch, check_membership
    from archipelago.launch.lighthouse import start_lighthouse

    key, other = _keys()
    ft = FaultToleranceConfig(enable=True, replica_id=1, connect_timeout_ms=10000)
    gate = start_lighthouse("127.0.0.1:0", key=key)
    plain = start_lighthouse("127.0.0.1:0")
    try:
        check_membership(gate.address(), key, ft)  # a member: no complaint
        with pytest.raises(FederationMismatch, match="has none: give it the federation's key file"):
            check_membership(gate.address(), None, ft)
        with pytest.raises(FederationMismatch, match=f"not this island's \\(key {other.federation_id.hex()[:12]}"):
            check_membership(gate.address(), other, ft)
        url = "http://127.0.0.1:" + plain.address().rsplit(":", 1)[1]
        check_membership(url, None, ft)  # torchft's lighthouse without a gate admits everyone
        check_membership(url, key, ft)
    finally:
        gate.shutdown()
        plain.shutdown()


# ---- the gate's door: whole messages, one member per token, proven keys ----------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _string(number: int, value: str | bytes) -> bytes:
    """A length-delimited protobuf field."""
    raw = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(raw)) + raw


def _quorum_member(*replica_ids: str, step: int = 0) -> bytes:
    """torchft's QuorumMember with each id as a replica_id field (1), then address, store
    address, step and world size (2, 3, 4, 5)."""
    return (b"".join(_string(1, r) for r in replica_ids) + _string(2, "a") + _string(3, "s")
            + _varint(4 << 3) + _varint(step) + _varint(5 << 3) + _varint(1))


@contextlib.contextmanager
def _keyed_gate():
    """A gate (min_replicas 1, fast ticks), its key, and a raw gRPC caller of its methods."""
    import grpc

    from archipelago.launch.lighthouse import start_lighthouse

    key, _ = _keys()
    gate = start_lighthouse("127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20, key=key)
    channel = grpc.insecure_channel(gate.address().split("://")[1])
    try:
        yield gate, key, lambda method, raw, timeout=5: channel.unary_unary(method)(raw, timeout=timeout)
    finally:
        channel.close()
        gate.shutdown()


def _denied(call, method: str, raw: bytes) -> str:
    """The details of the PERMISSION_DENIED that `method(raw)` must get."""
    import grpc

    with pytest.raises(grpc.RpcError) as refused:
        call(method, raw)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    return refused.value.details()


def _members_seen(gate, key, member: str) -> list[str]:
    """The replica ids of a quorum `member` (admitted) asks for now, and torchft's status page
    must name no one else's token either."""
    from torchft.coordination import LighthouseClient

    client = LighthouseClient(gate.address(), connect_timeout=timedelta(seconds=10))
    quorum = client.quorum(replica_id=member, timeout=timedelta(seconds=10), address="a", store_address="s",
                           step=1, world_size=1)
    return [m.replica_id for m in quorum.participants]


HEARTBEAT, QUORUM = "/torchft.LighthouseService/Heartbeat", "/torchft.LighthouseService/Quorum"


@pytest.mark.timeout(90)
def test_a_request_naming_a_replica_id_twice_or_malformed_is_refused_and_never_reaches_torchft():
    from archipelago.federation.gate import check_admission
    from archipelago.federation.trust import member_id

    with _keyed_gate() as (gate, key, call):
        member = f"{member_id(key, 0)}:{uuid.uuid4()}"
        assert check_admission(gate.address(), member, 10)
        forged = "island_7:no-token-at-all"  # torchft's decoder keeps the last of repeated fields
        for method, raw in [
            (HEARTBEAT, _string(1, member) + _string(1, forged)),
            (QUORUM, _string(1, _quorum_member(member, forged, step=10**9))),
            (QUORUM, _string(1, _quorum_member(member)) + _string(1, _quorum_member(forged, step=10**9))),
            (HEARTBEAT, _string(1, member) + b"\x0b"),  # a group (wire type 3) after a valid id
            (HEARTBEAT, _string(1, member) + b"\x12\x05ab"),  # a truncated field after it
            (HEARTBEAT, _varint(1 << 3) + _varint(7) + _string(1, member)),  # the id's field as a number too
            (QUORUM, _string(1, _quorum_member(member)) + b"\x07"),  # wire type 7 does not exist
        ]:
            assert "malformed" in _denied(call, method, raw)
        call(HEARTBEAT, _string(1, member))  # the same member, whole: passes
        import grpc

        with pytest.raises(grpc.RpcError) as big:  # torchft's requests are small: a huge one is not parsed
            call(HEARTBEAT, _string(1, member) + _string(9, b"x" * (1 << 17)))
        assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _members_seen(gate, key, member) == [member]
        with urllib.request.urlopen(gate.dashboard(), timeout=10) as page:  # torchft's own status page
            assert b"island_7" not in page.read()


@pytest.mark.timeout(90)
def test_one_member_token_is_one_member_whatever_follows_it():
    from archipelago.federation.gate import check_admission
    from archipelago.federation.trust import member_id

    with _keyed_gate() as (gate, key, call):
        token = member_id(key, 0)
        member = f"{token}:{uuid.uuid4()}"
        assert check_admission(gate.address(), member, 10)
        call(HEARTBEAT, _string(1, member))  # the first full id the token passes with is its one member
        for sybil in (f"{token}:sybil0", f"{token}:sybil1", f"{token}:{uuid.uuid4()}", token):
            _denied(call, HEARTBEAT, _string(1, sybil))
            _denied(call, QUORUM, _string(1, _quorum_member(sybil, step=10**9)))
        assert _members_seen(gate, key, member) == [member]


@pytest.mark.timeout(90)
def test_a_valid_token_passes_only_once_proven_with_the_key(caplog):
    import logging

    from archipelago.federation.gate import ADMIT, check_admission
    from archipelago.federation.trust import FederationKey, _member_message, member_id

    caplog.set_level(logging.INFO, logger="archipelago.lighthouse")
    with _keyed_gate() as (gate, key, call):
        # A token read off the network, by someone without the key: valid, never proven.
        nonce = "5eed" * 16  # where a member token carries its public signing key (64 hex digits)
        copied = f"island_3:{nonce}{key.tag(3, _member_message('island_3', nonce))[:16].hex()}"
        assert "never proven" in _denied(call, HEARTBEAT, _string(1, copied))
        _denied(call, QUORUM, _string(1, _quorum_member(copied, step=10**9)))

        from archipelago.federation.gate import PROVE

        assert not check_admission(gate.address(), copied, 10)  # nothing to prove it with: not this process's
        assert not check_admission(gate.address(), copied, 10, FederationKey(os.urandom(32)))
        challenge = call(ADMIT, copied.encode())
        assert len(challenge) == 40
        _denied(call, PROVE, challenge + bytes(32) + copied.encode())  # a guessed answer
        _denied(call, HEARTBEAT, _string(1, copied))
        # The island that made its token proves it, and passes from then on.
        mine = member_id(key, 4)
        assert "never proven" in _denied(call, HEARTBEAT, _string(1, mine))
        assert check_admission(gate.address(), mine, 10, key)
        call(HEARTBEAT, _string(1, mine))
        assert _members_seen(gate, key, mine) == [mine]
    logged = caplog.text
    assert "island_4:" + mine[9:13] in logged and "proved its federation key" in logged
    assert mine[13:] not in logged and copied[13:] not in logged  # tokens stay out of the log


def test_a_proven_token_passes_from_the_address_that_proved_it_only():
    import time as clock

    from archipelago.federation.gate import NEVER_PROVEN, Admissions, peer_host
    from archipelago.federation.trust import admission_proof, member_id

    key, other = _keys()
    admissions = Admissions(key, capacity=3)
    token = member_id(key, 2)
    member = f"{token}:{uuid.uuid4()}"
    challenge = admissions.challenge(token, "10.0.0.5")
    proof = admission_proof(key, 2, token, challenge)
    assert admissions.refusal(member, "10.0.0.5") == NEVER_PROVEN
    assert not admissions.prove(member, "10.0.0.6", challenge, proof)  # a challenge asked for elsewhere
    assert not admissions.prove(member, "10.0.0.5", challenge, admission_proof(other, 2, token, challenge))
    stale = admissions.challenge(token, "10.0.0.5", now=clock.time() - 120)
    assert not admissions.prove(member, "10.0.0.5", stale, admission_proof(key, 2, token, stale))
    assert admissions.prove(member, "10.0.0.5", challenge, proof)
    assert "proven from 10.0.0.5, not 10.0.0.6" in admissions.refusal(member, "10.0.0.6")  # a replay elsewhere
    assert admissions.refusal(member, "10.0.0.5") is None
    assert "already belongs" in admissions.refusal(f"{token}:{uuid.uuid4()}", "10.0.0.5")
    for island in (10, 11, 12):  # bounded: the least recently used token is forgotten
        other_token = member_id(key, island)
        asked = admissions.challenge(other_token, "10.0.0.7")
        assert admissions.prove(other_token, "10.0.0.7", asked, admission_proof(key, island, other_token, asked))
    assert len(admissions) == 3 and admissions.refusal(member, "10.0.0.5") == NEVER_PROVEN
    # Where a call comes from, as gRPC names it: every loopback address is one (127.0.0.1, ::1).
    assert [peer_host(p) for p in ("ipv4:10.0.0.5:41000", "ipv6:%5B::ffff:10.0.0.5%5D:41000", "ipv4:127.0.0.2:9",
                                   "ipv6:%5B::1%5D:5", "ipv6:%5Bfd00::11%5D:7", "unix:/tmp/s")] == \
        ["10.0.0.5", "10.0.0.5", "loopback", "loopback", "fd00::11", "unix:/tmp/s"]


@pytest.mark.timeout(120)
def test_a_flood_of_made_up_ids_is_counted_not_logged_line_by_line(caplog):
    """An outsider minting replica ids: the gate names the first 256 in the log (each once),
    then logs a count, never a line per call (the base commit logged every refusal after
    the 256th), and remembers at most 256 ids whatever the number it is sent."""
    import logging
    import re

    caplog.set_level(logging.WARNING, logger="archipelago.lighthouse")
    ids = [f"island_1:{n:04x}{'0' * 44}" for n in range(400)]  # logs show 4 characters of a token: all differ
    with _keyed_gate() as (gate, _key, call):
        for _ in range(2):  # every id twice: a named one is not named again, an unnamed one is counted again
            for rogue in ids:
                _denied(call, HEARTBEAT, _string(1, rogue))
        assert len(gate.refused) == 256  # bounded, whatever the number of ids
    lines = [r.getMessage() for r in caplog.records if r.name == "archipelago.lighthouse"]
    named = [line for line in lines if line.startswith("lighthouse: refused an unauthenticated member")]
    counts = [re.match(r"lighthouse: (\d+) refusal\(s\) in \d+ s not named one by one", line) for line in lines]
    assert len(named) == 256 and len(set(named)) == 256, len(named)
    assert len(lines) <= 256 + 4, f"{len(lines)} lines for {2 * len(ids)} refusals"  # counts: at once, at the end
    assert sum(int(m.group(1)) for m in counts if m) == 2 * (400 - 256)  # every unnamed refusal is counted


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bind", ["192.0.2.1:29510", "[2001:db8::1]:0"])  # documentation addresses: never bound
def test_a_lighthouse_without_a_key_beyond_loopback_is_refused_naming_the_fix(bind):
    code, out = run_lighthouse(["--bind", bind], timeout=30, env_extra={"ARCHIPELAGO_FEDERATION_KEY_FILE": ""})
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, out
    assert "without a federation key" in errors[0] and "--key-file" in errors[0] and "--insecure" in errors[0], out
    assert "secret new --out" in errors[0] and "Traceback" not in out


def test_only_loopback_a_key_or_insecure_lets_a_lighthouse_listen():
    from archipelago.config import ConfigError
    from archipelago.launch.lighthouse import refuse_open_without_key

    key, _ = _keys()
    for bind in ("127.0.0.1:29510", "127.0.0.2:0", "[::1]:29510", "localhost:29510"):
        refuse_open_without_key(bind, None, insecure=False)
    for bind in ("0.0.0.0:29510", ":29510", "[::]:29510", "10.0.0.1:29510", "lighthouse.example:29510"):
        with pytest.raises(ConfigError, match="--insecure"):
            refuse_open_without_key(bind, None, insecure=False)
        refuse_open_without_key(bind, key, insecure=False)
        refuse_open_without_key(bind, None, insecure=True)


@pytest.mark.timeout(120)
def test_an_island_proves_its_token_again_to_a_restarted_lighthouse(caplog):
    """A restarted gate has forgotten every proof: the island's next quorum request fails,
    it proves its member token again and the request after it goes through."""
    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation.membership import build_manager, check_membership
    from archipelago.federation.trust import FederationKey
    from archipelago.launch.lighthouse import start_lighthouse

    key = FederationKey(os.urandom(32))
    gate = start_lighthouse(bind="127.0.0.1:0", min_replicas=1, key=key)
    url = gate.address()
    manager = None
    try:
        ft = FaultToleranceConfig(enable=True, lighthouse=url, quorum_timeout_ms=2000, connect_timeout_ms=5000)
        check_membership(url, key, ft)
        manager = build_manager(ft, 0, 1, key)
        manager.start_quorum()
        assert manager.errored() is None and manager.num_participants() == 1
        gate.shutdown()
        gate = start_lighthouse(bind=f"127.0.0.1:{url.rsplit(':', 1)[1]}", min_replicas=1, key=key)
        manager.start_quorum()  # cb92e48 asked no proof; without a second proof this times out
        assert manager.errored() is None and manager.num_participants() == 1
        assert "never proven" in caplog.text and "proved this island's member token" in caplog.text
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
        gate.shutdown()


def test_importing_the_federation_package_loads_no_torchft():
    # torchft's Rust logger takes RUST_LOG when torchft is first imported: the lighthouse
    # quiets it (member tokens are credentials) only if nothing imported torchft before.
    import subprocess
    import sys

    code = ("import sys, archipelago.launch.lighthouse, archipelago.federation; "
            "print(sorted(m for m in sys.modules if m.startswith('torchft')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
