"""`archipelago doctor`'s checks of this host: versions, devices, the backend, the island's
fingerprint, disk room for checkpoints, the lighthouse, LOCAL_ADDR, interfaces and ports.

Each returns a `Check` row; a failure carries the fix. The checks against a peer are doctor_peer.py's.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import struct
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 3.0


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

def host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    parts = urlsplit(text if "//" in text else f"//{text}")
    if parts.hostname is None or (parts.port is None and default_port is None):
        raise ValueError(f"{text!r}: expected HOST:PORT or a URL with a port")
    return parts.hostname, parts.port or default_port  # type: ignore[return-value]


def connect(host: str, port: int) -> tuple[socket.socket | None, str]:
    try:
        return socket.create_connection((host, port), timeout=TIMEOUT_S), ""
    except OSError as exc:
        return None, exc.strerror or str(exc)


def check_lighthouse(url: str) -> Check:
    try:
        host, port = host_port(url)
    except ValueError as exc:
        return Check("lighthouse", "FAIL", str(exc), "write it as http://HOST:PORT (TORCHFT_LIGHTHOUSE)")
    began = time.perf_counter()
    conn, why = connect(host, port)
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
        return Check(f"port {port}", "FAIL", f"{host}:{port} cannot be bound ({exc.strerror})", bind_fix(exc, port))
    return Check(f"port {port}", "ok", f"{host}:{port} is free")


def bind_fix(exc: OSError, port: int) -> str:
    """What to do when LOCAL_ADDR:port cannot be bound, by the reason."""
    if exc.errno == errno.EADDRINUSE:
        return (f"another process holds port {port}: choose another (MASTER_PORT, --bind) or stop that "
                "process")
    if exc.errno == errno.EACCES:
        return f"port {port} needs privileges here: choose one above 1023"
    return "set LOCAL_ADDR to an address of this host"
