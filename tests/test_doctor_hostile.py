"""`archipelago doctor` against someone hostile: a flood of connections or a slow drip at a
serving doctor, a `reach` aimed at a third host, and a peer whose answers are malformed.

Every server here listens on loopback at an ephemeral port and is stopped by its event;
every socket a test opens is closed in a `finally` block.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from archipelago.launch import doctor, doctor_checks, doctor_peer

HANDLERS = getattr(doctor_peer, "MAX_HANDLERS", 8)  # the base commit had no cap: the tests use 8 there


@pytest.fixture()
def server() -> Iterator[tuple[str, int]]:
    """A serving doctor on 127.0.0.1 (no config) until the test ends."""
    stop = threading.Event()
    served = doctor_peer.serve("127.0.0.1", 0, None, stop)
    yield "127.0.0.1", served.getsockname()[1]
    stop.set()


@contextlib.contextmanager
def _sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for s in opened:
            s.close()


def _line(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _answer_or_close(conn: socket.socket, timeout: float = 20.0) -> bytes:
    """The next bytes the server sends, b"" when it closed the connection unanswered."""
    conn.settimeout(timeout)
    try:
        return conn.recv(4096)
    except ConnectionResetError:
        return b""


def _closed_by_peer(conn: socket.socket, drip: bytes, within_s: float) -> bool:
    """Send `drip` a byte every 0.2 s until the server closes the connection (True) or `within_s` pass."""
    ends = time.monotonic() + within_s
    for byte in drip:
        if time.monotonic() > ends:
            return False
        try:
            conn.sendall(bytes([byte]))
        except OSError:  # a reset: closed
            return True
        readable, _, _ = select.select([conn], [], [], 0.2)
        if readable and _answer_or_close(conn) == b"":
            return True
    return False


@pytest.mark.timeout(120)
def test_idle_connections_cost_no_thread_and_checks_beyond_the_cap_are_closed_and_logged_once(server, caplog):
    caplog.set_level(logging.WARNING, logger="archipelago.doctor")
    before = threading.active_count()
    with _sockets() as opened:
        for _ in range(100):  # connected, never sending a byte
            opened.append(socket.create_connection(server, timeout=10))
        time.sleep(1.0)  # the server has accepted them (it answered the later checks on the same thread)
        assert threading.active_count() < before + 10, "a thread per idle connection"
        held = []
        for _ in range(HANDLERS):  # checks in progress: each holds a handler
            conn = socket.create_connection(server, timeout=10)
            held.append(conn)
            _line(conn, {"op": "hello"})
            assert b'"op": "hello"' in _answer_or_close(conn)
        opened += held
        for _ in range(3):  # one more from the same source, three times: closed unanswered, logged once
            extra = socket.create_connection(server, timeout=10)
            opened.append(extra)
            _line(extra, {"op": "hello"})
            assert _answer_or_close(extra) == b"", "a check beyond the cap was answered"
        refusals = [r for r in caplog.records if "checks are being answered" in r.getMessage()]
        assert len(refusals) == 1 and "127.0.0.1" in refusals[0].getMessage(), caplog.text
        for conn in held:
            conn.close()
        time.sleep(0.5)  # the handlers see the closes
        checks = doctor_peer.check_peer(f"{server[0]}:{server[1]}", None)
        assert [c.status for c in checks] == ["ok", "ok", "info", "ok"], checks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", ["first line", "later line"])
def test_a_peer_that_drips_a_line_is_closed_by_its_deadline(server, monkeypatch, stage):
    """Each line of a check must arrive within MESSAGE_S (1 s here): a byte every 0.2 s is a
    recv every 0.2 s, which a per-recv timeout (the base's 30 s) never trips."""
    monkeypatch.setattr(doctor_peer, "MESSAGE_S", 1.0, raising=False)
    with _sockets() as opened:
        conn = socket.create_connection(server, timeout=10)
        opened.append(conn)
        if stage == "later line":
            _line(conn, {"op": "hello"})
            assert b'"op": "hello"' in _answer_or_close(conn)
        assert _closed_by_peer(conn, b" " * 4000, within_s=20), "the server waited for a dripping line"


@pytest.fixture()
def listener_on() -> Iterator[Callable[[str], tuple[int, list[bytes]]]]:
    """listen(host) -> (port, what arrives there): a listener that records the first bytes of each connection."""
    stops: list[socket.socket] = []

    def listen(host: str) -> tuple[int, list[bytes]]:
        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen()
        sock.settimeout(0.2)
        stops.append(sock)
        got: list[bytes] = []

        def accept() -> None:
            while sock.fileno() >= 0:
                try:
                    incoming, _ = sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with incoming:
                    incoming.settimeout(5)
                    got.append(incoming.recv(100))

        threading.Thread(target=accept, daemon=True).start()
        return sock.getsockname()[1], got

    yield listen
    for sock in stops:
        sock.close()


def _ask(server: tuple[str, int], message: dict[str, Any]) -> Any:
    with socket.create_connection(server, timeout=20) as conn, conn.makefile("rb") as reader:
        doctor_peer._send(conn, message)
        return doctor_peer._receive(reader)["error"]


@pytest.mark.timeout(60)
def test_reach_connects_back_only_to_the_address_the_check_comes_from(server, listener_on):
    """An asker on 127.0.0.1 names a third host (127.0.0.2, another loopback address, standing
    for any host the serving doctor reaches): refused, and nothing connects there."""
    third_port, third = listener_on("127.0.0.2")
    token = "ab" * 16
    error = _ask(server, {"op": "reach", "host": "127.0.0.2", "port": third_port, "token": token})
    assert error and "connects back only to the address a check comes from (127.0.0.1)" in error, error
    time.sleep(0.5)
    assert third == [], "the serving doctor probed a host it was told"
    own_port, own = listener_on("127.0.0.1")  # the asker's own address: the probe goes there
    assert _ask(server, {"op": "reach", "port": own_port, "token": token}) is None
    assert _ask(server, {"op": "reach", "host": "127.0.0.1", "port": own_port, "token": token}) is None
    time.sleep(0.5)
    assert own == [token.encode() + b"\n"] * 2


@pytest.mark.timeout(60)
def test_one_reach_probe_at_a_time_per_asker(server, monkeypatch):
    release, started = threading.Event(), threading.Event()

    def slow_probe(address, port, token):  # a probe that takes as long as the test wants
        started.set()
        release.wait(20)
        return None

    monkeypatch.setattr(doctor_peer, "_connect_back", slow_probe, raising=False)
    port = socket.socket()
    port.bind(("127.0.0.1", 0))  # a port nothing listens on: a probe there is refused at once
    closed = port.getsockname()[1]
    port.close()
    first: list[Any] = []
    ask = {"op": "reach", "host": "127.0.0.1", "port": closed}
    asking = threading.Thread(target=lambda: first.append(_ask(server, {**ask, "token": "ab" * 16})), daemon=True)
    asking.start()
    try:
        started.wait(10)  # the first probe is in flight (on the base commit it never is: it ended at once)
        second = _ask(server, {**ask, "token": "cd" * 16})
        assert second == "another reach check from 127.0.0.1 is running: one at a time", second
    finally:
        release.set()
        asking.join(20)
    assert first == [None]
    assert _ask(server, {**ask, "token": "cd" * 16}) is None  # the slot is free again


def _real(op: str, message: dict[str, Any]) -> dict[str, Any]:
    """What a serving doctor answers to `message`."""
    if op == "hello":
        return doctor_peer.hello(None)
    if op == "ping":
        return {"op": "pong", "time": time.time()}
    if op == "bandwidth":
        return {"op": "received", "bytes": message["bytes"]}
    return {"op": "reached", "error": None}


@contextlib.contextmanager
def _rogue(answers: dict[str, Any]) -> Iterator[str]:
    """A peer speaking the protocol, answering each op in `answers` with that raw line
    (bytes) or object instead of a serving doctor's answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)

    def answer(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            while line := reader.readline(8192):
                message = json.loads(line)
                op = message["op"]
                if op == "bandwidth":
                    reader.read(message["bytes"])
                reply = answers.get(op, _real(op, message))
                conn.sendall(reply if isinstance(reply, bytes) else json.dumps(reply).encode() + b"\n")

    def serve() -> None:
        while listener.fileno() >= 0:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


HOSTILE = {
    "a time that is a list": {"hello": {**doctor_peer.hello(None), "time": []}},
    "a time past float's range": {"hello": f'{{"op": "hello", "time": 1{"0" * 400}}}\n'.encode()},
    "a time that is an object": {"hello": {**doctor_peer.hello(None), "time": {"t": 1}}},
    "a time that is true": {"hello": {**doctor_peer.hello(None), "time": True}},
    "NaN for a time": {"hello": b'{"op": "hello", "time": NaN}\n'},
    "another op for hello": {"hello": {"op": "pong", "time": 1.0}},
    "a hello for a ping": {"ping": {"op": "hello"}},
    "a bandwidth answer counting nothing": {"bandwidth": {"op": "received", "bytes": "all"}},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_answer_is_a_failed_check_naming_the_peer_not_a_traceback(case):
    with _rogue(HOSTILE[case]) as address:
        checks = doctor_peer.check_peer(address, None)
    assert [c.status for c in checks] == ["FAIL"], checks
    assert checks[0].name == f"peer {address}" and "answered wrongly" in checks[0].detail, checks


@pytest.mark.timeout(60)
def test_a_malformed_reach_answer_fails_that_check_only():
    with _rogue({"reach": {"op": "reached", "error": {"nested": [1, 2]}}}) as address:
        checks = doctor_peer.check_peer(address, None, local_addr="127.0.0.1")
    back = checks[-1]
    assert back.name == f"peer {address} reaches LOCAL_ADDR" and back.status == "FAIL", checks
    assert "answered wrongly" in back.detail and "error is a dict" in back.detail, back
    assert [c.status for c in checks[:-1]] == ["ok", "ok", "info", "ok"], checks


@pytest.mark.timeout(60)
def test_a_peers_text_reaches_the_table_as_printable_text_only(capsys):
    evil = {"torch": "\x1b[2J\x1b]8;;http://evil\x07click", "torchft": "[link=http://evil]x[/link]"}
    with _rogue({"hello": {**doctor_peer.hello(None), "versions": evil}}) as address:
        checks = doctor_peer.check_peer(address, None)
    versions = next(c for c in checks if c.name.endswith("versions"))
    assert versions.status == "warn" and "\x1b" not in versions.detail and "\x07" not in versions.detail
    doctor.print_table([*checks, doctor_checks.Check("config", "FAIL", "x", "the same [fault_tolerance] settings")])
    shown = capsys.readouterr().out
    assert "[link=http://evil]x[/link]" in shown and "[fault_tolerance]" in shown, shown  # text, not markup
