"""Healing without pickle: the state format, the transport, and what a healing island refuses."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.transport import MAGIC, SafeHTTPTransport, StateFormatError, decode_state, encode_state

TIMEOUT = timedelta(seconds=5)


def _state() -> dict:
    return {"user": {"archipelago_outer": {
                "fingerprint": {"model": "llama3/debug", "params": 12, "island": 1},
                "inner_step": 40, "federation_tokens": 81920,
                "guard": torch.tensor([[1.5, float("nan")]], dtype=torch.float64),
                "fragments": [{"global": torch.arange(6.0).view(2, 3),
                               "outer": {"momentum_buffer": torch.ones(2, 3)}},
                              {"global": torch.tensor([1, 2], dtype=torch.int64), "outer": {}}]}},
            "torchft": {"step": 7, "batches_committed": 14}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b and type(a) is type(b)


def test_a_state_round_trips_with_its_structure_dtypes_and_numbers():
    state = _state()
    assert _equal(decode_state(encode_state(7, state), 7), state)
    assert not _equal(decode_state(encode_state(7, {**state, "torchft": {"step": 8}}), 7), state)


def _with_header(blob: bytes, change) -> bytes:
    (size,) = struct.unpack(">Q", blob[8:16])
    header = change(json.loads(blob[16:16 + size]))
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack(">Q", len(raw)) + raw + blob[16 + size:]


@pytest.mark.parametrize("damage", [
    lambda b: b[:-1],                                   # truncated body
    lambda b: b"X" + b[1:],                             # not our magic
    lambda b: b[:8] + struct.pack(">Q", 1 << 40) + b[16:],  # header larger than the message
    lambda b: b[:16] + b"<" + b[17:],                   # header that is not JSON
    lambda b: _with_header(b, lambda h: {**h, "step": 8}),  # another step's state
    lambda b: _with_header(b, lambda h: {**h, "tree": {"p": "os.system"}}),  # an unknown node
    lambda b: _with_header(b, lambda h: {**h, "tree": {"d": {"a": {"t": "t0"}, "b": {"t": "t0"}}}}),  # reused
    lambda b: _with_header(b, lambda h: {**h, "tree": {"d": {}}}),  # tensors the tree does not use
    lambda b: _with_header(b, lambda h: {**h, "tree": {"v": {"nested": 1}}}),  # a value that is not a scalar
], ids=["truncated", "magic", "huge-header", "not-json", "other-step", "unknown-node", "reused-tensor",
        "unused-tensors", "non-scalar"])
def test_a_damaged_or_forged_state_is_refused(damage):
    with pytest.raises(StateFormatError):
        decode_state(damage(encode_state(7, _state())), 7)


def test_a_pickle_is_refused_and_never_loaded(monkeypatch):
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    with pytest.raises(StateFormatError, match="bad magic"):
        decode_state(pickle.dumps(Boom()), 7)


def test_objects_that_are_not_data_are_not_sent():
    with pytest.raises(TypeError, match="cannot send a"):
        encode_state(1, {"fn": print})
    with pytest.raises(TypeError, match="keys must be strings"):
        encode_state(1, {3: torch.ones(1)})


def test_the_transport_serves_the_sent_step_without_pickle_and_binds_loopback(monkeypatch):
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    def forbidden(*args, **kwargs):
        pytest.fail("unpickling on the healing path")

    for module, name in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(module, name, forbidden)
    # A request between rounds waits for the next state this long, then gets nothing.
    source, healing = SafeHTTPTransport(timedelta(seconds=1)), SafeHTTPTransport(TIMEOUT)
    try:
        host, port = source._server.server_address[:2]
        assert host == "127.0.0.1" and source.metadata() == f"http://127.0.0.1:{port}/checkpoint/"
        source.send_checkpoint([1], 7, _state(), TIMEOUT)
        assert _equal(healing.recv_checkpoint(0, source.metadata(), 7, TIMEOUT), _state())
        with pytest.raises(urllib.error.HTTPError, match="404"):  # another step than the one served
            urllib.request.urlopen(f"{source.metadata()}6/full", timeout=5)
        source.disallow_checkpoint()
        with pytest.raises(urllib.error.HTTPError, match="404"):  # nothing is served between rounds
            urllib.request.urlopen(f"{source.metadata()}7/full", timeout=10)
    finally:
        source.shutdown(wait=True)
        healing.shutdown(wait=True)


def test_a_state_that_does_not_hold_the_requested_step_is_refused():
    source, healing = SafeHTTPTransport(TIMEOUT), SafeHTTPTransport(TIMEOUT)
    try:
        source.send_checkpoint([1], 7, {**_state(), "torchft": {"step": 9, "batches_committed": 1}}, TIMEOUT)
        with pytest.raises(StateFormatError, match="does not hold federation step 7"):
            healing.recv_checkpoint(0, source.metadata(), 7, TIMEOUT)
    finally:
        source.shutdown(wait=True)
        healing.shutdown(wait=True)


@pytest.mark.parametrize("address", ["127.0.0.2", "::1"])
def test_the_transport_binds_local_addr(monkeypatch, address):
    if address == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    monkeypatch.setenv("LOCAL_ADDR", address)
    transport = SafeHTTPTransport(TIMEOUT)
    try:
        assert transport._server.server_address[0] == address
        host = f"[{address}]" if ":" in address else address
        assert transport.metadata().startswith(f"http://{host}:")
    finally:
        transport.shutdown(wait=False)


def test_a_healing_island_refuses_a_state_not_shaped_like_its_own():
    from archipelago.federation.diloco import _shape_problem

    ours = _state()["user"]["archipelago_outer"]
    assert _shape_problem(ours, _state()["user"]["archipelago_outer"], "state") is None  # NaN padding of the guard

    def changed(edit) -> str | None:
        theirs = _state()["user"]["archipelago_outer"]
        edit(theirs)
        return _shape_problem(ours, theirs, "state")

    assert "shape (2, 3)" in changed(lambda s: s["fragments"][0].update({"global": torch.zeros(3, 2)}))
    assert "torch.float32" in changed(lambda s: s["fragments"][0].update({"global": torch.zeros(2, 3).double()}))
    assert "not finite" in changed(lambda s: s["fragments"][0]["global"].fill_(float("inf")))
    assert "not finite" in changed(lambda s: s["fragments"][0]["outer"]["momentum_buffer"].fill_(float("nan")))
    assert "not finite" in changed(lambda s: s["guard"].fill_(-1.0))  # norms are >= 0
    assert "list of 2" in changed(lambda s: s["fragments"].pop())
    assert "whole number" in changed(lambda s: s.update({"federation_tokens": -5}))
    assert "whole number" in changed(lambda s: s.update({"inner_step": 1.5}))
    assert "keys" in changed(lambda s: s.pop("guard"))


def test_a_garbage_fingerprint_is_described_and_refused_not_a_crash():
    from archipelago.federation.membership import describe, fingerprint, mismatch

    mine = fingerprint("llama3/debug", [("w", (2, 3))], FaultToleranceConfig(enable=True), 1)
    assert "island ? (? rank(s))" in describe({})
    problem = mismatch(mine, {"model": 5, "params": "many"})
    assert problem is not None and "llama3/debug" in problem and "differs in: model, params" in problem


# ---- with a federation key: signed both ways ------------------------------------------


def _keyed(secret: bytes, island: int, seconds: float = 5) -> SafeHTTPTransport:
    from archipelago.federation.trust import FederationKey

    return SafeHTTPTransport(timedelta(seconds=seconds), key=FederationKey(secret), island=island)


def _get(url: str, frame_hex: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if frame_hex is not None:
        request.add_header("X-Archipelago-Frame", frame_hex)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_with_a_key_only_a_member_gets_the_state_and_only_from_a_member(monkeypatch):
    import os

    from archipelago.federation.trust import HEAL_REQUEST, FederationKey, FrameHeader, FrameRefused, seal

    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    secret, other = os.urandom(32), os.urandom(32)
    source, member, outsider = _keyed(secret, 0), _keyed(secret, 1), _keyed(other, 1)
    plain = SafeHTTPTransport(TIMEOUT)
    try:
        source.send_checkpoint([1], 7, _state(), TIMEOUT)
        assert _equal(member.recv_checkpoint(0, source.metadata(), 7, TIMEOUT), _state())
        url = f"{source.metadata()}7/full"
        status, body = _get(url)  # no signed request: no state bytes
        assert status == 403 and b"ARCHST01" not in body and len(body) < 1000
        with pytest.raises(FrameRefused, match="HTTP 403.*another federation key"):
            outsider.recv_checkpoint(0, source.metadata(), 7, TIMEOUT)
        request = seal(FederationKey(secret), FrameHeader(quorum=99, step=7, fragment=0, island=1,
                                                          kind=HEAL_REQUEST), b"").hex()
        assert _get(url, request)[0] == 200
        assert _get(url, request)[0] == 403  # the same request again: a replay
        plain.send_checkpoint([1], 7, _state(), TIMEOUT)
        with pytest.raises(FrameRefused, match="does not hold this federation's key"):  # nobody signed it
            member.recv_checkpoint(0, plain.metadata(), 7, TIMEOUT)
        third = _keyed(other, 0)
        try:
            third.send_checkpoint([1], 7, _state(), TIMEOUT)
            with pytest.raises(FrameRefused, match="HTTP 403"):  # it refuses our request,
                member.recv_checkpoint(0, third.metadata(), 7, TIMEOUT)
        finally:
            third.shutdown(wait=False)
    finally:
        for transport in (source, member, outsider, plain):
            transport.shutdown(wait=False)


def _listening(pid: str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc)."""
    import ipaddress
    import os

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
        with open(f"/proc/net/{table}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                found.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("address", [None, pytest.param("127.0.0.2", marks=pytest.mark.slow)],
                         ids=["loopback", "local-addr"])
def test_an_islands_manager_store_and_transport_listen_on_its_address_only(monkeypatch, address):
    from torchft.coordination import LighthouseServer

    from archipelago.federation.membership import build_manager

    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_ADDR"):
        monkeypatch.delenv(name, raising=False)
    if address:
        monkeypatch.setenv("LOCAL_ADDR", address)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    before = _listening()
    manager = None
    try:
        ft = FaultToleranceConfig(enable=True, lighthouse=lighthouse.address())
        manager = build_manager(ft, 0, 1)
        opened = _listening() - before
        # The manager server, the rendezvous store and the healing transport: nothing else,
        # and nothing on every interface (0.0.0.0 / ::).
        assert len(opened) == 3, opened
        assert {host for host, _ in opened} == {address or "127.0.0.1"}, opened
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
        lighthouse.shutdown()


def _alive(pid: int) -> bool:
    """True unless `pid` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _process_tree(pid: int) -> list[int]:
    out = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for child in children:
            out += _process_tree(int(child))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("address", [None, pytest.param("127.0.0.2", marks=pytest.mark.slow)],
                         ids=["loopback", "local-addr"])
def test_a_multi_rank_islands_rendezvous_stores_listen_on_its_address_only(tmp_path, address):
    import subprocess
    import sys
    import time

    from conftest import ROOT, TINY

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_ADDR", "MASTER_ADDR", "MASTER_PORT")}
    if address:
        env["LOCAL_ADDR"] = address
    log = tmp_path / "island.log"
    proc = subprocess.Popen([sys.executable, "-m", "archipelago.launch.cli", "train", "--nproc", "2", *TINY,
                             "--training.steps", "400", "--job.run_dir", str(tmp_path / "run")],
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "step 1" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert proc.poll() is None and "step 1" in log.read_text(), log.read_text()[-3000:]
        tree = _process_tree(proc.pid)
        agent = _listening(str(proc.pid))
        ranks = set().union(*(_listening(str(pid)) for pid in tree[1:]))
        # torchrun's agent hosts two stores (rendezvous, and the one the ranks share): both
        # on the island's address; nothing of the island listens on every interface.
        assert len(agent) == 2 and {host for host, _ in agent} == {address or "127.0.0.1"}, agent
        assert not {host for host, _ in agent | ranks} & {"0.0.0.0", "::"}, agent | ranks
    finally:
        # The ranks run in sessions of their own: kill every process of the tree by PID,
        # the ranks first (the agent, killed first, could not stop them).
        tree = _process_tree(proc.pid) if proc.poll() is None else [proc.pid]
        for pid in reversed(tree):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        for pid in tree[1:]:  # reaped by the agent's death: gone, or about to be
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(pid), f"rank process {pid} survived"
