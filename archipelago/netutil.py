"""Listening sockets on the address the user chose, never on every interface."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import unquote

from torch.distributed import TCPStore


def local_address() -> str:
    """Where this process listens: LOCAL_ADDR (the address peers reach it at), else loopback."""
    return os.environ.get("LOCAL_ADDR") or "127.0.0.1"


def url_host(host: str) -> str:
    """`host` as written in a URL or HOST:PORT: IPv6 literals get brackets."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def grpc_peer_address(peer: str) -> str:
    """The address a gRPC peer (`ipv4:10.0.0.1:5000`, `ipv6:%5B::1%5D:5000`) calls from,
    without its port, an IPv4-mapped IPv6 address as IPv4; anything else as given."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return canonical_host(unquote(rest).rpartition(":")[0].strip("[]"))


def canonical_host(host: str) -> str:
    """An IP literal in its one form, an IPv4-mapped IPv6 address as IPv4 (one peer is one
    host however a socket names it); anything else as given."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped or address)


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host` (IPv4 or IPv6) at `port` (0: a free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(address)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def bound_tcp_store(host: str) -> TCPStore:
    """A TCPStore server that listens on `host` only, at a free port (`.port`).

    TCPStore alone would listen on every interface; it gets a socket bound here instead.
    """
    listener = listening_socket(host)
    try:
        store = TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.fileno())
    except Exception:
        listener.close()
        raise
    # The store's server owns the descriptor now and closes it itself: the socket object
    # must not close it a second time (by then the number may belong to another file).
    listener.detach()
    return store
