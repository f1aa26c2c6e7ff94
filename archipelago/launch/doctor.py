"""`archipelago doctor`: why can this island not reach the others? Checks in seconds, with a fix per failure.

    archipelago doctor [--config FILE] [--lighthouse URL] [--peer HOST:PORT ...] [--port N ...]
    archipelago doctor --serve HOST:PORT [--config FILE]     # on a peer: answer its checks

Each check prints one row: ok / warn / FAIL / info, what was found, and for a failure the fix.
Against a peer (which runs `doctor --serve`), it measures latency and bandwidth, compares
versions, the fingerprint the federation's join compares (field by field) and the clocks,
and, with LOCAL_ADDR set, has the peer connect back to this host at LOCAL_ADDR (an address it
cannot route to fails). The checks of this host are doctor_checks.py's, those against a peer
doctor_peer.py's; this file runs them and prints the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
from typing import Any

from archipelago.launch.doctor_checks import (
    Check,
    check_backend,
    check_devices,
    check_disk,
    check_interfaces,
    check_lighthouse,
    check_local_addr,
    check_port,
    check_versions,
    host_port,
    island_fingerprint,
)
from archipelago.launch.doctor_peer import check_peer, describe_fingerprint, serve

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
    return fingerprint, Check("config", "info", f"{path}: {describe_fingerprint(fingerprint)}")


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
    from rich.text import Text

    table = Table(title="archipelago doctor", show_lines=False)
    for column in ("", "check", "found", "fix"):
        table.add_column(column, overflow="fold")
    styles = {"ok": "green", "warn": "yellow", "FAIL": "bold red", "info": "dim"}
    for c in checks:
        # Text, not markup: a row quotes a peer's answer (`[link=...]` would be a link), and a fix
        # names [fault_tolerance] (which markup would drop).
        table.add_row(Text(c.status, style=styles[c.status]), Text(c.name), Text(c.detail), Text(c.fix))
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
        host, port = host_port(args.serve)
    except ValueError as exc:
        print(f"error: --serve {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    fingerprint = config_check(args.config, cfg, dict(os.environ))[0] if cfg is not None else None
    server = serve(host, port, fingerprint, stop)
    about = f" ({describe_fingerprint(fingerprint)})" if fingerprint is not None else ""
    print(f"answering doctor checks on {host}:{server.getsockname()[1]}{about}; Ctrl-C stops", flush=True)
    try:
        stop.wait(args.serve_seconds or None)
    except KeyboardInterrupt:
        pass
    stop.set()
    server.refusals.flush()
    return 0
