"""Finding and stopping the processes we started, by a marker in their environment.

torchrun starts each rank in a session of its own, so a rank that outlives torchrun is in
neither our process group nor our process tree; an environment variable that every
descendant inherits still finds it. Processes are never matched by name. The launcher,
the benchmarks and the tests all use these helpers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

PROC = Path("/proc")


def rank_threads(ranks: int, env: Mapping[str, str] = os.environ) -> str:
    """OMP_NUM_THREADS for each of `ranks` ranks sharing this machine's cores: `env`'s own
    when it sets one, else cores / ranks, at least 1 (torchrun would give every rank 1)."""
    if "OMP_NUM_THREADS" in env:
        return env["OMP_NUM_THREADS"]
    return str(max(1, (os.cpu_count() or 1) // ranks))


def process_env(pid: int) -> dict[str, str] | None:
    """The environment of a live process, or None when it is gone or not ours to read."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    return dict(item.split("=", 1) for item in raw.decode("utf-8", "replace").split("\0") if "=" in item)


def _is_zombie(pid: int) -> bool:
    # A zombie is already dead: signalling it again would only make kill loops spin.
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2:].startswith("Z")


def pids_with_env(name: str, value: str, prefix: bool = False) -> list[int]:
    """Live processes whose environment has `name=value`, or with `prefix` a value of
    `name` that starts with `value` (read afresh: a process caught between fork and exec
    still has its parent's)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            items = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        hit = any(i.startswith(needle) for i in items) if prefix else needle in items
        if hit and not _is_zombie(int(entry.name)):
            found.append(int(entry.name))
    return found


def signal_pids(pids: Iterable[int], sig: int) -> int:
    """Send `sig` to each pid; returns how many were signalled."""
    count = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            count += 1
        except (ProcessLookupError, PermissionError):
            pass
    return count


def kill_until_gone(find: Callable[[], Iterable[int]], timeout_s: float = 10.0, poll_s: float = 0.05) -> int:
    """SIGKILL what `find` returns until it returns nothing (a dying parent may still fork);
    returns how many kills landed."""
    hit, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        count = signal_pids(list(find()), signal.SIGKILL)
        if count == 0:
            break
        hit += count
        time.sleep(poll_s)
    return hit
