"""`archipelago doctor` against a peer: a serving doctor answers hello, ping, bandwidth and reach.

The exchange is small JSON lines; what a peer sends is read with a size cap and a deadline,
parsed as data only and type-checked field by field (a peer is another owner's machine: a
malformed answer is a failed check naming the peer). A check against a peer measures latency
and bandwidth, compares versions, the join's fingerprint and the clocks, and with LOCAL_ADDR
has the peer connect back to this host: over a connection made from LOCAL_ADDR, since a
serving doctor connects back only to the address a check comes from (`reach`), never to an
address it is told, so it probes no third host for anyone.

The serving side is bounded as the healing server is (`DoctorServer`): a thread only for a
connection whose first line has arrived, at most MAX_HANDLERS of them, each line within
MESSAGE_S; connections beyond that are closed, and logged once per source.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import secrets
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

from archipelago.federation.refusal_log import RefusalLog
from archipelago.launch.doctor_checks import TIMEOUT_S, Check, bind_fix, connect, host_port, versions
from archipelago.netutil import listening_socket

log = logging.getLogger("archipelago.doctor")

LINE_LIMIT = 4096                  # bytes of one JSON line from a peer
BANDWIDTH_BYTES = 8 * 2**20        # sent to a peer to measure bandwidth
BANDWIDTH_LIMIT = 64 * 2**20       # the most a serving doctor accepts in one measurement
SKEW_LIMIT_S = 1.0                 # clocks further apart than this get a warning
TOKEN_BYTES = 16                   # the random token a peer sends back when it reaches LOCAL_ADDR
MAX_HANDLERS = 8                   # checks a serving doctor answers at once (each takes seconds)
MAX_PENDING = 64                   # connections whose first line is still arriving: a descriptor each
MESSAGE_S = 10.0                   # each line of a check (and each answer to one) arrives within this
BODY_S = 120.0                     # a measurement's bytes arrive within this (64 MiB: 4.5 Mbit/s)
CONNECTION_S = 300.0               # a serving doctor ends every connection by this


class BadAnswer(ConnectionError):
    """A peer's answer is not what a serving doctor sends (a wrong op, a field of the wrong type)."""


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


class Channel:
    """One connection to a peer, each read and write by `deadline` (time.monotonic()): a socket
    timeout bounds one recv only, and a peer that sends a byte a second never trips it. Reads
    lines (`readline`, for `_receive`) and bytes through its own buffer, which starts with
    `data` (what arrived with a first line)."""

    def __init__(self, conn: socket.socket, data: bytes = b"") -> None:
        self.conn, self._buffer = conn, bytearray(data)
        self.deadline = time.monotonic() + MESSAGE_S

    def within(self, seconds: float, ends: float = math.inf) -> None:
        """What follows must be done in `seconds` from now (and by `ends`)."""
        self.deadline = min(time.monotonic() + seconds, ends)

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer took longer than its deadline")
        self.conn.settimeout(left)

    def send(self, message: dict[str, Any]) -> None:
        self._arm()
        _send(self.conn, message)

    def send_bytes(self, data: bytes) -> None:
        self._arm()
        self.conn.sendall(data)  # the timeout is for the whole call (Python >= 3.5)

    def _fill(self) -> bool:
        self._arm()
        chunk = self.conn.recv(1 << 16)
        self._buffer += chunk
        return bool(chunk)

    def readline(self, limit: int) -> bytes:
        """Up to and with the next newline, at most `limit` bytes (fewer, without a newline,
        when the line is longer or the peer stopped: `_receive` refuses that)."""
        while (end := self._buffer.find(b"\n", 0, limit)) < 0 and len(self._buffer) < limit and self._fill():
            pass
        size = end + 1 if end >= 0 else min(limit, len(self._buffer))
        line = bytes(self._buffer[:size])
        del self._buffer[:size]
        return line

    def read(self, size: int) -> bytes:
        """At most `size` bytes, at least one unless the peer stopped."""
        if not self._buffer and not self._fill():
            return b""
        chunk = bytes(self._buffer[:size])
        del self._buffer[:size]
        return chunk

    def receive(self) -> dict[str, Any]:
        return _receive(self)


def _receive(reader: Any) -> dict[str, Any]:
    line = reader.readline(LINE_LIMIT + 1)
    if not line or len(line) > LINE_LIMIT or not line.endswith(b"\n"):
        raise ConnectionError("the peer sent no answer, or a line over the size limit")
    try:
        message = json.loads(line)
    except RecursionError as exc:  # nesting deep enough to exhaust the parser: a hostile line
        raise ConnectionError("the peer's answer nests too deeply to be read") from exc
    if not isinstance(message, dict):
        raise ConnectionError("the peer's answer is not a JSON object")
    return message


def hello(fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    return {"op": "hello", "versions": versions(), "fingerprint": fingerprint, "time": time.time()}


class DoctorServer:
    """`doctor --serve`'s sockets, bounded as the healing server's are (federation/
    http_serving.RequestServer). One thread accepts connections and reads each one's first
    line without blocking (at most LINE_LIMIT bytes, within MESSAGE_S); only then does a
    handler thread take the connection, at most MAX_HANDLERS at a time. Beyond that the
    connection is closed unanswered, and the refusal logged once per source address
    (`RefusalLog`: then counted, the count logged once a minute). An idle connection costs
    a descriptor until its deadline, never a thread; with MAX_PENDING of them waiting, the
    oldest is closed for the newest. A handler reads each later line within MESSAGE_S, a
    measurement's bytes within BODY_S, and closes the connection by CONNECTION_S. Runs
    until `stop` is set."""

    def __init__(self, host: str, port: int, fingerprint: dict[str, Any] | None, stop: threading.Event) -> None:
        self._listener = listening_socket(host, port)
        self._listener.setblocking(False)
        self._fingerprint, self._stop = fingerprint, stop
        self._slots = threading.BoundedSemaphore(MAX_HANDLERS)
        self._pending: dict[socket.socket, tuple[float, Any, bytearray]] = {}  # oldest first
        self._probing: set[str] = set()  # askers with a `reach` probe in flight (at most MAX_HANDLERS)
        self._lock = threading.Lock()
        self.refusals = RefusalLog(log, "doctor --serve")
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, name="archipelago-doctor", daemon=True)
        self._thread.start()

    def getsockname(self) -> Any:
        return self._listener.getsockname()

    def _serve(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(self._wait()):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read_first(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        except Exception:  # a bug, not a peer: say so
            log.exception("doctor --serve: stopped")
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()
            self._listener.close()

    def _wait(self) -> float:
        """Until the oldest pending connection's deadline, and at most 0.2 s (to see `stop`)."""
        if not self._pending:
            return 0.2
        return min(0.2, max(next(iter(self._pending.values()))[0] - time.monotonic(), 0.0))

    def _accept(self) -> None:
        for _ in range(64):  # then the pending lines get their turn
            try:
                conn, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of descriptors: make room, or let the backlog wait
                if self._pending:
                    self._drop(next(iter(self._pending)))
                else:
                    time.sleep(0.05)
                return
            conn.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending)))
            self._pending[conn] = (time.monotonic() + MESSAGE_S, address, bytearray())
            self._selector.register(conn, selectors.EVENT_READ)

    def _read_first(self, conn: socket.socket) -> None:
        if conn not in self._pending:  # dropped for a newer one earlier in this select's events
            return
        _, address, data = self._pending[conn]
        try:
            chunk = conn.recv(LINE_LIMIT + 1 - len(data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        data += chunk
        if b"\n" in data:
            self._selector.unregister(conn)
            del self._pending[conn]
            self._dispatch(conn, address, bytes(data))
        elif not chunk or len(data) > LINE_LIMIT:
            self._drop(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            conn, (deadline, _, _) = next(iter(self._pending.items()))
            if deadline > now:
                return
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()

    def _dispatch(self, conn: socket.socket, address: Any, data: bytes) -> None:
        if not self._slots.acquire(blocking=False):
            host = str(address[0])
            self.refusals.refused(host, host, f"doctor --serve: {MAX_HANDLERS} checks are being answered; closed a "
                                              f"connection from {host} unanswered (the checker may try again)")
            conn.close()
            return
        try:
            threading.Thread(target=self._handle, args=(conn, address, data), name="archipelago-doctor-check",
                             daemon=True).start()
        except RuntimeError:  # no thread to be had: as if all were busy
            self._slots.release()
            conn.close()

    def _handle(self, conn: socket.socket, address: Any, data: bytes) -> None:
        try:
            conn.setblocking(True)
            self._answer(Channel(conn, data), address)
        except (OSError, ConnectionError, ValueError):
            pass  # a peer that misbehaves or leaves ends only its own connection
        finally:
            conn.close()
            self._slots.release()

    def _answer(self, channel: Channel, address: Any) -> None:
        ends = time.monotonic() + CONNECTION_S
        while True:
            channel.within(MESSAGE_S, ends)
            message = channel.receive()
            op = message.get("op")
            if op == "hello":
                channel.send(hello(self._fingerprint))
            elif op == "ping":
                channel.send({"op": "pong", "time": time.time()})
            elif op == "reach":
                channel.send({"op": "reached", "error": self._reach(message, address)})
            elif op == "bandwidth" and type(message.get("bytes")) is int and 0 < message["bytes"] <= BANDWIDTH_LIMIT:
                channel.within(BODY_S, ends)
                left = message["bytes"]
                while left:
                    chunk = channel.read(min(left, 2**20))
                    if not chunk:
                        raise ConnectionError("the peer stopped sending")
                    left -= len(chunk)
                channel.send({"op": "received", "bytes": message["bytes"]})
            else:
                return

    def _reach(self, message: dict[str, Any], address: Any) -> str | None:
        """Connect back to the asker, at the port it names, and send it its token: can this host
        reach the asker's LOCAL_ADDR? None when it could, else why not. Only the address the
        check comes from (the connection's own peer address) is ever connected to: a `host`
        naming another is refused, so no one can have this doctor probe a third host. One
        probe per asker at a time, TIMEOUT_S each, and only the asker's own token is sent
        (nothing of this host)."""
        port, token, host = message.get("port"), message.get("token"), message.get("host")
        if not (type(port) is int and 0 < port < 65536 and isinstance(token, str) and len(token) == 2 * TOKEN_BYTES
                and all(c in "0123456789abcdef" for c in token)):
            return "malformed request"
        asker = _address_text(str(address[0]))
        if host is not None and (not isinstance(host, str) or _address_text(host) != asker):
            return (f"this doctor connects back only to the address a check comes from ({asker}), not to "
                    f"{str(host)[:60]!r}: make the check from that address")
        with self._one_probe(asker) as free:
            if not free:
                return f"another reach check from {asker} is running: one at a time"
            return _connect_back(address, port, token)

    @contextlib.contextmanager
    def _one_probe(self, asker: str) -> Iterator[bool]:
        with self._lock:
            free = asker not in self._probing
            self._probing.add(asker)
        try:
            yield free
        finally:
            if free:
                with self._lock:
                    self._probing.discard(asker)


def _address_text(host: str) -> str:
    """An IP address as text, IPv4 for an IPv4-mapped one (a dual-stack listener's peers), or
    `host` itself when it is not an address (a name: then it matches no peer address)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def _connect_back(address: Any, port: int, token: str) -> str | None:
    """One connection to `address` (a peer's socket address, its scope id kept) at `port`,
    sending `token`; None when it went through, else why not."""
    family = socket.AF_INET6 if ":" in str(address[0]) else socket.AF_INET
    target = (address[0], port, *address[2:])
    try:
        with socket.socket(family, socket.SOCK_STREAM) as conn:
            conn.settimeout(TIMEOUT_S)
            conn.connect(target)
            conn.sendall(token.encode() + b"\n")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def serve(host: str, port: int, fingerprint: dict[str, Any] | None, stop: threading.Event) -> DoctorServer:
    """Answer peers' checks on host:port in a background thread until `stop` is set."""
    return DoctorServer(host, port, fingerprint, stop)


def check_peer(address: str, fingerprint: dict[str, Any] | None, local_addr: str | None = None,
               ports: tuple[int, ...] = (), ft: Any = None) -> list[Check]:
    """Reach a peer's `doctor --serve`; compare versions, fingerprint and clocks; measure the link
    (with the config's `ft`, what one exchange costs over it: `link_check`);
    with `local_addr`, have the peer connect back to this host there: at each of `ports` (the
    ports this island will listen on, which peers must reach through any firewall), else at an
    ephemeral port."""
    name = f"peer {address}"
    try:
        host, port = host_port(address)
    except ValueError as exc:
        return [Check(name, "FAIL", str(exc), "write the peer as HOST:PORT")]
    conn, why = connect(host, port)
    if conn is None:
        return [Check(name, "FAIL", f"cannot connect ({why})",
                      f"run `archipelago doctor --serve {host}:{port}` on the peer and open TCP port {port} "
                      "between the hosts (firewall, security group), or join both to one Tailscale/WireGuard net")]
    try:
        with conn:
            checks = _peer_checks(name, Channel(conn), fingerprint, ft)
    except (OSError, ConnectionError, ValueError) as exc:
        return [_answered_wrongly(name, exc)]
    if local_addr:
        checks += [_reach_back(name, (host, port), local_addr, listen) for listen in ports or (0,)]
    return checks


def _answered_wrongly(name: str, exc: Exception) -> Check:
    return Check(name, "FAIL", f"the peer answered wrongly or not at all ({_shown(exc, 300)})",
                 "check that `archipelago doctor --serve` runs there (not another service on that port)")


def _shown(value: Any, limit: int) -> str:
    """A peer's value as text for a check row: printable characters only, at most `limit`."""
    return "".join(c for c in str(value)[:limit] if c.isprintable())


def _answer(message: dict[str, Any], op: str) -> dict[str, Any]:
    """`message` if it is a serving doctor's `op` answer (BadAnswer otherwise)."""
    if message.get("op") != op:
        raise BadAnswer(f"expected its {op!r} answer, got op {_shown(message.get('op'), 40)!r}")
    return message


def _number(message: dict[str, Any], field: str) -> float:
    """`message[field]` as a finite float (BadAnswer for anything else: a string, a list, true,
    a number past float's range, NaN)."""
    value = message.get(field)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadAnswer(f"its {message.get('op')!s:.20} answer's {field!r} is a {type(value).__name__}, "
                        "not a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise BadAnswer(f"its {message.get('op')!s:.20} answer's {field!r} is not a finite number")
    return number


def _peer_checks(name: str, channel: Channel, fingerprint: dict[str, Any] | None, ft: Any = None) -> list[Check]:
    sent = time.time()
    channel.within(MESSAGE_S)
    channel.send(hello(fingerprint))
    theirs = _answer(channel.receive(), "hello")
    skew = _number(theirs, "time") - (sent + time.time()) / 2
    rtts = []
    for _ in range(5):
        began = time.perf_counter()
        channel.within(MESSAGE_S)
        channel.send({"op": "ping"})
        _answer(channel.receive(), "pong")
        rtts.append(time.perf_counter() - began)
    began = time.perf_counter()
    channel.within(BODY_S)
    channel.send({"op": "bandwidth", "bytes": BANDWIDTH_BYTES})
    channel.send_bytes(bytes(BANDWIDTH_BYTES))
    if _answer(channel.receive(), "received").get("bytes") != BANDWIDTH_BYTES:
        raise BadAnswer(f"its 'received' answer does not count the {BANDWIDTH_BYTES} bytes sent")
    mbit = BANDWIDTH_BYTES * 8 / (time.perf_counter() - began) / 1e6
    checks = [Check(name, "ok", f"reached: latency {statistics.median(rtts) * 1e3:.2f} ms (median of 5), "
                                f"bandwidth {mbit:,.0f} Mbit/s (8 MiB one way)")]
    if ft is not None and fingerprint is not None and isinstance(fingerprint.get("params"), int):
        checks.append(link_check(name, ft, fingerprint, mbit * 1e6))
    checks.append(_compare_versions(name, theirs.get("versions")))
    checks.append(_compare_fingerprints(name, fingerprint, theirs.get("fingerprint")))
    if abs(skew) > SKEW_LIMIT_S:
        checks.append(Check(f"{name} clock", "warn", f"clocks differ by {skew:+.1f} s",
                            "synchronise both clocks (timedatectl set-ntp true, or chrony): time-paced rounds "
                            "and logs compare times across hosts"))
    else:
        checks.append(Check(f"{name} clock", "ok", f"clocks within {abs(skew):.3f} s"))
    return checks


def link_check(name: str, ft: Any, fingerprint: dict[str, Any], link_bits_s: float) -> Check:
    """What the measured link carries for this config: one exchange's bytes and seconds,
    codec by codec, and whether the config's codec keeps it within its share of a round
    (AUTO_EXCHANGE_SHARE, or target_exchange_s; `codec = "auto"`'s rule). With averaged
    moments, their rows too, and whether `auto` would send them."""
    from archipelago.federation.auto_codec import AUTO_EXCHANGE_SHARE, auto_target_s, densest_round, link_carries
    from archipelago.federation.codecs import effective_codec

    islands = max(ft.group_size, 2)
    carries = link_carries(ft, fingerprint["params"], islands, link_bits_s, fingerprint.get("federation") != "no key")
    costs = ", ".join(f"{codec} {size / 1e6:,.1f} MB ({seconds:,.2f} s)" for codec, (size, seconds) in carries.items())
    moments, moments_s = carries.pop("moments", (0, 0.0))
    where = f"{name} link carries"
    said = f"one exchange among {islands} islands, received by each: {costs}"
    codec = effective_codec(ft)
    if ft.round_pacing != "time":  # the round's compute seconds are not known before a run
        fits = {c: (seconds + (moments_s if codec != "auto" else 0.0)) / AUTO_EXCHANGE_SHARE
                for c, (_, seconds) in carries.items()}
        mine = "auto: the densest that fits" if codec == "auto" else f"{codec} {fits[codec]:,.0f} s"
        return Check(where, "info", f"{said}; rounds ({ft.sync_steps} inner steps) must last at least this long for "
                                    f"the exchange to take {AUTO_EXCHANGE_SHARE:.0%} of them: {mine} "
                                    f"(fp32 {fits['fp32']:,.0f} s, int8 {fits['int8']:,.0f} s, "
                                    f"topk {fits['topk']:,.0f} s)")
    target = auto_target_s(ft, ft.round_seconds)
    choice, with_moments = densest_round({c: size for c, (size, _) in carries.items()}, moments, link_bits_s, target)
    took = choice + (" with the moments" if with_moments else " without the moments" if moments else "")
    if codec == "auto" or carries[codec][1] + moments_s <= target:
        return Check(where, "ok", f"{said}; rounds of {ft.round_seconds:g} s allow {target:.2f} s of exchange: "
                                  f"codec {codec} fits" + (f" (auto takes {took})" if codec == "auto" else ""))
    return Check(where, "warn", f"{said}; rounds of {ft.round_seconds:g} s allow {target:.2f} s of exchange and "
                                f"codec {codec} takes {carries[codec][1] + moments_s:.2f} s",
                 f'set fault_tolerance.codec = "auto" (it takes {took} over this link) or lengthen '
                 "fault_tolerance.round_seconds")


def _reach_back(name: str, peer: tuple[str, int], local_addr: str, port: int = 0) -> Check:
    """Listen on LOCAL_ADDR at `port` (0: an ephemeral one) and ask the peer to connect there with a token:
    peers connect to this island at LOCAL_ADDR (torchft's manager and store, the exchange), so an
    address they cannot route to (a private address behind NAT) or a firewall that drops inbound
    connections stops the federation even when this host reaches them. The question goes over a
    connection made from LOCAL_ADDR, since the peer connects back only to the address a check
    comes from: one it cannot route back to fails already there."""
    check_name = f"{name} reaches LOCAL_ADDR" + (f":{port}" if port else "")
    try:
        listener = listening_socket(local_addr, port)
    except OSError as exc:
        return Check(check_name, "FAIL", f"cannot listen on {local_addr}:{port} ({exc.strerror})",
                     bind_fix(exc, port))
    token = secrets.token_hex(TOKEN_BYTES)
    got: list[bytes] = []

    def accept() -> None:
        listener.settimeout(TIMEOUT_S + 1)
        try:
            incoming, _ = listener.accept()
            with incoming:
                incoming.settimeout(TIMEOUT_S)
                got.append(incoming.recv(2 * TOKEN_BYTES + 1))
        except OSError:
            pass

    with listener:
        port = listener.getsockname()[1]
        try:
            error = _ask_reach(peer, local_addr, port, token, accept)
        except (OSError, ConnectionError, ValueError) as exc:
            return _answered_wrongly(check_name, exc)
    if not error and got and got[0] == token.encode() + b"\n":
        return Check(check_name, "ok", f"the peer connected to {local_addr}:{port}")
    why = _shown(error, 300) if error else "it connected, but the token did not arrive"
    return Check(check_name, "FAIL", f"the peer cannot connect to {local_addr}:{port} ({why})",
                 "peers connect to every island at its LOCAL_ADDR: use an address they route to (a public address, "
                 "or both hosts on one Tailscale/WireGuard net) and allow inbound TCP from them (firewall, security "
                 "group; docs/deployment.md lists the ports)")


def _ask_reach(peer: tuple[str, int], local_addr: str, port: int, token: str, accept: Any) -> str | None:
    """Connect to `peer` from `local_addr`, run `accept` in a thread, ask the peer to reach
    `port` with `token`: its answer's error (None: it connected), or why no connection from
    `local_addr` to the peer completed."""
    try:
        conn = socket.create_connection(peer, timeout=TIMEOUT_S, source_address=(local_addr, 0))
    except OSError as exc:
        return (f"no connection from {local_addr} to the peer completed ({exc.strerror or exc}): the peer has no "
                f"route back to {local_addr}, or a firewall drops its answers")
    with conn:
        waiter = threading.Thread(target=accept, daemon=True)
        waiter.start()
        channel = Channel(conn)
        channel.within(TIMEOUT_S + MESSAGE_S)
        channel.send({"op": "reach", "host": conn.getsockname()[0], "port": port, "token": token})
        error = _answer(channel.receive(), "reached").get("error")
        waiter.join(TIMEOUT_S + 2)
    if error is not None and not isinstance(error, str):
        raise BadAnswer(f"its 'reached' answer's error is a {type(error).__name__}, not text")
    return error


def _compare_versions(name: str, theirs: Any) -> Check:
    mine = versions()
    if not isinstance(theirs, dict):
        return Check(f"{name} versions", "FAIL", "the peer sent no versions", "update archipelago on the peer")
    differ = [f"{k} {mine[k]} here, {_shown(theirs.get(k), 40)} there" for k in ("torch", "torchft", "archipelago")
              if theirs.get(k) != mine[k]]
    if differ:
        return Check(f"{name} versions", "warn", "; ".join(differ),
                     "install the same versions on every island (`make setup` from one commit)")
    return Check(f"{name} versions", "ok", "torch, torchft and archipelago equal")


def describe_fingerprint(fingerprint: dict[str, Any] | None) -> str:
    from archipelago.federation.membership import describe

    return describe(fingerprint) if fingerprint is not None else "no config"


def _compare_fingerprints(name: str, mine: dict[str, Any] | None, theirs: Any) -> Check:
    from archipelago.federation.membership import differing

    if mine is None or theirs is None:
        return Check(f"{name} config", "info", "not compared (give --config on both hosts)")
    if not isinstance(theirs, dict):
        return Check(f"{name} config", "FAIL", "the peer sent no fingerprint a join would read",
                     "run the same archipelago version on both hosts")
    differ = [f"{key} ({_shown(mine.get(key), 60)} here, {_shown(theirs.get(key), 60)} there)"
              for key in differing(mine, theirs)]
    if differ:
        return Check(f"{name} config", "FAIL", "the join would refuse: " + "; ".join(differ),
                     "start every island with the same model and [fault_tolerance] settings, and the same "
                     "federation key (replica_id, lighthouse and the rank count may differ)")
    return Check(f"{name} config", "ok", "the join's fingerprint is equal on both (model, shapes, outer step, "
                                         "pacing, codec, inner optimizer, federation key)")
