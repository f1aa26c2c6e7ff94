"""Bytes a job's processes send each other over TCP, per socket, as the kernel counts them.

TrafficMonitor (bench/federation.py's meter): the kernel's per-socket TCP counters (`ss
-tinHea`, tcp_info bytes_sent, retransmissions included) of every process carrying a run's
token, polled keeping per-socket maxima, plus `ss -tinHE`, which reports each socket's
final counters as it closes, so the bytes after the last poll are not lost. Often in
between, each socket of those processes (inode in /proc/PID/fd) is tied to its endpoints
(a sock_diag netlink dump, as ss does), so even a connection that lives a few tens of
milliseconds is attributed; a process gets its role from its environment (island token /
torchrun RANK). Without `ss`, LoopbackMonitor reads the loopback interface's tx counter
(/proc/net/dev), which includes everything on the machine.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import pids_with_token, stop_process

from archipelago.launch.processes import process_env

ISLAND_TOKEN_ENV = "ARCHIPELAGO_ISLAND_TOKEN"  # set by `archipelago local` (launch/local.py)


# ------------------------------------------------------------------ processes


def processes_with_token(token: str) -> dict[int, str]:
    """pid -> role of every live process carrying our run token (never matched by name)."""
    found = {}
    for pid in pids_with_token(token):
        env = process_env(pid)
        if env is not None:  # exited meanwhile
            found[pid] = role_of(env)
    return found


def role_of(env: dict[str, str]) -> str:
    """island-K for a federation island, rank-R for a torchrun worker, else launcher
    (`archipelago local` with its in-process lighthouse, or torchrun's agent with its store)."""
    island = env.get(ISLAND_TOKEN_ENV)
    if island:
        return "island-" + island.rsplit("-island-", 1)[-1]
    if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
        return f"rank-{env['RANK']}"
    return "launcher"


def is_worker(role: str | None) -> bool:
    return role is not None and role.startswith(("island-", "rank-"))


# ----------------------------------------------------------- socket counters


@dataclass
class SocketStat:
    """One TCP connection seen from one end; byte counters are maxima over all looks."""

    local: str
    peer: str
    role: str | None  # of the process that owns this end (None: only seen closing)
    bytes_sent: int = 0
    bytes_acked: int = 0
    bytes_retrans: int = 0
    polled: bool = False  # seen alive at least once (else only in a close event)
    closed: bool = False
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes_sent) when it grew

    def absorb(self, counters: dict[str, int], when: float) -> None:
        if counters.get("bytes_sent", 0) > self.bytes_sent:
            self.bytes_sent = counters["bytes_sent"]
            self.samples.append((when, self.bytes_sent))
        self.bytes_acked = max(self.bytes_acked, counters.get("bytes_acked", 0))
        self.bytes_retrans = max(self.bytes_retrans, counters.get("bytes_retrans", 0))


_COUNTER = re.compile(r"\b(bytes_sent|bytes_acked|bytes_retrans):(\d+)")
_V4_MAPPED = re.compile(r"^\[::ffff:(\d+\.\d+\.\d+\.\d+)\]")


def endpoint(text: str) -> str:
    """One spelling per address: a socket bound to :: shows its end as [::ffff:127.0.0.1]:P
    while the other end says 127.0.0.1:P; both must name the same endpoint."""
    return _V4_MAPPED.sub(r"\1", text)


def port_of(text: str) -> str:
    return text.rsplit(":", 1)[-1]


# sock_diag netlink (linux/inet_diag.h), what ss itself uses: a dump of every TCP socket's
# endpoints and inode costs well under a millisecond, where reading /proc/net/tcp{,6}
# takes several (the kernel formats the whole table as text).
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLM_F_DUMP, NLMSG_ERROR, NLMSG_DONE = 0x1, 0x300, 2, 3
TCP_LISTEN = 10


def _diag_endpoint(family: int, raw: bytes, port: int) -> str:
    if family == socket.AF_INET:
        return f"{ipaddress.IPv4Address(raw[:4])}:{port}"
    v6 = ipaddress.IPv6Address(raw)
    return f"{v6.ipv4_mapped}:{port}" if v6.ipv4_mapped else f"[{v6.compressed}]:{port}"


def tcp_sockets() -> Iterator[tuple[str, str, bool, int]]:
    """(local, peer, listening, inode) of every TCP socket in this network namespace."""
    for family in (socket.AF_INET, socket.AF_INET6):
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            # inet_diag_req_v2: family, protocol, ext, pad, states (all), an empty sockid.
            request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + bytes(48)
            nl.sendto(struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY,
                                  NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + request, (0, 0))
            while True:
                data, offset = nl.recv(1 << 20), 0
                while offset + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, offset)
                    if kind == NLMSG_DONE:
                        break
                    if kind == NLMSG_ERROR:
                        raise OSError("sock_diag dump refused")
                    m = offset + 16  # inet_diag_msg: family, state, timer, retrans, sockid, ...
                    sport, dport = struct.unpack_from(">HH", data, m + 4)
                    inode = struct.unpack_from("=I", data, m + 68)[0]
                    if inode:
                        yield (_diag_endpoint(data[m], data[m + 8:m + 24], sport),
                               _diag_endpoint(data[m], data[m + 24:m + 40], dport),
                               data[m + 1] == TCP_LISTEN, inode)
                    offset += (length + 3) & ~3
                else:
                    continue  # this datagram ended without NLMSG_DONE: read the next one
                break


@dataclass
class SsSocket:
    """One socket of `ss -tinHe[a]` / `ss -tinHE` output."""

    state: str
    local: str
    peer: str
    inode: int  # 0 in close events (the socket has no file any more)
    counters: dict[str, int]


def parse_ss(lines: Iterator[str]) -> Iterator[SsSocket]:
    """The sockets of ss output: a header line per socket, then its tcp_info indented."""
    header: list[str] | None = None
    for line in lines:
        if line.strip() and not line[0].isspace():
            header = line.split()
            if header[0] == "LISTEN":  # listeners print no tcp_info line worth waiting for
                inode = re.search(r"\bino:(\d+)", line)
                yield SsSocket("LISTEN", endpoint(header[3]), "", int(inode.group(1)) if inode else 0, {})
                header = None
            continue
        if header is None or len(header) < 5:
            continue
        inode = re.search(r"\bino:(\d+)", " ".join(header[5:]))
        yield SsSocket(header[0], endpoint(header[3]), endpoint(header[4]),
                       int(inode.group(1)) if inode else 0,
                       {k: int(v) for k, v in _COUNTER.findall(line)})
        header = None


class TrafficMonitor:
    """Per-socket TCP byte counters of the processes carrying `token`, while a run lasts.

    Every `attribute_s` the endpoints of our processes' sockets are mapped to roles; every
    `poll_s` every socket's counters are read with `ss -tinHea` (per-socket maxima kept);
    `ss -E` adds each socket's final counters when it closes. A connection seen only
    closing is attributed by its endpoints (listening ports give servers' owners)."""

    method = "ss: per-socket tcp_info bytes_sent (polled maxima + final counters at close)"

    def __init__(self, token: str, poll_s: float, attribute_s: float, max_s: float) -> None:
        self.token, self.poll_s, self.attribute_s, self.max_s = token, poll_s, attribute_s, max_s
        self.lock = threading.Lock()  # the poller and the close-event reader both write
        self.by_inode: dict[int, SocketStat] = {}
        self.open_by_pair: dict[tuple[str, str], SocketStat] = {}  # to match close events
        self.unpolled: list[SocketStat] = []  # opened and closed between two polls
        self.owner: dict[str, str] = {}  # "ip:port" of a connected end -> its process's role
        self.listeners: dict[str, str] = {}  # listening port -> role
        self.inode_roles: dict[int, str] = {}  # socket inode -> role, every one ever seen
        self.pids: dict[int, str] = {}  # our live processes -> role
        self.polls = self.attribute_passes = 0
        self.poll_times: list[float] = []  # wall-clock time of every counter poll
        self.attribute_cpu_s = 0.0
        self.close_events = 0
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, daemon=True)
        self._events: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    # -- lifecycle

    def start(self) -> None:
        self._start_close_events()
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        self._poller.join(timeout=10)
        time.sleep(0.5)  # let the last close events of exiting processes arrive
        if self._events is not None:
            stop_process(self._events)
        if self._reader is not None:
            self._reader.join(timeout=5)

    @property
    def close_events_enabled(self) -> bool:
        return self._events is not None

    def _start_close_events(self) -> None:
        """`ss -E` prints each socket's final tcp_info as the kernel destroys it (the kernel
        may refuse these events to unprivileged users; polling alone is the fallback).
        stdbuf: ss's stdout to a pipe would otherwise sit in an unflushed buffer."""
        stdbuf = shutil.which("stdbuf")
        if stdbuf is None or shutil.which("timeout") is None:
            return
        # `timeout`: even if we are SIGKILLed and never stop it, the monitor ends by itself.
        proc = subprocess.Popen(["timeout", str(int(self.max_s)), stdbuf, "-oL", "ss", "-tinHE"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        time.sleep(0.3)
        if proc.poll() is not None:  # not allowed here: go on with polling only
            return
        self._events = proc
        self._reader = threading.Thread(target=self._read_close_events, daemon=True)
        self._reader.start()

    # -- polling

    def _poll_loop(self) -> None:
        next_counters = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_counters:
                self.pids = processes_with_token(self.token)
                self.poll_counters()
                next_counters = time.monotonic() + self.poll_s
            else:
                self.attribute()
            self._stop.wait(self.attribute_s)
        self.poll_counters()

    def attribute(self) -> None:
        """Map every socket of our processes to its role: inode -> role from /proc/PID/fd,
        inode -> endpoints from a sock_diag dump. Cheap (only our few processes' fds, no
        `ss -p`, which reads every process's), so it runs often and catches connections
        that live a few tens of milliseconds (a joining island's state download)."""
        started = time.perf_counter()
        inodes: dict[int, str] = {}
        for pid, role in self.pids.items():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[int(link[8:-1])] = role
        try:
            table = list(tcp_sockets())
        except OSError:  # no sock_diag here: the `ss` polls alone map endpoints (less often)
            table = []
        with self.lock:
            self.inode_roles.update(inodes)
            for local, _peer, listening, inode in table:
                role = inodes.get(inode)
                if role is None:
                    continue
                if listening:
                    self.listeners[port_of(local)] = role
                else:
                    self.owner[local] = role
            self.attribute_passes += 1
            self.attribute_cpu_s += time.perf_counter() - started

    def poll_counters(self) -> None:
        self.attribute()
        try:
            out = subprocess.run(["ss", "-tinHea"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        now = time.time()
        with self.lock:
            self.polls += 1
            self.poll_times.append(now)
            for sock in parse_ss(iter(out.splitlines())):
                role = self.inode_roles.get(sock.inode)
                if role is None:
                    continue  # not one of our processes' sockets
                if sock.state == "LISTEN":
                    self.listeners[port_of(sock.local)] = role
                    continue
                self.owner[sock.local] = role
                stat = self.by_inode.get(sock.inode)
                if stat is None:
                    stat = self.by_inode[sock.inode] = SocketStat(sock.local, sock.peer, role, polled=True)
                    self.open_by_pair[(sock.local, sock.peer)] = stat
                stat.absorb(sock.counters, now)

    # -- close events

    def _read_close_events(self) -> None:
        assert self._events is not None and self._events.stdout is not None
        for sock in parse_ss(iter(self._events.stdout.readline, "")):
            with self.lock:
                self.close_events += 1
                stat = self.open_by_pair.pop((sock.local, sock.peer), None)
                if stat is None:  # never polled: attributed (if at all) by its endpoints later
                    stat = SocketStat(sock.local, sock.peer, None)
                    self.unpolled.append(stat)
                stat.absorb(sock.counters, time.time())
                stat.closed = True

    # -- results

    def role_at(self, end: str) -> str | None:
        """The role of the process on this end: a connected end we polled, else the owner of
        the listening port (the server side of a connection we only saw closing)."""
        return self.owner.get(end) or self.listeners.get(port_of(end))

    def category(self, stat: SocketStat) -> str:
        """peer: between two different islands (ranks); control: to/from the launcher
        (lighthouse, torchrun store); internal: within one role; else unattributed."""
        mine = stat.role or self.role_at(stat.local)
        theirs = self.role_at(stat.peer)
        if mine is None and theirs is None:
            return "foreign"  # not ours: some other socket that closed while we listened
        if mine is None or theirs is None:
            return "unattributed"  # one end ours, the other opened and closed between polls
        if "launcher" in (mine, theirs):
            return "control"
        if mine == theirs:
            return "internal"
        return "peer" if is_worker(mine) and is_worker(theirs) else "unattributed"

    def peer_bytes_after(self, when: float) -> int:
        """Bytes sent between islands (ranks) as read by the first counter poll at or after
        wall-clock time `when` (so everything sent before `when` is in)."""
        with self.lock:
            stats = [s for s in [*self.by_inode.values(), *self.unpolled] if self.category(s) == "peer"]
            later = [t for t in self.poll_times if t >= when]
        until = later[0] if later else float("inf")
        return sum(max((b for t, b in s.samples if t <= until), default=0) for s in stats)

    def summary(self) -> dict[str, Any]:
        with self.lock:
            stats = [(s, self.category(s)) for s in [*self.by_inode.values(), *self.unpolled]]
            stats = [(s, kind) for s, kind in stats if kind != "foreign"]
            listeners = dict(self.listeners)
        totals: dict[str, int] = {}
        sockets: dict[str, int] = {}
        by_role: dict[str, int] = {}
        for stat, kind in stats:
            totals[kind] = totals.get(kind, 0) + stat.bytes_sent
            sockets[kind] = sockets.get(kind, 0) + 1
            if kind == "peer":
                role = stat.role or self.role_at(stat.local) or "?"
                by_role[role] = by_role.get(role, 0) + stat.bytes_sent
        peer = [s for s, kind in stats if kind == "peer"]
        # The sockets that carried data, for a reader who wants to check the attribution.
        detail = [{"local": s.local, "peer": s.peer, "role": s.role or self.role_at(s.local),
                   "peer_role": self.role_at(s.peer), "category": kind, "bytes_sent": s.bytes_sent,
                   "polled": s.polled} for s, kind in sorted(stats, key=lambda x: -x[0].bytes_sent)
                  if s.bytes_sent > 0]
        return {"method": self.method, "peer_bytes": totals.get("peer", 0),
                "peer_bytes_acked": sum(s.bytes_acked for s in peer),
                "peer_bytes_retrans": sum(s.bytes_retrans for s in peer),
                "unattributed_bytes": totals.get("unattributed", 0),
                "peer_bytes_by_sender": dict(sorted(by_role.items())),
                "bytes_by_category": totals, "sockets_by_category": sockets, "listeners": listeners,
                "polls": self.polls, "poll_s": self.poll_s, "attribute_s": self.attribute_s,
                "attribute_passes": self.attribute_passes, "attribute_cpu_s": round(self.attribute_cpu_s, 3),
                "close_events": self.close_events if self.close_events_enabled else None,
                "sockets": detail}


class LoopbackMonitor:
    """Fallback without `ss`: the loopback interface's tx byte counter over the run. Measured,
    but an upper bound: it also counts control traffic and anything else on the machine."""

    method = "/proc/net/dev lo tx_bytes delta (FALLBACK: includes all loopback traffic on the machine)"

    def __init__(self) -> None:
        self.before = self.after = 0

    @staticmethod
    def _lo_tx() -> int:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])
        raise RuntimeError("no loopback interface in /proc/net/dev")

    def start(self) -> None:
        self.before = self._lo_tx()

    def stop(self) -> None:
        self.after = self._lo_tx()

    def summary(self) -> dict[str, Any]:
        return {"method": self.method, "peer_bytes": self.after - self.before}


def make_monitor(token: str, poll_s: float, attribute_s: float, max_s: float) -> TrafficMonitor | LoopbackMonitor:
    return TrafficMonitor(token, poll_s, attribute_s, max_s) if shutil.which("ss") else LoopbackMonitor()
