"""Cross-island traffic of a DiLoCo federation vs DDP all-reduce, and the stall after a kill.

Three runs on this machine, one after the other, all llama3 debug on Shakespeare:

1. federation: `archipelago local --islands 1,1` (two 1-rank islands, so the only traffic
   between processes that trains anything is the cross-island outer sync);
2. baseline: `archipelago train --nproc 2 --parallelism.data_parallel ddp`, each rank with
   one island's batch, all-reducing gradients every step;
3. kill drill: run 1 again with `--kill 1@T`, T mid-round after a couple of outer steps
   (taken from run 1's timing); island 0's metrics give the survivor's stall.

Bytes are measured, not computed: the kernel's per-socket TCP counters (`ss -tinHea`,
tcp_info bytes_sent, retransmissions included) of every process we started, polled every
--poll-s seconds keeping per-socket maxima, plus `ss -tinHE`, which reports each socket's
final counters as it closes, so the bytes after the last poll are not lost. Every
--attribute-s seconds each socket of our processes (inode in /proc/PID/fd) is tied to its
endpoints (a sock_diag netlink dump, as ss does), so even a connection that lives a few
tens of milliseconds is attributed; a process gets its role from its environment (island
token / torchrun RANK). Only bytes between two different islands (two ranks for DDP)
count: lighthouse heartbeats/quorums and torchrun's store are left out (`control`).
Without `ss`, the loopback interface's tx counter (/proc/net/dev) is used, which includes
everything on the machine; the JSON says which method was used.

Reported (table, ratio first, and JSON): bytes per token and per committed outer step over
the whole run, and `steady_*` over rounds 2..n only (round 1 also carries the joining
island's copy of the global state), next to the payload the trainer reports (outer_step
`bytes_sent`, summed over islands); DDP likewise (steady: between its first and last step
record). The stall: island 0's time from its last outer step before the kill to the next
one, next to run 1's median round and the time the survivor spent blocked in that sync.

    python bench/federation.py [--steps 40] [--sync-steps 10] [--ddp-steps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from archipelago.launch.processes import kill_until_gone, process_env  # noqa: E402
from archipelago.metrics.islands import island_records, outer_records  # noqa: E402
from archipelago.metrics.jsonl import iter_records  # noqa: E402

# Inherited by every process a run starts (islands and torchrun ranks start sessions of
# their own, so neither our process group nor the process tree finds them all).
BENCH_TOKEN_ENV = "ARCHIPELAGO_BENCH_TOKEN"
ISLAND_TOKEN_ENV = "ARCHIPELAGO_ISLAND_TOKEN"  # set by `archipelago local` (launch/local.py)
STOP_GRACE_S = 5.0
# The same switches for every run: no checkpoints, validation or TensorBoard traffic/IO.
COMMON_OVERRIDES = ["--checkpoint.no_enable", "--training.val_every", "0", "--metrics.no_tensorboard"]


# ------------------------------------------------------------------ processes


def processes_with_token(token: str) -> dict[int, str]:
    """pid -> role of every live process carrying our run token (never matched by name).
    Environments are read afresh each time: a process caught between fork and exec still
    has its parent's."""
    found = {}
    for entry in Path("/proc").iterdir():
        env = process_env(int(entry.name)) if entry.name.isdigit() else None
        if env is not None and env.get(BENCH_TOKEN_ENV) == token:
            found[int(entry.name)] = role_of(env)
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


# ------------------------------------------------------------------- one run


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL, one process we started (by its pid)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_GRACE_S)


def kill_token(token: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process carrying our token until none is left."""
    kill_until_gone(lambda: processes_with_token(token), timeout_s)


@dataclass
class RunResult:
    cmd: list[str]
    exit_code: int
    wall_s: float
    monitor: TrafficMonitor | LoopbackMonitor | None = None

    @property
    def traffic(self) -> dict[str, Any]:
        return self.monitor.summary() if self.monitor is not None else {}


def run_job(cmd: list[str], log_path: Path, timeout_s: float,
            polling: tuple[float, float] | None) -> RunResult:
    """Run `cmd` with a hard timeout, its traffic monitored unless polling (counters and
    attribution periods) is None; whatever happens (timeout, exception, Ctrl-C), every
    process it started is gone on return."""
    token = uuid.uuid4().hex
    env = {**os.environ, BENCH_TOKEN_ENV: token}
    monitor = make_monitor(token, *polling, timeout_s + 60) if polling is not None else None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {' '.join(cmd)}\n  (output: {log_path})", flush=True)
    proc = None
    t0 = time.monotonic()
    try:
        if monitor is not None:
            monitor.start()
        with open(log_path, "wb") as log:
            # Own session: our Ctrl-C does not reach it directly; we stop it in order below.
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"timed out after {timeout_s:.0f}s: {' '.join(cmd)} (see {log_path})")
    finally:
        # A second Ctrl-C must not cut the clean-up short and leave islands running.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if proc is not None:
                stop_process(proc)  # `archipelago local` stops its islands on SIGTERM
            kill_token(token)  # and anything left over (ranks outliving torchrun, islands)
            if monitor is not None:
                monitor.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
    return RunResult(cmd, code, time.monotonic() - t0, monitor)


# ------------------------------------------------------------- run results


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (the package's reader; a line cut by a kill is skipped)."""
    return list(iter_records(path)) if path.is_file() else []


def seq_len_of(run_dir: Path) -> int:
    return int(json.loads((run_dir / "config.json").read_text())["data"]["seq_len"])


def outer_steps(island_dir: Path) -> list[dict[str, Any]]:
    return outer_records(island_records(island_dir))


def tokens_trained(run_dir: Path) -> int:
    """Tokens of one island / job: summary.json, else its last step record."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        return int(json.loads(summary.read_text())["tokens"])
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r and "tokens" in r]
    return int(steps[-1]["tokens"]) if steps else 0


def round_intervals(records: list[dict[str, Any]]) -> list[float]:
    times = [r["time"] for r in records]
    return [b - a for a, b in zip(times, times[1:])]


def steady_federation_bytes(monitor: Any, islands: list[Path]) -> float | None:
    """Measured bytes per outer step over rounds 2..n. The first round also carries one-off
    traffic (a joining island's copy of the global state, connection set-up). A round's
    bytes are all sent before its outer_step records (the sync ends the round) and the next
    round's only seconds later, so counters read just after the first and the last
    committed round's records bracket the rounds in between."""
    if not isinstance(monitor, TrafficMonitor):
        return None
    ends: dict[int, float] = {}
    for island in islands:
        for record in outer_steps(island):
            if record.get("committed"):
                ends[record["outer_step"]] = max(ends.get(record["outer_step"], 0.0), record["time"])
    times = [ends[k] for k in sorted(ends)]
    if len(times) < 2:
        return None
    return (monitor.peer_bytes_after(times[-1]) - monitor.peer_bytes_after(times[0])) / (len(times) - 1)


def steady_ddp_bytes(monitor: Any, run_dir: Path) -> tuple[float, int] | None:
    """Measured (bytes, steps) between the first and the last step record: leaves out the
    start (DDP's initial broadcast of the weights, connection set-up). A record is written
    after its step's all-reduce and the next step's starts only in its backward pass, so
    counters read just after the records bracket whole steps (up to a fraction of a step
    when a poll comes late, at both ends alike)."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r and "time" in r]
    if not isinstance(monitor, TrafficMonitor) or len(records) < 2:
        return None
    first, last = records[0], records[-1]
    sent = monitor.peer_bytes_after(last["time"]) - monitor.peer_bytes_after(first["time"])
    return sent, last["step"] - first["step"]


def polling(args: argparse.Namespace) -> tuple[float, float]:
    return args.poll_s, args.attribute_s


def train_args(args: argparse.Namespace, steps: int) -> list[str]:
    # Warmup must stay below the step count (a short DDP run would otherwise be refused).
    return ["--config", str(args.config), "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", str(min(20, steps // 2)), *COMMON_OVERRIDES]


def federation_cmd(args: argparse.Namespace, run_dir: Path, kill_at: float | None = None) -> list[str]:
    kill = ["--kill", f"1@{kill_at:.1f}"] if kill_at is not None else []
    return [sys.executable, "-m", "archipelago.launch.cli", "local", "--islands", "1,1", "--no-table", *kill,
            *train_args(args, args.steps), "--fault_tolerance.sync_steps", str(args.sync_steps),
            "--training.batch_size", str(args.batch_size), "--job.run_dir", str(run_dir)]


def ddp_cmd(args: argparse.Namespace, run_dir: Path) -> list[str]:
    # batch_size is the job's global batch: 2 ranks x one island's batch each.
    return [sys.executable, "-m", "archipelago.launch.cli", "train", "--nproc", "2",
            *train_args(args, args.ddp_steps), "--parallelism.data_parallel", "ddp",
            "--training.batch_size", str(2 * args.batch_size), "--job.run_dir", str(run_dir)]


def run_checked(cmd: list[str], root: Path, name: str, args: argparse.Namespace) -> RunResult:
    """run_job with its log in ROOT/NAME.log; a failed run raises, naming the log."""
    run = run_job(cmd, root / f"{name}.log", args.timeout, polling(args))
    if run.exit_code != 0:
        raise RuntimeError(f"{name} run failed (exit code {run.exit_code}); see {root / f'{name}.log'}")
    return run


def measure_federation(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_dir = root / "federation"
    run = run_checked(federation_cmd(args, run_dir), root, "federation", args)
    fed = json.loads((run_dir / "federation.json").read_text())
    committed = sum(1 for entry in fed["outer_steps"] if entry["islands"])
    islands = [run_dir / f"island-{i['id']}" for i in fed["islands"]]
    tokens = sum(tokens_trained(d) for d in islands)
    # What the trainer says it handed to the cross-island all-reduce, summed over islands.
    payload = sum(r.get("bytes_sent", 0) for d in islands for r in outer_steps(d))
    records0 = outer_steps(islands[0])
    traffic = run.traffic
    sent = traffic["peer_bytes"]
    steady = steady_federation_bytes(run.monitor, islands)
    # Tokens one round adds: every island's batch x sync_steps inner steps.
    round_tokens = len(islands) * args.batch_size * args.sync_steps * seq_len_of(run_dir / "island-0")
    return {"cmd": run.cmd, "exit_code": run.exit_code, "wall_s": run.wall_s, "run_dir": str(run_dir),
            "outer_steps": committed, "tokens": tokens, "bytes_sent": sent,
            "bytes_per_outer_step": sent / committed if committed else None,
            "bytes_per_token": sent / tokens if tokens else None,
            "steady_bytes_per_outer_step": steady,
            "steady_bytes_per_token": steady / round_tokens if steady is not None else None,
            "payload_bytes_per_outer_step": payload / committed if committed else None,
            "round_intervals_s": round_intervals(records0),
            "median_sync_s": statistics.median(r["sync_s"] for r in records0) if records0 else None,
            "outer_step_offsets_s": [r["time"] - fed["start_time"] for r in records0],
            "traffic": traffic}


def measure_ddp(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_dir = root / "ddp"
    run = run_checked(ddp_cmd(args, run_dir), root, "ddp", args)
    summary = json.loads((run_dir / "summary.json").read_text())
    traffic = run.traffic
    sent, tokens, steps = traffic["peer_bytes"], int(summary["tokens"]), int(summary["steps"])
    steady = steady_ddp_bytes(run.monitor, run_dir)
    steady_per_step = steady[0] / steady[1] if steady and steady[1] else None
    return {"cmd": run.cmd, "exit_code": run.exit_code, "wall_s": run.wall_s, "run_dir": str(run_dir),
            "steps": steps, "tokens": tokens, "bytes_sent": sent,
            "bytes_per_step": sent / steps if steps else None,
            "bytes_per_token": sent / tokens if tokens else None,
            "steady_bytes_per_step": steady_per_step,
            "steady_bytes_per_token": steady_per_step / (tokens / steps) if steady_per_step and steps else None,
            "gradient_bytes_per_rank": int(summary["params"]) * 4,  # fp32 gradients, for reference
            "traffic": traffic}


def default_kill_at(federation: dict[str, Any], after_outer: int) -> float:
    """Seconds after the launcher's start: half a round after outer step `after_outer`
    of the first run, so the kill lands mid-round with a couple of rounds behind it."""
    offsets, intervals = federation["outer_step_offsets_s"], federation["round_intervals_s"]
    if len(offsets) < after_outer or not intervals:
        raise RuntimeError("the federation run committed too few outer steps to place the kill: "
                           "raise --steps or lower --sync-steps, or give --kill-at")
    return offsets[after_outer - 1] + 0.5 * statistics.median(intervals)


def measure_stall(args: argparse.Namespace, root: Path, kill_at: float, attempt: int) -> dict[str, Any]:
    run_dir = root / f"kill-{attempt}"
    # No traffic monitor: only island 0's clock matters here. Exit code is nonzero by
    # design (island 1 was killed and not restarted); island 0's own code must be 0.
    run = run_job(federation_cmd(args, run_dir, kill_at), root / f"kill-{attempt}.log", args.timeout, None)
    fed = json.loads((run_dir / "federation.json").read_text())
    kills = [e for e in fed["events"] if e.get("event") == "kill"]
    survivor = next(i for i in fed["islands"] if i["id"] == 0)
    result: dict[str, Any] = {"cmd": run.cmd, "exit_code": run.exit_code, "wall_s": run.wall_s,
                              "run_dir": str(run_dir), "kill_at_s": kill_at,
                              "survivor_exit_code": survivor["exit_code"], "stall_s": None}
    if not kills:
        result["note"] = "the kill did not fire (island 1 had already exited)"
        return result
    kill_time = kills[0]["time"]
    records = outer_steps(run_dir / "island-0")
    before = [r for r in records if r["time"] <= kill_time]
    after = [r for r in records if r["time"] > kill_time]
    result.update(kill_time=kill_time, round_intervals_s=round_intervals(records))
    if not before or not after:
        result["note"] = "no outer step of island 0 on both sides of the kill: adjust --kill-at / --steps"
        return result
    last, nxt = before[-1], after[0]
    result.update(stall_s=nxt["time"] - last["time"], last_outer_step_before_kill=last["outer_step"],
                  kill_into_round_s=kill_time - last["time"], next_outer_step=nxt["outer_step"],
                  next_committed=nxt["committed"], next_participants=nxt["participants"],
                  next_sync_s=nxt["sync_s"])
    if survivor["exit_code"] != 0:
        result["note"] = f"island 0 did not survive the kill (exit code {survivor['exit_code']})"
    return result


def kill_drill(args: argparse.Namespace, root: Path, federation: dict[str, Any],
               median_round: float | None) -> dict[str, Any]:
    """The kill run, aimed mid-round. Startup time varies between runs (seconds on a busy
    machine), so when the kill landed outside the middle 60% of a round it is run again
    (--kill-retries times) with the kill time corrected by the error seen."""
    kill_at = args.kill_at if args.kill_at is not None else default_kill_at(federation, args.kill_after_outer)
    retries = args.kill_retries if args.kill_at is None and median_round else 0
    attempts: list[dict[str, Any]] = []
    for attempt in range(1 + retries):
        result = measure_stall(args, root, kill_at, attempt)
        attempts.append({k: result.get(k) for k in ("kill_at_s", "kill_into_round_s", "stall_s", "cmd")})
        into = result.get("kill_into_round_s")
        if into is None or median_round is None or 0.2 <= into / median_round <= 0.8:
            break
        kill_at = max(1.0, kill_at + 0.5 * median_round - into)
    result["attempts"] = attempts
    return result


# ------------------------------------------------------------------- report


def num(value: float | None, fmt: str) -> str:
    """`value` formatted for a table cell; "-" when there is none."""
    return "-" if value is None else format(value, fmt)


def print_tables(result: dict[str, Any]) -> None:
    fed, ddp, kill = result["federation"], result["ddp"], result["kill"]
    print(f"\nllama3 debug, {result['batch_size']} x {result['seq_len']} tokens per island (DDP rank) "
          f"per step; federation: 2 islands x 1 rank, {result['steps']} steps, sync every "
          f"{result['sync_steps']}; DDP: 2 ranks, {ddp['steps']} steps; bytes: {fed['traffic']['method']}\n")
    print("| ratio (DDP / DiLoCo bytes per token) | steady-state ratio | DiLoCo bytes/token "
          "| DDP bytes/token | DiLoCo bytes/outer step | steady bytes/outer step "
          "| trainer payload/outer step | outer steps |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {num(result['ratio'], '.2f')} | {num(result['steady_ratio'], '.2f')} "
          f"| {num(result['bytes_per_token'], ',.0f')} | {num(result['ddp_bytes_per_token'], ',.0f')} "
          f"| {num(fed['bytes_per_outer_step'], ',.0f')} | {num(fed['steady_bytes_per_outer_step'], ',.0f')} "
          f"| {num(fed['payload_bytes_per_outer_step'], ',.0f')} | {fed['outer_steps']} |")
    print(f"\nsurvivor (island 0) after `--kill 1@{kill['kill_at_s']:.1f}` (no restart)\n")
    print("| ratio (stall / median round) | stall s | median round s (no kill) | next sync s "
          "| median sync s (no kill) | kill into round s | islands after |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {num(result['stall_ratio'], '.2f')} | {num(result['stall_s'], '.1f')} "
          f"| {num(result['median_round_s'], '.1f')} | {num(kill.get('next_sync_s'), '.2f')} "
          f"| {num(fed['median_sync_s'], '.2f')} | {num(kill.get('kill_into_round_s'), '.1f')} "
          f"| {kill.get('next_participants', '-')} |")
    if len(kill["attempts"]) > 1:
        misses = ", ".join(f"{a['kill_into_round_s']:.1f}" for a in kill["attempts"][:-1])
        print(f"\n(earlier attempts landed {misses} s into a round, off its middle; kill time corrected)")
    if kill.get("note"):
        print(f"\nnote: {kill['note']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/debug.toml")
    p.add_argument("--steps", type=int, default=40, help="inner steps of each federation run")
    p.add_argument("--sync-steps", type=int, default=10, help="inner steps between outer steps")
    p.add_argument("--ddp-steps", type=int, default=20, help="steps of the DDP baseline")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per island (per DDP rank) per step")
    p.add_argument("--kill-after-outer", type=int, default=2,
                   help="place the kill half a round after this outer step (timed by the first run)")
    p.add_argument("--kill-at", type=float, default=None, help="kill island 1 at this many seconds instead")
    p.add_argument("--kill-retries", type=int, default=1,
                   help="rerun the kill drill this many times when the kill missed the middle of a round")
    p.add_argument("--poll-s", type=float, default=0.2, help="socket counter polling period (ss)")
    p.add_argument("--attribute-s", type=float, default=0.05,
                   help="period of mapping sockets to processes (/proc/PID/fd + sock_diag, cheap)")
    p.add_argument("--timeout", type=float, default=600, help="hard limit per run, seconds")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="run directories (default: a new /tmp/bench-fed-* folder)")
    p.add_argument("--out", type=Path, default=REPO / "runs/bench/federation.json",
                   help="write the results as JSON here")
    args = p.parse_args()
    if args.steps // args.sync_steps < args.kill_after_outer + 1:
        p.error("--steps must allow at least --kill-after-outer + 1 outer steps")
    return args


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    args = parse_args()
    root = args.work_dir or Path(f"/tmp/bench-fed-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    root.mkdir(parents=True, exist_ok=True)
    fed = measure_federation(args, root)
    ddp = measure_ddp(args, root)
    median_round = statistics.median(fed["round_intervals_s"]) if fed["round_intervals_s"] else None
    kill = kill_drill(args, root, fed, median_round)
    seq_len = seq_len_of(Path(fed["run_dir"]) / "island-0")
    result = {
        "ratio": ratio(ddp["bytes_per_token"], fed["bytes_per_token"]),
        "steady_ratio": ratio(ddp["steady_bytes_per_token"], fed["steady_bytes_per_token"]),
        "bytes_per_token": fed["bytes_per_token"], "ddp_bytes_per_token": ddp["bytes_per_token"],
        "bytes_per_outer_step": fed["bytes_per_outer_step"],
        "steady_bytes_per_outer_step": fed["steady_bytes_per_outer_step"],
        "payload_bytes_per_outer_step": fed["payload_bytes_per_outer_step"],
        "outer_steps": fed["outer_steps"], "tokens": fed["tokens"], "ddp_tokens": ddp["tokens"],
        "stall_s": kill["stall_s"], "median_round_s": median_round,
        "stall_ratio": ratio(kill["stall_s"], median_round),
        "steps": args.steps, "sync_steps": args.sync_steps, "ddp_steps": args.ddp_steps,
        "batch_size": args.batch_size, "seq_len": seq_len, "config": str(args.config),
        "measurement": fed["traffic"]["method"], "work_dir": str(root),
        "commands": [fed["cmd"], ddp["cmd"], *(a["cmd"] for a in kill["attempts"])],
        "federation": fed, "ddp": ddp, "kill": kill,
    }
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


def work_root(chosen: Path | None, prefix: str) -> Path:
    """The folder for a benchmark's run directories: `chosen`, or a new one under /tmp."""
    import tempfile

    root = chosen or Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    print(f"run directories under {root}", flush=True)
    return root


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C (run_job's finally)


def run_main(main: Callable[[], None]) -> None:
    """Run a benchmark's main; after Ctrl-C or SIGTERM (every started process already
    stopped by run_job) say so and exit 130."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        main()
    except KeyboardInterrupt:
        print("\ninterrupted: every process this benchmark started has been stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run_main(main)
