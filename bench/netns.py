"""The emulated WAN of bench/wan.py: network namespaces, a bridge, shaped links, their byte
counters, and a probe of the rate one TCP stream gets.

One network namespace per island (`arch-wan-i0`, `arch-wan-i1`) and one for the lighthouse
(`arch-wan-lh`), each joined by a veth pair to a Linux bridge that lives in a namespace of
its own (`arch-wan-net`), so nothing is added to the host's own network. Each island's link
is shaped in both directions with `tc ... tbf` (island-side egress = upload, bridge-side
egress = download); the lighthouse link is not shaped. Everything is named arch-wan-*
(namespaces, and the benchmark token of every process started in them), so `teardown`
finds and removes what a crashed earlier run left behind. Needs root, `ip` and `tc`.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from harness import base_env, kill_token, python_bin, stop_process

from archipelago.launch.processes import kill_until_gone

PREFIX = "arch-wan-"  # every namespace, and every process token, of this benchmark
NET_NS = PREFIX + "net"  # holds the bridge and the bridge-side veth ends
LH_NS = PREFIX + "lh"
BRIDGE = "br0"
WAN_IF = "wan0"  # the veth end inside each endpoint namespace (GLOO_SOCKET_IFNAME)
ISLANDS = 2
TBF_LATENCY_MS = 400  # queue depth of the shaper, as time at the link rate
TOOLS = ("ip", "tc")
LOCK_FILE = Path("/run/arch-wan.lock")  # one run at a time builds the namespaces above


# ------------------------------------------------------------------ commands


def sh(cmd: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run one short system command (ip, tc); with check, a failure raises with its stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit code {done.returncode}): {done.stderr.strip()}")
    return done


# ------------------------------------------------------------------ network


@dataclass
class Wan:
    """The namespaces, veths, bridge and shapers; `up` builds them, `down` removes them."""

    subnet: ipaddress.IPv4Network
    rate_mbit: float
    delay_ms: float = 0.0
    rates: tuple[float, ...] = ()  # each island's own link rate (Mbit/s); empty: ISLANDS islands at rate_mbit

    @property
    def islands(self) -> int:
        return len(self.rates) if self.rates else ISLANDS

    def rate_of(self, k: int) -> float:
        return self.rates[k] if self.rates else self.rate_mbit

    @property
    def lh_addr(self) -> str:
        return str(self.subnet.network_address + 1)

    def island_addr(self, k: int) -> str:
        return str(self.subnet.network_address + 10 + k)

    @staticmethod
    def island_ns(k: int) -> str:
        return f"{PREFIX}i{k}"

    def endpoints(self) -> list[tuple[str, str, str]]:
        """(namespace, address, bridge-side port name) of the lighthouse and every island."""
        return [(LH_NS, self.lh_addr, "lh")] + [(self.island_ns(k), self.island_addr(k), f"i{k}")
                                                for k in range(self.islands)]

    def up(self) -> None:
        sh(["ip", "netns", "add", NET_NS])
        sh(["ip", "-n", NET_NS, "link", "set", "lo", "up"])
        sh(["ip", "-n", NET_NS, "link", "add", BRIDGE, "type", "bridge"])
        sh(["ip", "-n", NET_NS, "link", "set", BRIDGE, "up"])
        for ns, addr, port in self.endpoints():
            sh(["ip", "netns", "add", ns])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])  # the island's own store is on its address
            sh(["ip", "-n", NET_NS, "link", "add", port, "type", "veth", "peer", "name", WAN_IF, "netns", ns])
            sh(["ip", "-n", NET_NS, "link", "set", port, "master", BRIDGE])
            sh(["ip", "-n", NET_NS, "link", "set", port, "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", WAN_IF])
            sh(["ip", "-n", ns, "link", "set", WAN_IF, "up"])
        for k in range(self.islands):
            self.shape(self.island_ns(k), WAN_IF, self.rate_of(k))  # upload
            self.shape(NET_NS, f"i{k}", self.rate_of(k))  # download

    def shape(self, ns: str, dev: str, rate_mbit: float) -> None:
        # tbf needs a bucket of at least one timer tick at the rate (4 ms at HZ 250) to reach
        # it; 16 KB at least so that a full-size frame always fits.
        burst = max(16384, int(rate_mbit * 1e6 / 8 * 0.004))
        tbf = ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]
        if self.delay_ms <= 0:
            sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf])
            return
        done = sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem", "delay",
                   f"{self.delay_ms:g}ms"], check=False)
        if done.returncode != 0:
            raise RuntimeError(f"--delay-ms needs the netem qdisc, which this kernel refused: "
                               f"{done.stderr.strip()} (run without --delay-ms)")
        sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "parent", "1:", "handle", "2:", *tbf])

    def counters(self) -> dict[str, tuple[int, int]]:
        """Bridge port -> (rx, tx) bytes. rx of port iK is what island K sent."""
        links = json.loads(sh(["ip", "-n", NET_NS, "-s", "-j", "link", "show"]).stdout)
        return {link["ifname"]: (int(link["stats64"]["rx"]["bytes"]), int(link["stats64"]["tx"]["bytes"]))
                for link in links if "stats64" in link}


def our_namespaces() -> list[str]:
    done = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(PREFIX)]


def subnet_in_use(subnet: ipaddress.IPv4Network) -> list[str]:
    """Host addresses and routes (root namespace) that overlap `subnet`."""
    clashes = []
    for entry in json.loads(sh(["ip", "-j", "-4", "addr", "show"]).stdout):
        for info in entry.get("addr_info", []):
            net = ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}").network
            if net.overlaps(subnet):
                clashes.append(f"address {info['local']}/{info['prefixlen']} on {entry['ifname']}")
    for route in json.loads(sh(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout):
        dst = route.get("dst", "default")
        if dst == "default":
            continue
        try:
            net = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if net.overlaps(subnet):
            clashes.append(f"route {dst} via {route.get('dev', '?')} (table {route.get('table', 'main')})")
    return clashes


# ------------------------------------------------------------------ processes


def pids_in_namespace(ns: str) -> list[int]:
    done = sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def teardown(token_prefix: str) -> list[str]:
    """Kill our processes and delete our namespaces (their veths, bridge and qdiscs go with
    them). Idempotent; returns what it removed, for the log."""
    removed = []
    count = kill_token(token_prefix, prefix=True)
    for ns in our_namespaces():
        count += kill_until_gone(lambda ns=ns: pids_in_namespace(ns))  # what runs in our namespaces is ours
    if count:
        removed.append(f"{count} processes")
    for ns in our_namespaces():
        if sh(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed


def in_namespace(ns: str, addr: str, cmd: list[str]) -> list[str]:
    """`cmd` inside `ns`. Islands advertise `addr` to each other through LOCAL_ADDR (set in
    their environment), also for recovery; `ip netns exec` execs, so the pid we start is
    the program's own."""
    return ["ip", "netns", "exec", ns, *cmd]


# ------------------------------------------------------------------ set-up


def hold_lock(program: str) -> IO[str] | None:
    """LOCK_FILE, held for this run (close it and unlink LOCK_FILE at the end), or None
    after saying which run holds it."""
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    lock = open(LOCK_FILE, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        print(f"{program}: another run holds {LOCK_FILE}; wait for it (its namespaces are {PREFIX}*)",
              file=sys.stderr)
        return None
    return lock


def preflight() -> str | None:
    """Why the WAN cannot be built here (a skip, not a failure), or None."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces, veth pairs, a bridge and tc qdiscs)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    return None


def setup(wan: Wan) -> None:
    """Remove a crashed earlier run's leftovers, check the subnet is free, build the WAN."""
    leftovers = teardown(PREFIX)  # a crashed earlier run: its processes, its namespaces
    if leftovers:
        print(f"removed leftovers of an earlier run: {', '.join(leftovers)}", flush=True)
    clashes = subnet_in_use(wan.subnet)
    if clashes:
        raise RuntimeError(f"--subnet {wan.subnet} is in use on this host ({'; '.join(clashes)}); pick "
                           "another private /24 with --subnet")
    wan.up()
    print(f"network: {', '.join(f'{ns} {addr}' for ns, addr, _ in wan.endpoints())} on bridge {BRIDGE} in "
          f"{NET_NS}; island links tbf {', '.join(f'{wan.rate_of(k):g}' for k in range(wan.islands))} Mbit/s "
          "each way", flush=True)


# ------------------------------------------------------------------ counters


@dataclass
class Sample:
    time: float
    ports: dict[str, tuple[int, int]]


def wan_bytes(ports: dict[str, tuple[int, int]]) -> int:
    """Bytes between islands: sent by islands into the bridge, less what reached the lighthouse."""
    return sum(rx for port, (rx, _) in ports.items() if port[:1] == "i" and port[1:].isdigit()) - ports["lh"][1]


class Sampler:
    """Reads the bridge counters every period_s in a thread, so that windows inside a run
    (the rounds after the join round) can be measured afterwards."""

    def __init__(self, wan: Wan, period_s: float) -> None:
        self.wan, self.period_s = wan, period_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def take(self) -> Sample:
        sample = Sample(time.time(), self.wan.counters())
        self.samples.append(sample)
        return sample

    def __enter__(self) -> Sampler:
        self.take()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.take()
        except Exception:  # noqa: BLE001 - interrupted mid-teardown: keep what we have
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.take()
            except Exception:  # noqa: BLE001 - a late read during teardown
                return

    def wan_at(self, t: float) -> float | None:
        """WAN bytes at time t, interpolated between the samples around it."""
        points = sorted((s.time, wan_bytes(s.ports)) for s in self.samples)
        if not points or t < points[0][0] or t > points[-1][0]:
            return None
        for (t0, b0), (t1, b1) in zip(points, points[1:]):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return float(points[-1][1])

    def totals(self) -> dict[str, Any]:
        first, last = self.samples[0].ports, self.samples[-1].ports
        delta = {port: (last[port][0] - first[port][0], last[port][1] - first[port][1]) for port in last}
        return {"wan_bytes": wan_bytes(last) - wan_bytes(first),
                "island_bytes_sent": [delta[f"i{k}"][0] for k in range(self.wan.islands)],
                "island_bytes_received": [delta[f"i{k}"][1] for k in range(self.wan.islands)],
                "lighthouse_bytes": delta["lh"][0] + delta["lh"][1]}


# ------------------------------------------------------------------ link check


PROBE_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(30); n, want = 0, int(sys.argv[3])
while n < want:
    data = c.recv(1 << 16)
    if not data: break
    n += len(data)
c.sendall(b"k"); c.close()
"""
PROBE_CLIENT = """
import socket, sys, time
want = int(sys.argv[3]); buf = b"x" * (1 << 16)
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); break
    except OSError: time.sleep(0.1)
t = time.perf_counter(); sent = 0
while sent < want:
    sent += c.send(buf[:want - sent])
c.recv(1); print(want * 8 / (time.perf_counter() - t) / 1e6)
"""


def link_check(wan: Wan, run_id: str, threads: int) -> float:
    """Mbit/s of one TCP stream island 0 -> island 1 through both shapers (about 1 s of data)."""
    size = int(min(wan.rate_of(0), wan.rate_of(1)) * 1e6 / 8)
    token = f"{PREFIX}{run_id}-probe"
    env = base_env(token, threads)
    port = "5201"
    server = subprocess.Popen(["ip", "netns", "exec", wan.island_ns(1), python_bin(), "-c", PROBE_SERVER,
                               wan.island_addr(1), port, str(size)], env=env, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        done = subprocess.run(["ip", "netns", "exec", wan.island_ns(0), python_bin(), "-c", PROBE_CLIENT,
                               wan.island_addr(1), port, str(size)], env=env, capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"link check failed: {done.stderr.strip()}")
        return float(done.stdout.strip())
    finally:
        stop_process(server)
        kill_token(token)
