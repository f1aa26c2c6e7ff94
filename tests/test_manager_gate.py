"""The manager gate (federation/manager_gate.py): from outside the island, torchft's manager
server answers only the healing call.

Islands are subprocesses (tests/manager_gate_island.py: build_manager, then rounds) with
LOCAL_ADDR on 127.0.0.2 / 127.0.0.3, against a lighthouse in this process; the test calls
the advertised manager address with raw gRPC, as an outsider would.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import listening

ROOT = Path(__file__).resolve().parents[1]
ISLAND = ROOT / "tests" / "manager_gate_island.py"
SERVICE = "/torchft.ManagerService/"


class Island:
    """One island subprocess; its JSON lines arrive on a queue, its stderr in a file."""

    def __init__(self, tmp: Path, lighthouse: str, replica: int, value: float, local_addr: str,
                 key_hex: str = "") -> None:
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK",
                            "TORCHFT_MANAGER_PORT", "TORCHFT_LIGHTHOUSE", "ARCHIPELAGO_TEST_KEY")}
        env.update(LOCAL_ADDR=local_addr, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if key_hex:
            env["ARCHIPELAGO_TEST_KEY"] = key_hex
        self.stop_file, self.log = tmp / f"stop-{replica}", tmp / f"island-{replica}.err"
        self.proc = subprocess.Popen(
            [sys.executable, str(ISLAND), lighthouse, str(replica), str(value), str(self.stop_file)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True)  # noqa: SIM115
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def next(self, key: str, timeout: float = 60.0, where: Any = None) -> dict[str, Any]:
        """The next record with `key` (and `where(record)` true), within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                record = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if key in record and (where is None or where(record)):
                return record
        raise AssertionError(f"no {key!r} record from the island (exit {self.proc.poll()}):\n"
                             + self.log.read_text()[-3000:])

    def stop(self) -> int:
        """Ask the island to shut its manager down and exit; its exit code."""
        self.stop_file.touch()
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by PID: only the process this test started
            self.proc.wait(timeout=30)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _string(number: int, text: str) -> bytes:
    raw = text.encode()
    return _varint(number << 3 | 2) + _varint(len(raw)) + raw


def _call(target: str, method: str, request: bytes, timeout: float = 5.0) -> tuple[Any, Any]:
    """A raw unary gRPC call: (status code, answer bytes or error details)."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        try:
            return grpc.StatusCode.OK, channel.unary_unary(method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=2000)
    try:
        yield server.address()
    finally:
        server.shutdown()


@pytest.mark.timeout(180)
def test_from_outside_only_the_healing_call_reaches_the_manager_and_kill_never_does(tmp_path, lighthouse):
    import grpc

    island = Island(tmp_path, lighthouse, 0, 7.0, "127.0.0.2")
    try:
        internal = island.next("manager")["manager"]
        port = int(internal.rsplit(":", 1)[1])
        # The island's bridge ranks are told the internal (loopback) address.
        assert internal == f"http://127.0.0.1:{port}", internal
        island.next("round")  # a quorum has run: the server holds this rank's healing metadata
        outside = f"127.0.0.2:{port}"  # what the lighthouse advertises: http://LOCAL_ADDR:PORT

        refused = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}
        code, details = _call(outside, SERVICE + "Kill", _string(1, "from outside"))
        assert code in refused, (code, details)
        time.sleep(0.5)
        assert island.proc.poll() is None, "Kill from outside stopped the island"
        for method, request in (("Quorum", _varint(2 << 3) + _varint(10**6)),  # step 10^6
                                ("ShouldCommit", _varint(1 << 3) + _varint(1))):  # should_commit=true
            code, details = _call(outside, SERVICE + method, request)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
            assert "only CheckpointMetadata" in details
        assert _call(outside, "/torchft.LighthouseService/Quorum", b"")[0] == grpc.StatusCode.UNIMPLEMENTED

        # The healing call passes: it names the island's healing server (on LOCAL_ADDR).
        code, answer = _call(outside, SERVICE + "CheckpointMetadata", b"")  # rank 0
        assert code == grpc.StatusCode.OK, (code, answer)
        assert answer[:1] == b"\x0a" and answer[2:].decode().startswith("http://127.0.0.2:"), answer
        # Another rank's metadata is the server's own refusal, passed through.
        assert _call(outside, SERVICE + "CheckpointMetadata", _varint(1 << 3) + _varint(5))[0] \
            == grpc.StatusCode.INVALID_ARGUMENT

        # The real server is on loopback only; LOCAL_ADDR's port is the gate's; nothing on every interface.
        bound = listening(island.proc.pid)
        assert ("127.0.0.1", port) in bound and ("127.0.0.2", port) in bound, bound
        assert not {host for host, _ in bound} & {"0.0.0.0", "::"}, bound
        # The island's own rounds go on, and it says what it refused.
        after = island.next("round")
        assert not after["errored"], after
        assert island.proc.poll() is None
        assert "manager gate: refused /torchft.ManagerService/Kill from 127.0.0.1" in island.log.read_text()
        assert island.stop() == 0, island.log.read_text()[-3000:]  # manager.shutdown stops the gate too
    finally:
        island.kill()


@pytest.mark.timeout(240)
def test_an_island_heals_from_a_peer_through_its_gate(tmp_path, lighthouse):
    key_hex = os.urandom(32).hex()  # with a federation key: the state itself travels signed
    source = Island(tmp_path, lighthouse, 0, 7.0, "127.0.0.2", key_hex)
    healer = None
    try:
        port = int(source.next("manager")["manager"].rsplit(":", 1)[1])
        source.next("round", where=lambda r: r["step"] >= 2)  # ahead of a newcomer
        healer = Island(tmp_path, lighthouse, 1, 0.0, "127.0.0.3", key_hex)
        healed = healer.next("round", timeout=120, where=lambda r: r["healed"])
        # The lighthouse hands out the source's LOCAL_ADDR and port: its gate.
        assert healed["recover_src"] == f"http://127.0.0.2:{port}", healed
        assert healed["w"] == [7.0] * 4 and healed["step"] >= 2 and not healed["errored"], healed
        assert healer.stop() == 0, healer.log.read_text()[-3000:]
        assert source.stop() == 0, source.log.read_text()[-3000:]
    finally:
        source.kill()
        if healer is not None:
            healer.kill()


# ---- where the server and the gate listen (no torchft servers: a stand-in constructor) ----


class _FakeServer:
    """Records how torchft's ManagerServer was built; answers address() as the real one."""

    def __init__(self, bind: str, hostname: str, **kwargs: Any) -> None:
        self.bind, self.hostname, self.closed = bind, hostname, False

    def address(self) -> str:
        return f"http://{self.hostname}:{self.bind.rsplit(':', 1)[1]}"

    def shutdown(self) -> None:
        self.closed = True


def test_the_real_server_stays_inside_a_one_host_island_and_the_gate_takes_local_addr():
    from archipelago.federation.manager_gate import gated_manager_server

    built: list[_FakeServer] = []

    def original(**kwargs: Any) -> _FakeServer:
        if not built:  # the gate's free port is taken on loopback: the next one is tried
            built.append(_FakeServer(**kwargs))
            raise RuntimeError("Address already in use (os error 98)")
        built.append(_FakeServer(**kwargs))
        return built[-1]

    server = gated_manager_server(original, "127.0.0.2")(bind="[::]:0", world_size=1, hostname="127.0.0.2",
                                                         replica_id="r")
    try:
        assert server.gate is not None and len(built) == 2
        port = server.gate.port
        assert built[-1].bind == f"127.0.0.1:{port}" and built[-1].hostname == "127.0.0.2"
        assert server.address() == f"http://127.0.0.1:{port}"  # what the bridge ranks use
        assert server.advertised() == f"http://127.0.0.2:{port}"  # what the lighthouse hands out
        assert ("127.0.0.2", port) in listening(os.getpid())
    finally:
        server.shutdown()
    assert built[-1].closed and ("127.0.0.2", port) not in listening(os.getpid())


def test_without_local_addr_there_is_no_gate_and_the_server_is_on_loopback():
    from archipelago.federation.manager_gate import gated_manager_server

    server = gated_manager_server(_FakeServer, "127.0.0.1")(bind="[::]:0", world_size=1, hostname="127.0.0.1")
    assert server.gate is None and server.server.bind == "127.0.0.1:0"


def test_a_fixed_manager_port_taken_on_local_addr_is_a_clear_error():
    import socket

    from archipelago.federation.manager_gate import ManagerGateError, gated_manager_server

    with socket.socket() as holder:
        holder.bind(("127.0.0.2", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ManagerGateError, match=f"cannot listen on 127.0.0.2:{port}: the port is in use"):
            gated_manager_server(_FakeServer, "127.0.0.2")(bind=f"[::]:{port}", world_size=1, hostname="127.0.0.2")


def test_bridge_ranks_across_nodes_use_master_addr_and_refuse_it_as_local_addr():
    from archipelago.federation.manager_gate import ManagerGateError, internal_host

    node = {"LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}
    assert internal_host(8, "100.64.0.5", node) == "127.0.0.1"  # sync_width <= ranks per node
    assert internal_host(1, "100.64.0.5", {}) == "127.0.0.1"  # no torchrun: one process
    assert internal_host(16, "100.64.0.5", node) == "10.0.0.1"  # the island's own network
    with pytest.raises(ManagerGateError, match="Set LOCAL_ADDR to this host's address on the network the other"):
        internal_host(16, "10.0.0.1", node)
