"""`archipelago doctor`: why can this island not reach the others? Checks in seconds, with a fix per failure.

    archipelago doctor [--config FILE] [--lighthouse URL] [--peer HOST:PORT ...] [--port N ...]
    archipelago doctor --serve HOST:PORT [--config FILE]     # on a peer: answer its checks

Each check prints one row: ok / warn / FAIL / info, what was found, and for a failure the fix.
Against a peer (which runs `doctor --serve`), it measures latency and bandwidth, compares
versions, the fingerprint the federation's join compares (field by field) and the clocks,
and, with LOCAL_ADDR set, has the peer
connect back to this host at LOCAL_ADDR (an address it cannot route to fails). The exchange is small JSON lines; what a
peer sends is read with a size cap and parsed as data only (a peer is another owner's machine).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from archipelago.netutil import listening_socket

TIMEOUT_S = 3.0
LINE_LIMIT = 4096                  # bytes of one JSON line from a peer
BANDWIDTH_BYTES = 8 * 2**20        # sent to a peer to measure bandwidth
BANDWIDTH_LIMIT = 64 * 2**20       # the most a serving doctor accepts in one measurement
SKEW_LIMIT_S = 1.0                 # clocks further apart than this get a warning
TOKEN_BYTES = 16                   # the random token a peer sends back when it reaches LOCAL_ADDR


@dataclass
class Check:
    name: str
    status: str  # ok, warn, FAIL, info
    detail: str
    fix: str = ""


# ---- what this machine has ---------------------------------------------------------------

def _installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "torchft": _installed("torchft"),
            "archipelago": _installed("archipelago")}


def check_versions() -> Check:
    return Check("versions", "info", ", ".join(f"{k} {v}" for k, v in versions().items()))


def check_devices() -> Check:
    import torch

    found = []
    if torch.cuda.is_available():
        kind = "ROCm" if torch.version.hip else "CUDA"
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        found.append(f"{torch.cuda.device_count()} x {kind} ({', '.join(names)}), backend nccl")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        found.append(f"{torch.xpu.device_count()} x XPU, backend xccl")
    if torch.backends.mps.is_available():
        found.append("MPS (Apple GPU), backend gloo")
    found.append(f"CPU ({os.cpu_count()} cores), backend gloo")
    return Check("devices", "info", "; ".join(found))


def check_backend(cfg: Any) -> Check:
    """training.backend: whether it is installed here, and what it computes with (its device and
    dtype needs are checked when the config loads)."""
    from archipelago.island.backends import backend, describe_backend

    name = cfg.training.backend
    missing = backend(name).available()
    if missing:
        return Check("backend", "FAIL", f"training.backend = {name}: not available", missing)
    return Check("backend", "ok", f"training.backend = {name}: {describe_backend(name)}")


def island_fingerprint(cfg: Any, ranks: int = 1) -> dict[str, Any]:
    """What an island started from this run file declares at the federation's join, as the
    join computes it (federation.island_fingerprint): the model as the island builds it
    (names and shapes; the data prepared first, as the island would, for the vocabulary),
    the inner optimizer as the trainer builds it, the
    [fault_tolerance] settings and the federation key's public id. Peers compare it field
    by field, as the join does (membership.mismatch)."""
    import torch

    from archipelago.federation import island_fingerprint as declared
    from archipelago.federation.trust import load_key
    from archipelago.island.optim import build_optimizer
    from archipelago.island.parallelize import wrap_blocks
    from archipelago.tasks import build_task

    task = build_task(cfg)
    task.prepare(lambda _message: None)  # the vocabulary sizes the embedding (cached after the first run)
    model = task.build_model().module  # on the meta device from 1B parameters: shapes only
    # Checkpointed blocks carry the wrapper in their parameters' names, as the island's do.
    wrap_blocks(model, cfg.training.activation_checkpointing, compile_blocks=False)
    ft = cfg.fault_tolerance
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"), batch_scaled=ft.adam_federation_batch)
    return declared(ft, list(model.named_parameters()), f"{cfg.model.name}/{cfg.model.flavor}", ranks,
                    cfg.training.batch_size * task.tokens_per_sample, optimizer,
                    load_key(cfg.federation_security.key_file))


def check_disk(cfg: Any) -> Check:
    """Room for `checkpoint.keep` checkpoints (weights and AdamW state, fp32) where the run writes."""
    from archipelago.models import get_model_args

    where = Path(cfg.job.run_dir or "runs").resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    try:
        params = get_model_args(cfg.model.name, cfg.model.flavor, vocab_size=cfg.data.vocab_size).num_params()
    except Exception:  # noqa: BLE001 - a family without a cheap count: report the space only
        return Check("disk", "info", f"{free / 2**30:.1f} GiB free at {where}")
    need = params * 12 * max(1, cfg.checkpoint.keep) if cfg.checkpoint.enable else 0  # fp32 weights + 2 moments
    detail = f"{free / 2**30:.1f} GiB free at {where}; {cfg.checkpoint.keep} checkpoints need {need / 2**30:.1f} GiB"
    if need > free:
        return Check("disk", "FAIL", detail, "free space there, lower checkpoint.keep, or set --job.run_dir on "
                                             "a larger disk")
    return Check("disk", "ok", detail)


# ---- the network ---------------------------------------------------------------------------

def _host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    parts = urlsplit(text if "//" in text else f"//{text}")
    if parts.hostname is None or (parts.port is None and default_port is None):
        raise ValueError(f"{text!r}: expected HOST:PORT or a URL with a port")
    return parts.hostname, parts.port or default_port  # type: ignore[return-value]


def _connect(host: str, port: int) -> tuple[socket.socket | None, str]:
    try:
        return socket.create_connection((host, port), timeout=TIMEOUT_S), ""
    except OSError as exc:
        return None, exc.strerror or str(exc)


def check_lighthouse(url: str) -> Check:
    try:
        host, port = _host_port(url)
    except ValueError as exc:
        return Check("lighthouse", "FAIL", str(exc), "write it as http://HOST:PORT (TORCHFT_LIGHTHOUSE)")
    began = time.perf_counter()
    conn, why = _connect(host, port)
    if conn is None:
        return Check("lighthouse", "FAIL", f"{url}: cannot connect ({why})",
                     f"start it there (`archipelago lighthouse --bind {host}:{port}`), or open TCP port {port} "
                     "between this host and it, or fix TORCHFT_LIGHTHOUSE")
    conn.close()
    return Check("lighthouse", "ok", f"{url} accepts connections ({(time.perf_counter() - began) * 1e3:.1f} ms)")


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each network interface that has one (Linux: SIOCGIFADDR)."""
    found = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
        found[name] = socket.inet_ntoa(packed[20:24])
    return found


def _listing(addresses: dict[str, str]) -> str:
    return ", ".join(f"{name} ({addr})" for name, addr in addresses.items()) or "none with an IPv4 address"


def check_local_addr(addr: str) -> Check:
    """LOCAL_ADDR must be an address of this host (the islands and torchrun bind and advertise it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except OSError as exc:
        return Check("LOCAL_ADDR", "FAIL", f"{addr} is not an address of this host ({exc.strerror})",
                     f"set LOCAL_ADDR to the address peers reach this host at, one of: "
                     f"{_listing(interface_addresses())}")
    return Check("LOCAL_ADDR", "ok", f"{addr} belongs to this host")


def check_interfaces(env: dict[str, str], local_addr: str | None) -> list[Check]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name interfaces that exist and carry LOCAL_ADDR."""
    checks = []
    addresses = interface_addresses()
    names = {name for _, name in socket.if_nameindex()}
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(variable)
        if not value or value.startswith("^"):  # unset, or NCCL's exclusion list: nothing to check
            continue
        wanted = [v.lstrip("=") for v in value.split(",")]
        missing = [w for w in wanted if w not in names]
        carrying = [n for n, a in addresses.items() if a == local_addr]
        if missing:
            checks.append(Check(variable, "FAIL", f"{value}: no interface named {', '.join(missing)} here",
                                f"set {variable} to one of this host's interfaces: {_listing(addresses)}"
                                + (f" ({carrying[0]} carries LOCAL_ADDR {local_addr})" if carrying else "")))
        elif local_addr and carrying and not set(wanted) & set(carrying):
            checks.append(Check(variable, "FAIL", f"{value} does not carry LOCAL_ADDR {local_addr}",
                                f"set {variable}={carrying[0]} (the interface with {local_addr})"))
        else:
            checks.append(Check(variable, "ok", f"{value} exists" + (f" ({addresses.get(wanted[0])})"
                                                                     if wanted[0] in addresses else "")))
    return checks


def check_port(host: str, port: int) -> Check:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, port))
    except OSError as exc:
        return Check(f"port {port}", "FAIL", f"{host}:{port} cannot be bound ({exc.strerror})", _bind_fix(exc, port))
    return Check(f"port {port}", "ok", f"{host}:{port} is free")


# ---- peers: a serving doctor answers hello, ping and bandwidth -----------------------------

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
    conn, why = _connect(host, port)
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
        host, port = _host_port(address)
    except ValueError as exc:
        return [Check(name, "FAIL", str(exc), "write the peer as HOST:PORT")]
    conn, why = _connect(host, port)
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
                     _bind_fix(exc, port))
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


def _bind_fix(exc: OSError, port: int) -> str:
    """What to do when LOCAL_ADDR:port cannot be bound, by the reason."""
    if exc.errno == errno.EADDRINUSE:
        return (f"another process holds port {port}: choose another (MASTER_PORT, --bind) or stop that "
                "process")
    if exc.errno == errno.EACCES:
        return f"port {port} needs privileges here: choose one above 1023"
    return "set LOCAL_ADDR to an address of this host"


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


def _describe(fingerprint: dict[str, Any] | None) -> str:
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


# ---- the command ---------------------------------------------------------------------------

def config_check(path: str, cfg: Any, env: dict[str, str]) -> tuple[dict[str, Any] | None, Check]:
    """This island's fingerprint (None where the run file cannot give one) and its config row."""
    from archipelago.config import ConfigError
    from archipelago.config.torchtitan import ranks_from_environment

    try:
        fingerprint = island_fingerprint(cfg, ranks_from_environment(env))
    except (ConfigError, OSError, ValueError) as exc:  # a key file, the data, the model: what the island hits
        return None, Check("config", "FAIL", f"{path}: {str(exc)[:300]}",
                           "fix what the message names: the island would stop there at its start")
    return fingerprint, Check("config", "info", f"{path}: {_describe(fingerprint)}")


def run_checks(args: argparse.Namespace, cfg: Any | None, env: dict[str, str]) -> list[Check]:
    checks = [check_versions(), check_devices()]
    fingerprint = None
    if cfg is not None:
        fingerprint, row = config_check(args.config, cfg, env)
        checks += [row, check_backend(cfg), check_disk(cfg)]
    lighthouse = args.lighthouse or env.get("TORCHFT_LIGHTHOUSE")
    if lighthouse:
        checks.append(check_lighthouse(lighthouse))
    local = env.get("LOCAL_ADDR")
    if local:
        checks.append(check_local_addr(local))
    checks += check_interfaces(env, local)
    for port in args.port:
        checks.append(check_port(local or "127.0.0.1", port))
    for peer in args.peer:
        checks += check_peer(peer, fingerprint, local, tuple(args.port),
                             cfg.fault_tolerance if cfg is not None else None)
    return checks


def print_table(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="archipelago doctor", show_lines=False)
    for column in ("", "check", "found", "fix"):
        table.add_column(column, overflow="fold")
    styles = {"ok": "green", "warn": "yellow", "FAIL": "bold red", "info": "dim"}
    for c in checks:
        table.add_row(f"[{styles[c.status]}]{c.status}[/]", c.name, c.detail, c.fix)
    Console(width=max(120, shutil.get_terminal_size().columns)).print(table)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="archipelago doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="the run file this island will use: its fingerprint and checkpoint size")
    p.add_argument("--lighthouse", help="lighthouse URL (default: $TORCHFT_LIGHTHOUSE)")
    p.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="a peer running `archipelago doctor --serve HOST:PORT` (repeat for several)")
    p.add_argument("--port", action="append", type=int, default=[],
                   help="a port this island will listen on, checked free on LOCAL_ADDR and, with --peer and "
                        "LOCAL_ADDR, reachable from each peer (repeat for several)")
    p.add_argument("--serve", metavar="HOST:PORT", help="answer peers' checks on this address until Ctrl-C "
                                                        "(give the address peers reach; never all interfaces)")
    p.add_argument("--serve-seconds", type=float, default=0, help="with --serve: stop after this long (0: never)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    cfg = None
    if args.config:
        from archipelago.config import ConfigError, load_toml

        try:
            cfg = load_toml(args.config)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.serve:
        return _serve_until_stopped(args, cfg)
    checks = run_checks(args, cfg, dict(os.environ))
    print_table(checks)
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"{len(failed)} check(s) failed" if failed else "every check passed")
    return 1 if failed else 0


def _serve_until_stopped(args: argparse.Namespace, cfg: Any | None) -> int:
    try:
        host, port = _host_port(args.serve)
    except ValueError as exc:
        print(f"error: --serve {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    fingerprint = config_check(args.config, cfg, dict(os.environ))[0] if cfg is not None else None
    listener = serve(host, port, fingerprint, stop)
    print(f"answering doctor checks on {host}:{listener.getsockname()[1]}"
          + (f" ({_describe(fingerprint)})" if fingerprint is not None else "") + "; Ctrl-C stops", flush=True)
    try:
        stop.wait(args.serve_seconds or None)
    except KeyboardInterrupt:
        pass
    stop.set()
    return 0
