"""`archipelago doctor` against a peer: a serving doctor answers hello, ping, bandwidth and reach.

The exchange is small JSON lines; what a peer sends is read with a size cap and parsed as data
only (a peer is another owner's machine). A check against a peer measures latency and bandwidth,
compares versions, the join's fingerprint and the clocks, and with LOCAL_ADDR has the peer
connect back to this host.
"""

from __future__ import annotations

import json
import secrets
import socket
import statistics
import threading
import time
from typing import Any

from archipelago.launch.doctor_checks import TIMEOUT_S, Check, bind_fix, connect, host_port, versions
from archipelago.netutil import listening_socket

LINE_LIMIT = 4096                  # bytes of one JSON line from a peer
BANDWIDTH_BYTES = 8 * 2**20        # sent to a peer to measure bandwidth
BANDWIDTH_LIMIT = 64 * 2**20       # the most a serving doctor accepts in one measurement
SKEW_LIMIT_S = 1.0                 # clocks further apart than this get a warning
TOKEN_BYTES = 16                   # the random token a peer sends back when it reaches LOCAL_ADDR


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


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


def _serve_one(conn: socket.socket, fingerprint: dict[str, Any] | None) -> None:
    with conn, conn.makefile("rb") as reader:
        conn.settimeout(30)
        while True:
            message = _receive(reader)
            if message.get("op") == "hello":
                _send(conn, hello(fingerprint))
            elif message.get("op") == "ping":
                _send(conn, {"op": "pong", "time": time.time()})
            elif message.get("op") == "reach":
                _send(conn, {"op": "reached", "error": _reach(message)})
            elif message.get("op") == "bandwidth" and isinstance(message.get("bytes"), int) \
                    and 0 < message["bytes"] <= BANDWIDTH_LIMIT:
                left = message["bytes"]
                while left:
                    chunk = reader.read(min(left, 2**20))
                    if not chunk:
                        raise ConnectionError("the peer stopped sending")
                    left -= len(chunk)
                _send(conn, {"op": "received", "bytes": message["bytes"]})
            else:
                return


def _reach(message: dict[str, Any]) -> str | None:
    """Connect to the address a peer asked for and send it its token: can this host reach the
    peer's LOCAL_ADDR? None when it could, else why not. One connection, TIMEOUT_S, and only the
    peer's own token is sent (nothing of this host), so a caller can learn no more than whether
    this host reaches that address."""
    host, port, token = message.get("host"), message.get("port"), message.get("token")
    if not (isinstance(host, str) and isinstance(port, int) and 0 < port < 65536 and isinstance(token, str)
            and len(token) == 2 * TOKEN_BYTES and all(c in "0123456789abcdef" for c in token)):
        return "malformed request"
    conn, why = connect(host, port)
    if conn is None:
        return why
    with conn:
        try:
            conn.sendall(token.encode() + b"\n")
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def serve(host: str, port: int, fingerprint: dict[str, Any] | None, stop: threading.Event) -> socket.socket:
    """Answer peers' checks on host:port in a background thread until `stop` is set."""
    listener = listening_socket(host, port)
    listener.settimeout(0.2)

    def loop() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                threading.Thread(target=_serve_quietly, args=(conn, fingerprint), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return listener


def _serve_quietly(conn: socket.socket, fingerprint: dict[str, Any] | None) -> None:
    try:
        _serve_one(conn, fingerprint)
    except (OSError, ConnectionError, ValueError):
        pass  # a peer that misbehaves or leaves ends only its own connection


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
        with conn, conn.makefile("rb") as reader:
            checks = _peer_checks(name, conn, reader, fingerprint, ft)
            if local_addr:
                checks += [_reach_back(name, conn, reader, local_addr, port) for port in ports or (0,)]
            return checks
    except (OSError, ConnectionError, ValueError) as exc:
        return [Check(name, "FAIL", f"the peer answered wrongly or not at all ({exc})",
                      "check that `archipelago doctor --serve` runs there (not another service on that port)")]


def _peer_checks(name: str, conn: socket.socket, reader: Any, fingerprint: dict[str, Any] | None,
                 ft: Any = None) -> list[Check]:
    sent = time.time()
    _send(conn, hello(fingerprint))
    theirs = _receive(reader)
    skew = float(theirs.get("time", 0)) - (sent + time.time()) / 2
    rtts = []
    for _ in range(5):
        began = time.perf_counter()
        _send(conn, {"op": "ping"})
        _receive(reader)
        rtts.append(time.perf_counter() - began)
    began = time.perf_counter()
    _send(conn, {"op": "bandwidth", "bytes": BANDWIDTH_BYTES})
    conn.sendall(bytes(BANDWIDTH_BYTES))
    _receive(reader)
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


def _reach_back(name: str, conn: socket.socket, reader: Any, local_addr: str, port: int = 0) -> Check:
    """Listen on LOCAL_ADDR at `port` (0: an ephemeral one) and ask the peer to connect there with a token:
    peers connect to this island at LOCAL_ADDR (torchft's manager and store, the exchange), so an
    address they cannot route to (a private address behind NAT) or a firewall that drops inbound
    connections stops the federation even when this host reaches them."""
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
        waiter = threading.Thread(target=accept, daemon=True)
        waiter.start()
        _send(conn, {"op": "reach", "host": local_addr, "port": port, "token": token})
        error = _receive(reader).get("error")
        waiter.join(TIMEOUT_S + 2)
    if not error and got and got[0] == token.encode() + b"\n":
        return Check(check_name, "ok", f"the peer connected to {local_addr}:{port}")
    why = str(error)[:200] if error else "it connected, but the token did not arrive"
    return Check(check_name, "FAIL", f"the peer cannot connect to {local_addr}:{port} ({why})",
                 "peers connect to every island at its LOCAL_ADDR: use an address they route to (a public address, "
                 "or both hosts on one Tailscale/WireGuard net) and allow inbound TCP from them (firewall, security "
                 "group; docs/deployment.md lists the ports)")


def _compare_versions(name: str, theirs: Any) -> Check:
    mine = versions()
    if not isinstance(theirs, dict):
        return Check(f"{name} versions", "FAIL", "the peer sent no versions", "update archipelago on the peer")
    differ = [f"{k} {mine[k]} here, {theirs.get(k)!s:.40} there" for k in ("torch", "torchft", "archipelago")
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
    differ = [f"{key} ({str(mine.get(key))[:60]} here, {str(theirs.get(key))[:60]} there)"
              for key in differing(mine, theirs)]
    if differ:
        return Check(f"{name} config", "FAIL", "the join would refuse: " + "; ".join(differ),
                     "start every island with the same model and [fault_tolerance] settings, and the same "
                     "federation key (replica_id, lighthouse and the rank count may differ)")
    return Check(f"{name} config", "ok", "the join's fingerprint is equal on both (model, shapes, outer step, "
                                         "pacing, codec, inner optimizer, federation key)")
