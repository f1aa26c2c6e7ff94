"""`archipelago lighthouse`: run torchft's lighthouse, the membership service of a federation.

Islands find each other through the lighthouse: each island's torchft Manager heartbeats
to it and asks it for a quorum at every outer step. This module runs torchft's own server
(`torchft.coordination.LighthouseServer`, the same code as the `torchft_lighthouse`
console script) inside this process, prints the URL to give the islands, and stops it
cleanly on Ctrl-C / SIGTERM. `start_lighthouse` is the reusable part (the local
federation launcher starts its lighthouse with it). With a federation key the lighthouse
listens on loopback and a gate (federation/gate.py) on the chosen address admits members only.
Without one, `archipelago lighthouse` listens beyond loopback only with --insecure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from archipelago.config import ConfigError
from archipelago.netutil import url_host

if TYPE_CHECKING:
    from torchft.coordination import LighthouseServer

    from archipelago.federation.gate import LighthouseGate
    from archipelago.federation.trust import FederationKey

DEFAULT_BIND = "127.0.0.1:29510"  # this machine only, until the user names an address
DEFAULT_MIN_REPLICAS = 1
DEFAULT_JOIN_TIMEOUT_MS = 60000
DEFAULT_QUORUM_TICK_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5000

WILDCARD_HOSTS = ("0.0.0.0", "::")

DESCRIPTION = """\
Run the lighthouse of a federation (torchft's LighthouseServer, in this process). Islands
join it with TORCHFT_LIGHTHOUSE=http://HOST:PORT or --fault_tolerance.lighthouse
http://HOST:PORT. Stop it with Ctrl-C or SIGTERM (exit code 0).

Defaults are torchft_lighthouse's, except: --bind is 127.0.0.1:29510, reachable from this
machine only (torchft_lighthouse: [::]:29510, every interface); give islands on other hosts
an address they reach, e.g. --bind 10.0.0.1:29510 (a private network's) or --bind
0.0.0.0:29510 (every interface). --min-replicas defaults to 1 (torchft_lighthouse requires
it).

With the federation's key (--key-file, or $ARCHIPELAGO_FEDERATION_KEY_FILE) only islands
holding the same key join: torchft's lighthouse listens on loopback and a gate on --bind
refuses every other caller, and the dashboard (which has an unauthenticated kill endpoint)
stays on loopback. torchft's own log, which names every member's token, then shows
warnings only (RUST_LOG=info brings it back, tokens included). Without a key anyone who
reaches the lighthouse can join the federation and use the dashboard: a keyless lighthouse
listens on a loopback address only, unless --insecure accepts that risk (a trusted private
network; docs/federation.md).
"""


def split_bind(bind: str) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` / `[IPv6]:PORT`; raises ConfigError naming the fix."""
    fix = "expected HOST:PORT, e.g. --bind 0.0.0.0:29510, --bind 127.0.0.1:0 (a free port) or --bind [::]:29510"
    host, sep, port_text = bind.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConfigError(f"--bind {bind}: {fix}")
    if not host:
        host = "0.0.0.0"
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"--bind {bind}: write an IPv6 address in brackets, e.g. [::1]:29510")
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"--bind {bind}: port {port} is out of range; use 1-65535, or 0 for a free port")
    return host, port


def start_lighthouse(bind: str = DEFAULT_BIND, min_replicas: int = DEFAULT_MIN_REPLICAS,
                     join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS,
                     quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS,
                     heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
                     key: FederationKey | None = None) -> LighthouseServer | LighthouseGate:
    """Start torchft's lighthouse on `bind` (HOST:PORT; port 0 picks a free one) and return it.

    With `key`, torchft's lighthouse listens on loopback and a LighthouseGate on `bind`
    admits the members holding the key only; the gate is returned. `.address()` of the
    result is its URL (torchft writes this host's name into it); `.shutdown()` stops it.
    Bad arguments and an unusable address raise ConfigError with a one-line message that
    names the fix.
    """
    host, port = split_bind(bind)
    for name, value, low in (("min_replicas", min_replicas, 1), ("join_timeout_ms", join_timeout_ms, 0),
                             ("quorum_tick_ms", quorum_tick_ms, 1),
                             ("heartbeat_timeout_ms", heartbeat_timeout_ms, 1)):
        if value < low:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be at least {low}")
    with quiet_torchft_log() if key is not None else contextlib.nullcontext():
        from torchft.coordination import LighthouseServer

    from archipelago.federation.gate import GateError, LighthouseGate

    inner = f"{url_host(host)}:{port}" if key is None else "127.0.0.1:0"
    try:
        server = LighthouseServer(bind=inner, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                  quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
        if key is None:
            return server
        try:
            return LighthouseGate(server, host, port, key)
        except GateError:
            server.shutdown()
            raise
    except (RuntimeError, GateError) as exc:
        reason = str(exc)
        if "in use" in reason or "Address already" in reason:
            raise ConfigError(f"--bind {bind}: port {port} is already in use (another lighthouse?); stop that "
                              f"process or pick another port, e.g. --bind {url_host(host)}:{port + 1} "
                              "(port 0 picks a free one)") from None
        if "not available" in reason or "assign" in reason:
            hint = "that is not an address of this machine; bind 0.0.0.0 (all interfaces) or one of its own addresses"
        elif "lookup" in reason or "resolve" in reason:
            hint = f"cannot resolve host {host!r}; use an IP address of this machine, or 0.0.0.0"
        elif "permission" in reason.lower():
            hint = f"not allowed to bind port {port}; use a port above 1023"
        else:
            hint = "expected HOST:PORT with an address of this machine, e.g. --bind 0.0.0.0:29510"
        raise ConfigError(f"--bind {bind}: {reason}: {hint}") from None


@contextlib.contextmanager
def quiet_torchft_log() -> Iterator[None]:
    """RUST_LOG defaults to warnings inside this block (an explicit RUST_LOG wins): torchft's
    Rust module reads it once, when first imported or started, and its lighthouse then logs
    every request at INFO, replica ids and so member tokens (credentials) included. The
    environment is put back afterwards (a process that imported torchft before keeps its
    level)."""
    user_setting = os.environ.get("RUST_LOG")
    os.environ["RUST_LOG"] = user_setting or "warn"
    try:
        yield
    finally:
        if user_setting is None:
            del os.environ["RUST_LOG"]


def refuse_open_without_key(bind: str, key: FederationKey | None, insecure: bool,
                            flags: tuple[str, str, str] = ("--bind", "--key-file", "--insecure")) -> None:
    """Raise ConfigError, naming the fix, for a lighthouse without a key on an address
    beyond loopback, unless `insecure`: anyone who reaches it would join the federation
    (and could claim any step, becoming every island's healing source) and use torchft's
    dashboard, whose kill endpoint stops islands. `flags`: the caller's names for the
    bind address, the key file and the opt-out."""
    from archipelago.federation.trust import is_loopback

    host, _ = split_bind(bind)
    if key is not None or insecure or is_loopback(host):
        return
    bind_flag, key_flag, insecure_flag = flags
    raise ConfigError(f"{bind_flag} {bind} without a federation key: anyone who reaches it could join the "
                      "federation and use torchft's dashboard there, whose kill endpoint stops islands. Give the "
                      f"lighthouse the federation's key file ({key_flag} FILE or $ARCHIPELAGO_FEDERATION_KEY_FILE; "
                      "make one with `archipelago secret new --out FILE`), or bind 127.0.0.1; on a trusted private "
                      f"network, {insecure_flag} accepts the risk")


def island_urls(bind: str, server: LighthouseServer | LighthouseGate) -> tuple[str, str | None]:
    """(URL to give islands, URL for islands on this host or None) of a started lighthouse.

    A lighthouse bound to one address is reached at that address. One bound to all
    interfaces (0.0.0.0, [::]) is reached at this host's name, the URL torchft reports.
    """
    host, _ = split_bind(bind)
    port = server.address().rsplit(":", 1)[1]
    if host in WILDCARD_HOSTS:
        return f"http://{url_host(socket.gethostname())}:{port}", f"http://localhost:{port}"
    return f"http://{url_host(host)}:{port}", None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="archipelago lighthouse", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # The underscore spellings are torchft_lighthouse's, so its command lines work here too.
    p.add_argument("--bind", default=DEFAULT_BIND, metavar="HOST:PORT",
                   help=f"address to listen on; port 0 picks a free one (default {DEFAULT_BIND})")
    p.add_argument("--min-replicas", "--min_replicas", type=int, default=DEFAULT_MIN_REPLICAS, metavar="N",
                   help=f"fewest islands that form a quorum (default {DEFAULT_MIN_REPLICAS})")
    p.add_argument("--join-timeout-ms", "--join_timeout_ms", type=int, default=DEFAULT_JOIN_TIMEOUT_MS,
                   metavar="MS", help="how long to wait for heartbeating stragglers to join before issuing "
                   f"a quorum (default {DEFAULT_JOIN_TIMEOUT_MS})")
    p.add_argument("--quorum-tick-ms", "--quorum_tick_ms", type=int, default=DEFAULT_QUORUM_TICK_MS,
                   metavar="MS", help=f"how often to check for a quorum (default {DEFAULT_QUORUM_TICK_MS})")
    p.add_argument("--heartbeat-timeout-ms", "--heartbeat_timeout_ms", type=int,
                   default=DEFAULT_HEARTBEAT_TIMEOUT_MS, metavar="MS",
                   help="how long without a heartbeat before an island counts as dead: about how long the "
                   "others stall when an island dies mid-exchange; shorter also drops live islands whose "
                   f"heartbeats (every 100 ms) come late (default {DEFAULT_HEARTBEAT_TIMEOUT_MS})")
    p.add_argument("--dashboard", metavar="[HOST]:PORT", help="also serve the live federation dashboard (a web "
                   "page and /metrics) here, e.g. 127.0.0.1:8080 (`:8080`: on 127.0.0.1); islands push to it with "
                   "--metrics.dashboard")
    p.add_argument("--key-file", "--key_file", default="", metavar="FILE",
                   help="the federation's key file: admit only islands that hold it (default: "
                   "$ARCHIPELAGO_FEDERATION_KEY_FILE, else no key: anyone who reaches the lighthouse joins, so "
                   "--bind must then be a loopback address unless --insecure)")
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond loopback without a federation key (anyone who reaches --bind joins the "
                   "federation and can use the dashboard's kill endpoint; anyone who reaches --dashboard can push "
                   "made-up records to it): a trusted private network only")
    return p


def _banner(args: argparse.Namespace, url: str, local_url: str | None, server: Any = None) -> str:
    """What the lighthouse prints once it listens, as one string.

    Printed with one write, so that torchft's logger (another thread, on stderr) cannot
    split its lines when a user merges the two streams with 2>&1.
    """
    host, _ = split_bind(args.bind)
    port = url.rsplit(":", 1)[1]
    where = " (all interfaces)" if local_url else ""
    lines = [f"lighthouse listening on {url_host(host)}:{port}{where}; min_replicas {args.min_replicas}, "
             f"join_timeout_ms {args.join_timeout_ms}, quorum_tick_ms {args.quorum_tick_ms}, "
             f"heartbeat_timeout_ms {args.heartbeat_timeout_ms}",
             f"address: {url}"]
    if local_url:
        lines.append(f"  {url} uses this host's name: other hosts must resolve it to this host, else give "
                     f"them this host's IP; on this host {local_url} works too")
    lines += ["give islands either of:", f"  export TORCHFT_LIGHTHOUSE={url}",
              f"  --fault_tolerance.lighthouse {url}"]
    if hasattr(server, "dashboard"):
        lines += ["members only: islands must hold this federation's key file and prove it from the address they "
                  "join from; others are refused and logged",
                  f"dashboard: {server.dashboard()} (this machine only); Ctrl-C or SIGTERM stops the lighthouse"]
    else:
        lines += ["no federation key: anyone who reaches this address can join (--key-file admits members only)",
                  f"dashboard: {url} (no authentication: keep it on a private network); "
                  "Ctrl-C or SIGTERM stops the lighthouse"]
    return "\n".join(lines) + "\n"


def start_dashboard(bind: str, key: Any = None, insecure: bool = False,
                    flags: tuple[str, str, str] = ("--dashboard", "--key-file", "--insecure")) -> Any:
    """The federation dashboard (metrics/dashboard.py) on `bind` (HOST:PORT); with a federation
    key it accepts only pushes tagged with it, without one it serves beyond loopback only if
    `insecure` (ConfigError naming `flags`, the caller's address, key-file and opt-out flags)."""
    from archipelago.federation.trust import dashboard_verifier
    from archipelago.metrics.dashboard import Dashboard

    host, colon, port = bind.rpartition(":")
    if not colon or not port.isdigit():
        raise SystemExit(f"--dashboard {bind!r}: expected [HOST]:PORT, e.g. 127.0.0.1:8080 or :8080 (this machine "
                         "only; never all interfaces by default)")
    host = host.strip("[]") or "127.0.0.1"  # `:8080`: loopback, not every interface
    return Dashboard(host, int(port), dashboard_verifier(key) if key is not None else None, insecure, flags)


def cmd_lighthouse(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    stop = threading.Event()
    # Handlers first, so that a signal during start-up is not lost.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        from archipelago.federation.trust import load_key

        key = load_key(args.key_file)
        refuse_open_without_key(args.bind, key, args.insecure)
        dashboard = start_dashboard(args.dashboard, key, args.insecure) if args.dashboard else None  # refused first
        server = None
        try:
            server = start_lighthouse(args.bind, args.min_replicas, args.join_timeout_ms,
                                      args.quorum_tick_ms, args.heartbeat_timeout_ms, key=key)
            url, local_url = island_urls(args.bind, server)
            print(_banner(args, url, local_url, server), end="", flush=True)
            if dashboard is not None:
                print(f"federation dashboard: {dashboard.address} (islands: --metrics.dashboard "
                      f"{dashboard.address}; /metrics for Prometheus)", flush=True)
            while not stop.wait(0.5):
                pass
        finally:
            if server is not None:
                server.shutdown()
            if dashboard is not None:
                dashboard.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("lighthouse stopped", flush=True)
    return 0
