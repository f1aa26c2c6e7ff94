"""Healing without pickle: the state format, the transport, and what a healing island refuses."""

from __future__ import annotations

import _socket
import contextlib
import json
import os
import pickle
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch
from conftest import listening

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.state_format import MAGIC, StateFormatError, decode_state, encode_state
from archipelago.federation.transport import HealingRefused, SafeHTTPTransport
from archipelago.federation.trust import FederationKey

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
    from archipelago.federation.healing import shape_problem as _shape_problem

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
    before = listening()
    manager = None
    try:
        ft = FaultToleranceConfig(enable=True, lighthouse=lighthouse.address())
        manager = build_manager(ft, 0, 1)
        opened = listening() - before
        # The manager server, the rendezvous store and the healing transport: nothing else,
        # and nothing on every interface (0.0.0.0 / ::). With LOCAL_ADDR the manager server
        # itself stays on loopback and its gate takes the same port on LOCAL_ADDR.
        if not address:
            assert len(opened) == 3, opened
            assert {host for host, _ in opened} == {"127.0.0.1"}, opened
        else:
            assert len(opened) == 4, opened
            assert {host for host, _ in opened} == {"127.0.0.1", address}, opened
            [(_, port)] = [o for o in opened if o[0] == "127.0.0.1"]
            assert (address, port) in opened
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
        agent = listening(str(proc.pid))
        ranks = set().union(*(listening(str(pid)) for pid in tree[1:]))
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


# ---- a peer's URL, size and pace are hostile too ---------------------------------------


@contextlib.contextmanager
def _hostile_peer(answer):
    """A TCP server on loopback that reads each request head and then runs `answer(conn,
    stop)`: a peer that advertises itself as a healing source and answers as it likes.
    Yields (its healing URL, the stop event)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def one(conn: socket.socket) -> None:
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head and not stop.is_set():
                    head += conn.recv(4096) or b"\r\n\r\n"
                answer(conn, stop)
            except OSError:  # the healing island hung up: what it should
                pass

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/checkpoint/", stop
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _received_from(monkeypatch, port: int) -> list[int]:
    """A list whose sum is every byte this process receives from `port` from now on (both
    urllib's http.client and ours read with socket.recv_into)."""
    got: list[int] = []

    def counting(sock, *args, **kwargs):
        n = _socket.socket.recv_into(sock, *args, **kwargs)
        try:
            if sock.getpeername()[1] == port:
                got.append(n)
        except OSError:
            pass
        return n

    monkeypatch.setattr(socket.socket, "recv_into", counting)
    return got


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _in_thread(fn, seconds: float) -> tuple[bool, BaseException | None, float, object]:
    """(finished within `seconds`, what it raised, how long it took, what it returned):
    `fn` runs in a thread left behind if it does not end (the original transport read a
    slow peer forever)."""
    out: dict = {}

    def run() -> None:
        start = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        out["s"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), out.get("error"), out.get("s", seconds), out.get("value")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("url", [
    "file://{tmp}/state#", "data:application/octet-stream;base64,QVJDSFNUMDE=#", "ftp://127.0.0.1:1/state#",
    "https://127.0.0.1:1/checkpoint/", "http://127.0.0.1/checkpoint/", "http://island:pw@127.0.0.1:1/checkpoint/",
    "http://127.0.0.1:1/other/", "http://127.0.0.1:1/checkpoint/?x=", "http://127.0.0.1:1/check point/",
], ids=["file", "data", "ftp", "https", "no-port", "credentials", "other-path", "query", "space"])
def test_a_peer_advertising_anything_but_a_healing_url_is_refused_before_anything_is_read(
        monkeypatch, tmp_path, url):
    import urllib.request

    # A URL ending in '#' made the original `metadata + "7/full"` a fragment: it read the
    # file (a regular one here, not /dev/zero: the original would read it whole).
    (tmp_path / "state").write_bytes(os.urandom(4 << 20))
    opened = []
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", lambda *a, **k: opened.append(a) or pytest.fail(
        "urllib's opener (with file:, ftp: and data: handlers) was reached"))
    healing = SafeHTTPTransport(TIMEOUT)
    try:
        start = time.monotonic()
        with pytest.raises(HealingRefused, match="refusing to heal from") as refused:
            healing.recv_checkpoint(0, url.format(tmp=tmp_path), 7, TIMEOUT)
        assert time.monotonic() - start < 1 and not opened
        assert "stop that process" in str(refused.value)
    finally:
        healing.shutdown(wait=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "streamed"])
def test_an_answer_over_the_size_cap_is_refused_after_at_most_the_cap(monkeypatch, declared):
    cap, size = 256 << 10, 8 << 20

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\n" + (f"Content-Length: {size}\r\n".encode() if declared else b"") + b"\r\n")
        chunk = b"\0" * (64 << 10)
        for _ in range(size // len(chunk)):
            conn.sendall(chunk)

    healing = SafeHTTPTransport(TIMEOUT, max_state_bytes=cap)
    try:
        with _hostile_peer(answer) as (url, _):
            received = _received_from(monkeypatch, _port(url))
            refusal = f"over the cap of {cap}" if declared else f"more than the cap of {cap}"
            with pytest.raises(HealingRefused, match=refusal):
                healing.recv_checkpoint(0, url, 7, TIMEOUT)
            # cap + 1 bytes of the body, and what one buffered read of the socket takes in.
            assert sum(received) <= cap + 1 + (64 << 10), sum(received)
            if declared:
                assert sum(received) <= 64 << 10  # refused on the header: none of the body read
    finally:
        healing.shutdown(wait=False)


def test_the_size_cap_comes_from_the_islands_own_state():
    from archipelago.federation.state_format import encoded_size
    from archipelago.federation.transport import _memory_cap, heal_cap

    state = _state()
    assert len(encode_state(7, state)) <= encoded_size(7, state) <= len(encode_state(7, state)) + 1024
    secret = os.urandom(32)
    source, member = _keyed(secret, 0), _keyed(secret, 1)
    try:
        assert member.state_cap() == _memory_cap()  # nothing set, nothing served
        source.send_checkpoint([1], 7, state, TIMEOUT)
        assert source.state_cap() == heal_cap(len(encode_state(7, state)))  # the size it serves
        assert member.expect_state_like(state) == member.max_state_bytes == heal_cap(encoded_size(0, state))
        assert _equal(member.recv_checkpoint(0, source.metadata(), 7, TIMEOUT), state)  # signed, under the cap
        bigger = {**state, "user": {**state["user"], "extra": torch.zeros(1 << 20)}}  # 4 MiB more
        source.send_checkpoint([1], 7, bigger, TIMEOUT)
        with pytest.raises(HealingRefused, match="over the cap.*expect_state_like"):
            member.recv_checkpoint(0, source.metadata(), 7, TIMEOUT)
    finally:
        source.shutdown(wait=False)
        member.shutdown(wait=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_slow_drip_peer_is_given_up_at_the_deadline(phase):
    prefix = b"HTTP/1.0 200 OK\r\n" + (b"X-Drip: " if phase == "headers" else b"Content-Length: 1000\r\n\r\n")

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(prefix)
        while not stop.wait(0.5):  # a byte every half second: no per-socket timeout trips
            conn.sendall(b"a")

    healing = SafeHTTPTransport(TIMEOUT)
    try:
        with _hostile_peer(answer) as (url, _):
            done, error, seconds, _ = _in_thread(
                lambda: healing.recv_checkpoint(0, url, 7, timedelta(seconds=2)), 10)
            assert done, "still reading a slow-drip peer after 10 s: no deadline over the whole fetch"
            assert isinstance(error, HealingRefused) and "within the healing timeout of 2 s" in str(error), error
            assert seconds < 6
    finally:
        healing.shutdown(wait=False)


def test_a_source_on_another_host_than_the_quorums_member_or_a_redirect_is_refused(monkeypatch):
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    source, healing = SafeHTTPTransport(TIMEOUT), SafeHTTPTransport(TIMEOUT)
    try:
        source.send_checkpoint([1], 7, _state(), TIMEOUT)
        healing.expect_source("127.0.0.2")
        with pytest.raises(HealingRefused, match="host '127.0.0.1' is not '127.0.0.2'"):
            healing.recv_checkpoint(0, source.metadata(), 7, TIMEOUT)
        healing.expect_source("http://127.0.0.1:29500")  # the member's manager address
        assert _equal(healing.recv_checkpoint(0, source.metadata(), 7, TIMEOUT), _state())
        healing.expect_source(None)

        def redirect(conn: socket.socket, stop: threading.Event) -> None:
            conn.sendall(f"HTTP/1.0 302 Found\r\nLocation: {source.metadata()}7/full\r\n\r\n".encode())

        with _hostile_peer(redirect) as (url, _):
            with pytest.raises(HealingRefused, match="redirect"):
                healing.recv_checkpoint(0, url, 7, TIMEOUT)
    finally:
        source.shutdown(wait=False)
        healing.shutdown(wait=False)


def _closed(sock: socket.socket) -> bool:
    """The server closed `sock` (a reset: it closed with bytes of ours unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _healing_threads() -> int:
    return sum(t.name == "archipelago-request" for t in threading.enumerate())


@pytest.mark.timeout(60)
def test_a_flood_of_idle_connections_holds_no_threads_and_is_closed_at_the_timeout(monkeypatch):
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    secret = os.urandom(32)
    source = SafeHTTPTransport(TIMEOUT, key=FederationKey(secret), island=0, request_timeout=timedelta(seconds=1))
    member = _keyed(secret, 1)
    flood: list[socket.socket] = []
    try:
        source.send_checkpoint([1], 7, _state(), TIMEOUT)
        host, port = source._server.server_address[:2]
        threads = threading.active_count()
        flood = [socket.create_connection((host, port), timeout=5) for _ in range(64)]
        for sock in flood[::2]:
            sock.sendall(b"GET /checkpoint/7/full HTTP/1.0\r\n")  # half a request head, never ended
        time.sleep(0.5)
        assert threading.active_count() - threads <= 16
        start = time.monotonic()  # a member's signed request is answered through the flood
        assert _equal(member.recv_checkpoint(0, source.metadata(), 7, TIMEOUT), _state())
        assert time.monotonic() - start < 3
        time.sleep(1.5)  # past the request timeout: every idle connection was closed
        assert all(_closed(sock) for sock in flood)
    finally:
        for sock in flood:
            sock.close()
        source.shutdown(wait=False)
        member.shutdown(wait=False)


@pytest.mark.timeout(60)
def test_the_server_handles_at_most_max_connections_requests_and_closes_the_rest(monkeypatch):
    import selectors

    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    source = SafeHTTPTransport(timedelta(seconds=5))  # nothing served: each request waits 5 s for a state
    clients: list[socket.socket] = []
    try:
        host, port = source._server.server_address[:2]
        threads = threading.active_count()
        for _ in range(20):
            clients.append(socket.create_connection((host, port), timeout=5))
            clients[-1].sendall(b"GET /checkpoint/9/full HTTP/1.0\r\n\r\n")
        time.sleep(1)
        assert threading.active_count() - threads <= 16 and _healing_threads() <= 16
        with selectors.DefaultSelector() as selector:
            for sock in clients:
                selector.register(sock, selectors.EVENT_READ)
            closed = [key.fileobj for key, _ in selector.select(1)]
        assert len(closed) == 4 and all(_closed(sock) for sock in closed)  # unanswered, at once
    finally:
        for sock in clients:
            sock.close()
        source.shutdown(wait=False)


@pytest.mark.timeout(60)
def test_an_oversized_request_head_is_closed_and_the_oldest_idle_connection_makes_room(monkeypatch):
    from archipelago.federation import http_serving as module

    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    monkeypatch.setattr(module, "MAX_PENDING", 8)
    source = SafeHTTPTransport(TIMEOUT)
    clients: list[socket.socket] = []
    try:
        host, port = source._server.server_address[:2]
        big = socket.create_connection((host, port), timeout=5)
        clients.append(big)
        big.sendall(b"GET /checkpoint/7/full HTTP/1.0\r\nX-Pad: " + b"a" * (module.MAX_REQUEST_BYTES + 10))
        assert _closed(big)  # without an answer, long before the 15 s timeout
        for _ in range(20):
            clients.append(socket.create_connection((host, port), timeout=5))
            time.sleep(0.01)
        time.sleep(0.5)
        assert all(_closed(sock) for sock in clients[1:13])  # the oldest made room for the newest
        for sock in clients[13:]:
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sock.recv(1)
    finally:
        for sock in clients:
            sock.close()
        source.shutdown(wait=False)
