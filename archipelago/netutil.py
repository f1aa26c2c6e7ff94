"""Listening sockets on the address the user chose, never on every interface."""

from __future__ import annotations

import ipaddress
import os
import socket

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
