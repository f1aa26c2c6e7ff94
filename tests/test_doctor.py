"""`archipelago doctor`: every check against a real failing condition on loopback, with its fix."""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from archipelago.config import load_config
from archipelago.launch import doctor, doctor_checks, doctor_peer

ROOT = Path(__file__).resolve().parents[1]


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_lighthouse_fails_naming_how_to_start_it():
    port = _closed_port()
    check = doctor_checks.check_lighthouse(f"http://127.0.0.1:{port}")
    assert check.status == "FAIL" and "cannot connect" in check.detail
    assert f"archipelago lighthouse --bind 127.0.0.1:{port}" in check.fix
    assert doctor_checks.check_lighthouse("not a url").status == "FAIL"


@pytest.mark.timeout(60)
def test_a_running_lighthouse_passes():
    from archipelago.launch.lighthouse import start_lighthouse

    lighthouse = start_lighthouse("127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=20)
    try:
        assert doctor_checks.check_lighthouse(lighthouse.address()).status == "ok"
    finally:
        lighthouse.shutdown()


def test_interfaces_that_do_not_exist_or_do_not_carry_local_addr_fail_naming_the_right_one():
    loopback = next(name for name, addr in doctor_checks.interface_addresses().items() if addr == "127.0.0.1")
    wrong = doctor_checks.check_interfaces({"GLOO_SOCKET_IFNAME": "nosuch0"}, "127.0.0.1")
    assert [c.status for c in wrong] == ["FAIL"] and "no interface named nosuch0" in wrong[0].detail
    assert f"{loopback} carries LOCAL_ADDR 127.0.0.1" in wrong[0].fix
    right = doctor_checks.check_interfaces({"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": "^docker"},
                                           "127.0.0.1")
    assert [c.status for c in right] == ["ok"]  # NCCL's exclusion form is not checked
    others = {name: addr for name, addr in doctor_checks.interface_addresses().items() if addr != "127.0.0.1"}
    if others:  # an interface that exists but carries another address
        name, addr = next(iter(others.items()))
        off = doctor_checks.check_interfaces({"NCCL_SOCKET_IFNAME": name}, "127.0.0.1")
        assert off[0].status == "FAIL" and f"NCCL_SOCKET_IFNAME={loopback}" in off[0].fix


def test_local_addr_must_belong_to_this_host():
    assert doctor_checks.check_local_addr("127.0.0.1").status == "ok"
    foreign = doctor_checks.check_local_addr("192.0.2.7")  # TEST-NET-1: never a local address
    assert foreign.status == "FAIL" and "not an address of this host" in foreign.detail
    assert "127.0.0.1" in foreign.fix  # the host's addresses are listed


def test_a_taken_port_fails_and_a_free_one_passes():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        taken = doctor_checks.check_port("127.0.0.1", port)
        assert taken.status == "FAIL" and "another process holds port" in taken.fix
    assert doctor_checks.check_port("127.0.0.1", _closed_port()).status == "ok"


@functools.cache
def _fingerprint(*options: str, ranks: int = 1) -> dict:
    """What an island of llama3 federation.toml with these options declares at the join."""
    cfg = load_config(["--config", "configs/llama3/federation.toml", *options])
    return doctor_checks.island_fingerprint(cfg, ranks)


@pytest.fixture()
def peer(shakespeare):
    """A serving doctor on loopback with llama3 federation.toml's fingerprint."""
    cfg = load_config(["--config", "configs/llama3/federation.toml"])
    stop = threading.Event()
    listener = doctor_peer.serve("127.0.0.1", 0, _fingerprint(), stop)
    yield f"127.0.0.1:{listener.getsockname()[1]}", cfg
    stop.set()


@pytest.mark.timeout(60)
def test_a_peer_with_the_same_config_is_measured_and_passes(peer):
    address, cfg = peer
    checks = doctor_peer.check_peer(address, _fingerprint())
    assert [c.status for c in checks] == ["ok", "ok", "ok", "ok"], checks
    assert "latency" in checks[0].detail and "Mbit/s" in checks[0].detail


@pytest.mark.timeout(60)
def test_a_peer_with_another_config_fails_naming_what_the_join_would_refuse(peer):
    """The doctor compares the fingerprint the federation's join compares, field by field."""
    from archipelago.federation.membership import mismatch

    address, _ = peer
    checks = doctor_peer.check_peer(address, _fingerprint("--fault_tolerance.sync_steps", "20"))
    config = next(c for c in checks if c.name.endswith("config"))
    assert config.status == "FAIL" and "the join would refuse: pacing (steps(20)" in config.detail, config
    assert "steps(10)" in config.detail and "same model and [fault_tolerance] settings" in config.fix
    model = next(c for c in doctor_peer.check_peer(address, _fingerprint("--model.name", "qwen3"))
                 if c.name.endswith("config"))
    assert model.status == "FAIL" and "model (qwen3/debug here, llama3/debug there)" in model.detail
    # What differs between islands by design (their id, their rank count) is not compared.
    island_1 = _fingerprint("--fault_tolerance.replica_id", "1", "--fault_tolerance.group_size", "2", ranks=2)
    island_0 = _fingerprint("--fault_tolerance.group_size", "2")
    assert island_1["island"] != island_0["island"] and mismatch(island_0, island_1) is None


def test_what_stops_the_island_at_its_start_is_a_failed_config_row_not_a_traceback(shakespeare, tmp_path):
    cfg = load_config(["--config", "configs/llama3/federation.toml",
                       "--federation_security.key_file", str(tmp_path / "no-such.key")])
    fingerprint, row = doctor.config_check("federation.toml", cfg, {})
    assert fingerprint is None and row.status == "FAIL" and "no-such.key" in row.detail, row


def test_activation_checkpointing_changes_the_names_the_join_compares(shakespeare):
    """A checkpointed block's parameters are named through its wrapper on the island, so the
    join refuses a peer without it; the doctor says so before the run."""
    from archipelago.federation.membership import differing

    plain, wrapped = _fingerprint(), _fingerprint("--training.activation_checkpointing")
    assert differing(plain, wrapped) == ["shapes"] and plain["params"] == wrapped["params"]


def test_a_peer_line_nested_past_the_parser_is_refused_as_a_bad_answer():
    import io

    with pytest.raises(ConnectionError, match="nests too deeply"):
        doctor_peer._receive(io.BytesIO(b"[" * 4000 + b"\n"))


def test_a_peer_that_does_not_listen_fails_naming_doctor_serve():
    port = _closed_port()
    checks = doctor_peer.check_peer(f"127.0.0.1:{port}", None)
    assert [c.status for c in checks] == ["FAIL"]
    assert f"archipelago doctor --serve 127.0.0.1:{port}" in checks[0].fix


@pytest.mark.timeout(60)
def test_a_peer_speaking_another_protocol_is_refused_not_trusted():
    with socket.socket() as rogue:
        rogue.bind(("127.0.0.1", 0))
        rogue.listen(1)

        def answer() -> None:
            conn, _ = rogue.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"x" * 10_000)  # no newline within the size limit

        threading.Thread(target=answer, daemon=True).start()
        checks = doctor_peer.check_peer(f"127.0.0.1:{rogue.getsockname()[1]}", None)
    assert [c.status for c in checks] == ["FAIL"] and "answered wrongly" in checks[0].detail


@pytest.mark.timeout(120)
def test_the_command_prints_a_table_and_exits_1_on_a_failure(shakespeare):
    import os

    port = _closed_port()
    cache = {k: os.environ[k] for k in ("HOME", "ARCHIPELAGO_CACHE_DIR", "XDG_CACHE_HOME") if k in os.environ}
    done = subprocess.run([sys.executable, "-m", "archipelago.launch.cli", "doctor", "--config",
                           "configs/llama3/federation.toml", "--lighthouse", f"http://127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=100, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", **cache})
    assert done.returncode == 1, done.stderr
    assert "lighthouse" in done.stdout and "FAIL" in done.stdout and "1 check(s) failed" in done.stdout
    assert "versions" in done.stdout and "devices" in done.stdout and "llama3/debug" in done.stdout


@pytest.mark.timeout(60)
def test_a_peer_that_reaches_local_addr_passes_and_a_refused_connect_back_fails(peer):
    address, cfg = peer
    checks = doctor_peer.check_peer(address, _fingerprint(), local_addr="127.0.0.1")
    back = checks[-1]
    assert back.name.endswith("reaches LOCAL_ADDR") and back.status == "ok", checks
    # The peer connects where it is told; nothing listens on a closed port (a firewall's REJECT).
    conn = socket.create_connection(doctor_checks.host_port(address))
    with conn, conn.makefile("rb") as reader:
        doctor_peer._send(conn, {"op": "reach", "host": "127.0.0.1", "port": _closed_port(), "token": "ab" * 16})
        assert "refused" in doctor_peer._receive(reader)["error"].lower()
        doctor_peer._send(conn, {"op": "reach", "host": "127.0.0.1", "port": 1, "token": "not hex"})
        assert doctor_peer._receive(reader)["error"] == "malformed request"



@pytest.mark.timeout(60)
def test_the_ports_this_island_will_listen_on_are_reached_from_the_peer_one_by_one(peer):
    """--port N with a peer: the peer connects back at exactly those ports (a firewall may
    open some and not others); one held by another process fails naming it."""
    address, _ = peer
    free = _closed_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        checks = doctor_peer.check_peer(address, _fingerprint(), local_addr="127.0.0.1", ports=(free, taken))
    backs = {c.name.rsplit(":", 1)[-1]: c for c in checks if "reaches LOCAL_ADDR" in c.name}
    assert backs[str(free)].status == "ok" and f"127.0.0.1:{free}" in backs[str(free)].detail, checks
    assert backs[str(taken)].status == "FAIL" and "another process holds port" in backs[str(taken)].fix, checks


def _netns_ready() -> bool:
    import os
    import shutil

    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.fixture()
def two_hosts():
    """Two network namespaces joined by a veth pair (10.231.0.1 <-> 10.231.0.2); host A also holds
    10.232.0.1 on its loopback, an address host B has no route to (a private address behind NAT)."""
    import uuid

    if not _netns_ready():
        pytest.skip("needs root and iproute2 (network namespaces)")
    tag = uuid.uuid4().hex[:6]
    a, b = f"arch-doc-a-{tag}", f"arch-doc-b-{tag}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", f"da{tag}", "netns", a, "type", "veth", "peer", "name", f"db{tag}", "netns", b)
        for ns, dev, addr in ((a, f"da{tag}", "10.231.0.1/24"), (b, f"db{tag}", "10.231.0.2/24")):
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", a, "addr", "add", "10.232.0.1/32", "dev", "lo")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@pytest.mark.timeout(120)
@pytest.mark.slow  # 17 s on 2 cores: make test-slow
def test_a_local_addr_the_peer_cannot_route_to_fails_naming_the_fix(two_hosts):
    a, b = two_hosts
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "COLUMNS": "250", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-m", "archipelago.launch.cli", "doctor",
                               "--serve", "10.231.0.2:29599", "--serve-seconds", "90"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "answering doctor checks" in server.stdout.readline()

        def doctor_in_a(local_addr: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["ip", "netns", "exec", a, sys.executable, "-m", "archipelago.launch.cli", "doctor",
                                   "--peer", "10.231.0.2:29599"], cwd=ROOT, env={**env, "LOCAL_ADDR": local_addr},
                                  capture_output=True, text=True, timeout=60)

        hidden = doctor_in_a("10.232.0.1")  # A reaches B, B cannot reach A there
        assert hidden.returncode == 1, hidden.stdout + hidden.stderr
        row = next(line for line in hidden.stdout.splitlines() if "reaches LOCAL_ADDR" in line)
        assert "FAIL" in row and "cannot connect to 10.232.0.1" in hidden.stdout
        # The question goes over a connection from LOCAL_ADDR (the peer connects back only to the
        # address a check comes from), and that connection cannot complete: B has no route to A there.
        assert "no route back to 10.232.0.1" in hidden.stdout and "Tailscale/WireGuard" in hidden.stdout
        routed = doctor_in_a("10.231.0.1")
        assert routed.returncode == 0, routed.stdout + routed.stderr
        assert "the peer connected to 10.231.0.1" in routed.stdout
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.timeout(60)
def test_a_peer_with_other_versions_or_a_skewed_clock_is_warned_about(peer, monkeypatch):
    address, cfg = peer
    real = doctor_peer.hello

    def other_peer(fingerprint):  # what a peer with another torch and a clock 5 s ahead answers
        answer = real(fingerprint)
        return {**answer, "versions": {**answer["versions"], "torch": "2.0.0"}, "time": answer["time"] + 5.0}

    monkeypatch.setattr(doctor_peer, "hello", other_peer)
    checks = {c.name.rsplit(" ", 1)[-1]: c for c in doctor_peer.check_peer(address, _fingerprint())}
    assert checks["versions"].status == "warn" and "torch" in checks["versions"].detail
    assert "2.0.0 there" in checks["versions"].detail and "same versions" in checks["versions"].fix
    assert checks["clock"].status == "warn" and "+5.0 s" in checks["clock"].detail
    assert "set-ntp" in checks["clock"].fix


def test_checkpoints_larger_than_the_free_disk_fail_and_a_small_model_passes(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    # A 70B llama3 keeps fp32 weights and two AdamW moments per checkpoint: 840 GB each.
    big = load_config(["--config", "configs/llama3/federation.toml", "--model.flavor", "70B",
                       "--job.run_dir", str(tmp_path / "run"), "--checkpoint.keep", "3"])
    check = doctor_checks.check_disk(big)
    assert free < 3 * 70e9 * 12, "this disk holds three 70B checkpoints: the test cannot fail here"
    assert check.status == "FAIL" and "lower checkpoint.keep" in check.fix and str(tmp_path) in check.detail
    small = load_config(["--config", "configs/llama3/federation.toml", "--job.run_dir", str(tmp_path / "run")])
    assert doctor_checks.check_disk(small).status == "ok"


def _row_bytes(payload: int) -> int:
    """A signed row's bytes, counted here from the frame's parts (trust.py), rounded up to 8."""
    from archipelago.federation.trust import HEADER_BYTES, TAG_BYTES

    return -(-(HEADER_BYTES + payload + TAG_BYTES) // 8) * 8


def test_the_link_check_counts_an_exchange_and_names_what_fits_a_time_paced_round():
    from dataclasses import replace

    ft = load_config(["--config", "configs/llama3/federation.toml"]).fault_tolerance
    ft = replace(ft, codec="fp32", round_pacing="time", round_seconds=20.0, group_size=2)
    fp = {"params": 1_000_000, "federation": "key 0123"}
    link = 10e6  # 10 Mbit/s: fp32's 4 MB take 3.2 s, over the 5% (1 s) of a 20-s round; int8 fits
    own = replace(ft, average_optimizer_state=False)
    slow = doctor_peer.link_check("peer p", own, fp, link)
    assert slow.status == "warn" and 'codec = "auto" (it takes int8 over' in slow.fix, slow
    fp32 = _row_bytes(4 * 1_000_000)  # two islands, the all-gather: one row in
    assert f"fp32 {fp32 / 1e6:,.1f} MB ({fp32 * 8 / link:,.2f} s)" in slow.detail, slow.detail
    assert doctor_peer.link_check("peer p", replace(own, codec="auto"), fp, link).status == "ok"
    assert doctor_peer.link_check("peer p", own, fp, 1e9).status == "ok"  # 1 Gbit/s carries fp32 in 0.03 s
    steps = doctor_peer.link_check("peer p", replace(own, round_pacing="steps"), fp, link)
    assert steps.status == "info" and f"fp32 {fp32 * 8 / link / 0.05:,.0f} s" in steps.detail, steps.detail
    # The config's averaged moments: one more row of 8 bytes a value, which int8 cannot fit
    # beside over 10 Mbit/s (6.4 s), and fp32 can over 200 Mbit/s (0.48 s of 1 s).
    moments = _row_bytes(8 * 1_000_000)
    averaged = doctor_peer.link_check("peer p", ft, fp, link)
    assert f"moments {moments / 1e6:,.1f} MB ({moments * 8 / link:,.2f} s)" in averaged.detail, averaged.detail
    assert averaged.status == "warn" and "it takes int8 without the moments" in averaged.fix, averaged
    wide = doctor_peer.link_check("peer p", replace(ft, codec="auto"), fp, 200e6)
    assert wide.status == "ok" and "auto takes fp32 with the moments" in wide.detail, wide.detail
    steps = doctor_peer.link_check("peer p", replace(ft, round_pacing="steps"), fp, link)
    assert f"fp32 {(fp32 + moments) * 8 / link / 0.05:,.0f} s" in steps.detail, steps.detail
