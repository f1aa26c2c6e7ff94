"""Slow senders against the islands' servers (issue "Trust, third round", items 9 and 10):
the carry server, the healing server and the dashboard each give a peer that sends slowly a
descriptor for a short while, never a handler for long, nor a copy of the state, nor a
growing heap; and a dashboard without a key stays on loopback unless told otherwise."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import tracemalloc
import urllib.request
from datetime import timedelta

import pytest
import torch

from archipelago.config.errors import ConfigError
from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation import carry_link
from archipelago.federation.carry import CarrierBook
from archipelago.federation.carry_link import ROW_PATH, CarryClient, CarryServer, row_frame_bytes
from archipelago.federation.codecs import build_codec
from archipelago.federation.http_serving import FRAME_HEADER
from archipelago.federation.policy import Allowance
from archipelago.federation.transport import SafeHTTPTransport
from archipelago.federation.trust import (
    HEAL_REQUEST,
    HEAL_STATE,
    FederationKey,
    FrameHeader,
    open_frame,
    seal,
)
from archipelago.metrics.dashboard import Dashboard, DashboardState

NUMEL = 1000
CARRIER, THIN = 0, 2
ALLOW = Allowance(max_tokens=4096, max_norm=1e3)
OUTSIDER = "127.0.0.2"  # another host as the carrier sees it (Linux routes all of 127/8 to lo)

pytestmark = pytest.mark.timeout(90)


def _codec():  # noqa: ANN202 - a Codec
    return build_codec(FaultToleranceConfig(codec="int8"), NUMEL)


def _connect(address: tuple, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(address[:2], timeout=10, source_address=(source, 0))


def _answer_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent on `sock` until it closed it, within `seconds`; pytest.fail if
    it still holds it open then."""
    sock.settimeout(seconds)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server still holds the connection after {seconds} s")
    return b"".join(chunks)


@pytest.fixture
def carrier(monkeypatch):  # noqa: ANN201 - (key, server)
    """A carrier whose request_timeout is a minute (the platform's is quorum_timeout, 600 s)."""
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    key = FederationKey(os.urandom(32))
    server = CarryServer(CarrierBook(key, CARRIER, {THIN}), _codec(), ALLOW, request_timeout=60.0)
    server.publish(1, torch.zeros(NUMEL))
    yield key, server
    server.close(wait=False)


def _thin(key: FederationKey, server: CarryServer) -> CarryClient:
    return CarryClient(key, THIN, CARRIER, server.address(), NUMEL, timeout=10)


def test_half_sent_uploads_of_an_outsider_do_not_keep_the_thin_island_from_its_carrier(carrier):
    """Four PUTs with a valid length and a few bytes of body, from a host that never took a
    download, held all four handlers for request_timeout: the thin island's download was
    closed unanswered. Now they are refused at once, before their bodies are read."""
    key, server = carrier
    cap = row_frame_bytes(_codec())
    held = []
    try:
        for _ in range(4):
            sock = _connect(server._server.server_address, OUTSIDER)
            sock.sendall(f"PUT {ROW_PATH} HTTP/1.0\r\nContent-Length: {cap}\r\n\r\nabc".encode())
            held.append(sock)
        time.sleep(0.5)  # each has its head read and a handler, if it gets one
        thin = _thin(key, server)
        thin.upload(thin.download(), 10, _codec(), torch.zeros(NUMEL))
        assert len(server.take_uploads()) == 1
        for sock in held:
            assert _answer_within(sock, 5).startswith(b"HTTP/1.0 403")
    finally:
        for sock in held:
            sock.close()


def test_an_upload_that_stops_halfway_frees_its_handler_after_the_read_limit(carrier, monkeypatch):
    """From the thin island's own host (it took a download), a body that stops arriving is
    dropped after READ_TIMEOUT_S, not after request_timeout; a request head that never ends
    likewise. With one handler, the next download then goes through."""
    monkeypatch.setattr(carry_link, "READ_TIMEOUT_S", 1.0, raising=False)
    key, _ = carrier
    server = CarryServer(CarrierBook(key, CARRIER, {THIN}), _codec(), ALLOW, request_timeout=60.0,
                         max_connections=1)
    stalled = half_head = None
    try:
        server.publish(1, torch.zeros(NUMEL))
        thin = _thin(key, server)
        thin.download()
        stalled = _connect(server._server.server_address)
        stalled.sendall(f"PUT {ROW_PATH} HTTP/1.0\r\nContent-Length: {row_frame_bytes(_codec())}\r\n\r\nabc".encode())
        half_head = _connect(server._server.server_address)
        half_head.sendall(f"GET {carry_link.WEIGHTS_PATH} HTTP/1.0\r\n{FRAME_HEADER}: ".encode())
        assert _answer_within(stalled, 10) == b""  # closed unanswered
        assert _answer_within(half_head, 10) == b""
        assert thin.download().step == 1
    finally:
        for sock in (stalled, half_head):
            if sock is not None:
                sock.close()
        server.close(wait=False)


# ---- the healing server -----------------------------------------------------------------


def test_a_signed_heal_answer_is_sent_without_a_copy_of_the_state_per_request(monkeypatch):
    """seal() built header + state + tag as one new bytes object (and header + state once
    more for the tag): every signed request cost two copies of the state, 16 requests at a
    time. Now the answer goes out as the header, the served state in place and a tag
    computed over both where they lie; the frame is still byte for byte seal's."""
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    secret = os.urandom(32)
    key = FederationKey(secret)
    source = SafeHTTPTransport(timedelta(seconds=30), key=key, island=0)
    state = {"user": {"w": torch.arange(8 << 20, dtype=torch.float32)}, "torchft": {"step": 7, "batches_committed": 1}}
    try:
        source.send_checkpoint([1], 7, state, timedelta(seconds=30))
        size = source._served_bytes
        answer = bytearray(size + (1 << 20))  # allocated before the measurement
        traced = []
        for nonce in (11, 12):
            request = seal(key, FrameHeader(quorum=nonce, step=7, fragment=0, island=1, kind=HEAL_REQUEST), b"")
            sock = _connect(source._server.server_address)
            tracemalloc.start()
            try:
                sock.sendall(f"GET /checkpoint/7/full HTTP/1.0\r\n{FRAME_HEADER}: {request.hex()}\r\n\r\n".encode())
                got, view = 0, memoryview(answer)
                while n := sock.recv_into(view[got:]):
                    got += n
                traced.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
                sock.close()
            head_end = answer.index(b"\r\n\r\n", 0, 4096) + 4
            assert answer.startswith(b"HTTP/1.0 200")
            frame = bytes(answer[head_end:got])
            header, payload = open_frame(key, frame, FrameHeader(nonce, 7, 0, 0, HEAL_STATE), any_island=True)
            assert header.quorum == nonce and payload == source._body
            assert frame == seal(key, FrameHeader(quorum=nonce, step=7, fragment=0, island=0, kind=HEAL_STATE),
                                 source._body)
        assert max(traced) < size / 4, (traced, size)  # seal's way: at least 2 x size
    finally:
        source.shutdown(wait=False)


# ---- the dashboard ----------------------------------------------------------------------


def _push_body(island: int) -> bytes:
    return json.dumps({"island": island, "info": {"ranks": 1}, "time": time.time(), "dropped": 0,
                       "records": [{"step": 1, "loss": 2.0, "tokens": 512}]}).encode()


def _post(address: str, body: bytes) -> int:
    request = urllib.request.Request(f"{address}/push", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def test_slow_pushes_hold_no_dashboard_threads_and_are_closed_at_the_deadline(monkeypatch):
    """werkzeug's threaded server started a thread per connection: 64 pushes whose bodies
    never finish were 64 threads, each held while a byte came every 30 s. Now heads and
    bodies are read without a thread, closed at REQUEST_TIMEOUT_S, and a push through them
    is taken."""
    from archipelago.metrics import dashboard as module

    monkeypatch.setattr(module, "REQUEST_TIMEOUT_S", 1.5, raising=False)
    dashboard = Dashboard("127.0.0.1", 0)
    slow: list[socket.socket] = []
    try:
        threads = threading.active_count()
        address = dashboard.server.server_address
        for _ in range(64):
            sock = _connect(address)
            sock.sendall(b"POST /push HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"island\"")
            slow.append(sock)
        time.sleep(0.5)
        assert threading.active_count() - threads <= 16
        assert _post(dashboard.address, _push_body(3)) == 200
        assert [i["island"] for i in dashboard.state.snapshot()["islands"]] == [3]
        for sock in slow:
            assert _answer_within(sock, 5) == b""  # closed unanswered at the deadline
    finally:
        for sock in slow:
            sock.close()
        dashboard.shutdown()


def test_the_push_bodies_waiting_on_the_dashboard_take_at_most_their_budget(monkeypatch):
    """Bodies read without a thread wait in memory: at most PENDING_BODY_BYTES of them, the
    oldest closed for a newer one (a member's push, sent at once, is the newest)."""
    from archipelago.federation import http_serving

    monkeypatch.setattr(http_serving, "PENDING_BODY_BYTES", 4 << 20, raising=False)
    dashboard = Dashboard("127.0.0.1", 0)
    slow: list[socket.socket] = []
    try:
        for _ in range(8):  # each declares 1 MiB and sends one byte of it
            sock = _connect(dashboard.server.server_address)
            sock.sendall(b"POST /push HTTP/1.0\r\nContent-Length: 1048576\r\n\r\n{")
            slow.append(sock)
            time.sleep(0.05)
        for sock in slow[:4]:
            assert _answer_within(sock, 5) == b""  # made room for the four after them
        for sock in slow[4:]:
            sock.settimeout(0.3)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        assert _post(dashboard.address, _push_body(1)) == 200
    finally:
        for sock in slow:
            sock.close()
        dashboard.shutdown()


def test_made_up_island_ids_keep_the_dashboard_bounded():
    """Every new island id was kept forever (3,000 pushes: +256 MB). Now the least recently
    pushed island is forgotten past MAX_ISLANDS, and an island that keeps pushing stays."""
    state = DashboardState()
    records = [{"step": s, "loss": 5.0, "val_loss": 5.5, "tokens": 512.0 * s} for s in range(1, 201)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for island in range(1, 1001):
            state.ingest({"island": 10_000 + island, "info": {"device": "x" * 200}, "records": records})
            if island % 10 == 0:
                state.ingest({"island": 0, "records": [{"step": island, "loss": 4.0}]})
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    ids = [i["island"] for i in state.snapshot()["islands"]]
    assert len(ids) <= 256 and 0 in ids and 11_000 in ids and 10_001 not in ids
    assert grown < 16 << 20, grown  # 1,000 islands of 200 points each: ~35 MB before
    island = next(i for i in state.snapshot()["islands"] if i["island"] == 11_000)
    assert island["curve"][-1] == [512.0 * 200, 5.0, 5.5] and len(island["curve"]) == 200


def test_a_keyless_dashboard_beyond_loopback_is_refused_unless_insecure():
    from archipelago.launch.lighthouse import start_dashboard

    with pytest.raises(ConfigError, match="--insecure"):
        start_dashboard("192.0.2.1:0")  # a documentation address: refused before it is bound
    with pytest.raises(ConfigError, match="--federation_security.insecure"):  # archipelago local's names
        start_dashboard("[2001:db8::1]:0", None, False,
                        ("--dashboard", "--federation_security.key_file", "--federation_security.insecure"))
    from archipelago.metrics.dashboard import refuse_open_without_key

    for host in ("0.0.0.0", "::", "10.0.0.1", "dashboard.example"):
        with pytest.raises(ConfigError, match="secret new --out"):
            refuse_open_without_key(host, None, insecure=False)
        refuse_open_without_key(host, None, insecure=True)
        refuse_open_without_key(host, lambda *_: True, insecure=False)  # with a key's verifier
    for host in ("127.0.0.1", "::1", "localhost"):
        refuse_open_without_key(host, None, insecure=False)
    dashboard = start_dashboard("127.0.0.1:0")  # loopback: served without a key, as before
    dashboard.shutdown()


@pytest.mark.timeout(120)
def test_archipelago_lighthouse_refuses_a_keyless_dashboard_beyond_loopback_naming_the_fix():
    from conftest import run_cli

    done = run_cli(["lighthouse", "--bind", "127.0.0.1:0", "--dashboard", "192.0.2.1:0"], timeout=60,
                   env={"ARCHIPELAGO_FEDERATION_KEY_FILE": ""})
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.output
    assert "--key-file" in errors[0] and "--insecure" in errors[0] and "Traceback" not in done.output
