"""The manager gate: torchft's manager server inside the island, one healing call outside.

torchft's manager server (group rank 0 of an island, gRPC `torchft.ManagerService`)
answers anyone who reaches it: `Quorum` and `ShouldCommit` take part in the island's own
rounds, and `Kill` makes the Rust server call `std::process::exit`. Another island needs
exactly one of its calls: a healing island asks `CheckpointMetadata(group rank)` at the
address the lighthouse hands out (`recover_src_manager_address`, which is the server's
`http://HOSTNAME:PORT`, HOSTNAME being LOCAL_ADDR), and then fetches the state from our
healing transport (federation/transport.py) at the URL that call returns.

So the real server listens on the island's internal address: 127.0.0.1 when the island's
bridge ranks all run on this host (the normal case), else MASTER_ADDR (the island's own
network). Its `address()`, which torchft writes to the island's store for the bridge ranks,
is that internal URL; the lighthouse still advertises `http://LOCAL_ADDR:PORT`. When
LOCAL_ADDR is another address, a `ManagerGate` listens there on the same port: it forwards
`CheckpointMetadata`, request and answer byte for byte, to the real server, answers
PERMISSION_DENIED to the service's other calls and UNIMPLEMENTED to anything else.

Why `CheckpointMetadata` is not signed: its answer is the URL of this island's healing
server, nothing more, and with a federation key that server serves the state only to a
signed request (a HEAL_REQUEST frame with a fresh nonce) and signs its answer. Knowing the
URL gives an outsider nothing a port scan of LOCAL_ADDR would not. Signing the call itself
would need torchft's Rust ManagerClient (a module global of torchft.manager, shared by every
manager of the process, whatever its key) replaced on the healing side: left for later.

What it costs: one Python gRPC server (a few threads) on an island's rank 0, one Python hop
per healing request; the island's own quorums and commits go straight to the real server.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import Any

from archipelago.config import ConfigError
from archipelago.netutil import grpc_peer_address, url_host

log = logging.getLogger("archipelago.federation")

SERVICE = "torchft.ManagerService"
HEALING_CALL = f"/{SERVICE}/CheckpointMetadata"  # the one call another island needs
_OWN_CALLS = ("Quorum", "ShouldCommit", "Kill")  # the island's own: refused, and logged
LOOPBACK = "127.0.0.1"
_FORWARD_S = 10.0  # at most this per forwarded call: the server answers from memory, in microseconds
_MAX_REQUEST_BYTES = 64  # a CheckpointMetadataRequest is one int64 (at most 11 bytes)
_WORKERS = 4  # a healing island asks once per heal and bridge rank
_MAX_CALLS = 64  # calls in flight beyond this are refused (RESOURCE_EXHAUSTED), not queued
_MAX_REFUSALS_LOGGED = 256  # distinct (call, peer) pairs named in the log
_BIND_TRIES = 5  # a free port on LOCAL_ADDR may be taken on the internal address: try another


class ManagerGateError(ConfigError):
    """The manager server or its gate could not listen where they must."""


def bridge_ranks_span_hosts(width: int, env: Mapping[str, str] = os.environ) -> bool:
    """True if the island's bridge ranks 0 .. width-1 do not all run on this host.

    Asked on island rank 0, whose node holds ranks 0 .. LOCAL_WORLD_SIZE-1 (torchrun
    numbers each node's ranks contiguously); without torchrun the island is this process.
    """
    local = env.get("LOCAL_WORLD_SIZE")
    return bool(local) and width > int(local or 0)


def same_host(a: str, b: str) -> bool:
    """True if `a` and `b` name a common address (a hostname is resolved; one that does
    not resolve is compared as written)."""
    return bool(_addresses(a) & _addresses(b))


def _addresses(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return {host}


def internal_host(width: int, advertised: str, env: Mapping[str, str] = os.environ) -> str:
    """Where the real manager server listens: loopback, or MASTER_ADDR when the bridge
    ranks span hosts; a ManagerGateError when that is the address other islands reach
    (`advertised`, LOCAL_ADDR), where the island's own calls (and Kill) would be open."""
    if not bridge_ranks_span_hosts(width, env):
        return LOOPBACK
    master = env.get("MASTER_ADDR") or LOOPBACK
    if same_host(master, advertised) and not same_host(advertised, LOOPBACK):
        raise ManagerGateError(
            f"sync_width {width} spans this island's nodes ({env.get('LOCAL_WORLD_SIZE')} ranks on this one), so "
            f"the torchft manager server listens on the island's internal address MASTER_ADDR={master}; "
            f"LOCAL_ADDR={advertised} is the same address, where other islands would reach the island's "
            "own Quorum, ShouldCommit and Kill calls. Set LOCAL_ADDR to this host's address on the network "
            "the other islands use (e.g. its Tailscale IP), not the island's internal one, or keep "
            "fault_tolerance.sync_width <= the ranks per node")
    return master


def _deadline(context: Any) -> float:
    """The caller's time left, capped; grpc reports about 2^63 s when it set none."""
    remaining = context.time_remaining()
    return _FORWARD_S if remaining is None else max(0.0, min(remaining, _FORWARD_S))


class _Calls:
    """The gate's handlers: the healing call forwarded, the service's other calls refused
    (PERMISSION_DENIED); grpc answers UNIMPLEMENTED to any other method, including one a
    later torchft may add."""

    def __init__(self, grpc: Any, forward: Callable[..., bytes]) -> None:
        self._grpc, self._forward = grpc, forward
        self._refused: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        calls = {name: grpc.unary_unary_rpc_method_handler(functools.partial(self._refuse, f"/{SERVICE}/{name}"))
                 for name in _OWN_CALLS}
        calls[HEALING_CALL.rsplit("/", 1)[1]] = grpc.unary_unary_rpc_method_handler(self._heal)
        self.handler = grpc.method_handlers_generic_handler(SERVICE, calls)

    def _heal(self, request: bytes, context: Any) -> bytes:
        try:
            return self._forward(request, timeout=_deadline(context))
        except self._grpc.RpcError as exc:  # the server's own answer (rank not found, ...)
            context.abort(exc.code(), exc.details() or "")
        raise AssertionError("unreachable: abort raises")

    def _refuse(self, method: str, request: bytes, context: Any) -> bytes:
        self._log_refusal(method, grpc_peer_address(context.peer()))
        context.abort(self._grpc.StatusCode.PERMISSION_DENIED,
                      f"{method} is this island's own call: another island may ask only "
                      f"CheckpointMetadata here (archipelago's manager gate)")
        raise AssertionError("unreachable: abort raises")

    def _log_refusal(self, method: str, peer: str) -> None:
        with self._lock:
            first = (method, peer) not in self._refused and len(self._refused) < _MAX_REFUSALS_LOGGED
            if first:
                self._refused.add((method, peer))
        if first:
            log.warning("manager gate: refused %s from %s (only CheckpointMetadata is open to other islands)",
                        method, peer)

    @property
    def refused(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._refused)


class ManagerGate:
    """A gRPC server on `host:port` (0: a free port) that forwards CheckpointMetadata to
    the manager server at `target` (HOST:PORT) and refuses everything else.

    Built, it holds the port (bound, not serving) before the real server exists, so that
    the two cannot end up on different ports; `start(target)` serves."""

    def __init__(self, host: str, port: int) -> None:
        import grpc

        self._grpc, self.host = grpc, host
        self._channel: Any = None
        # No SO_REUSEPORT (grpc's default on Linux): no other process may share this port
        # and take the calls meant for the island.
        options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", _MAX_REQUEST_BYTES)]
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="manager-gate"),
                                   options=options, maximum_concurrent_rpcs=_MAX_CALLS)
        where = f"{url_host(host)}:{port}"
        try:
            self.port = self._server.add_insecure_port(where)
        except RuntimeError:
            self.port = 0
        if not self.port:  # grpc logs why, but raises (or answers 0) without the reason
            raise ManagerGateError(f"the manager gate cannot listen on {where}: the port is in use, or "
                                   f"{host} (LOCAL_ADDR) is not an address of this host")

    def start(self, target: str) -> None:
        self._channel = self._grpc.insecure_channel(target)
        self._calls = _Calls(self._grpc, self._channel.unary_unary(HEALING_CALL))
        self._server.add_generic_rpc_handlers((self._calls.handler,))
        self._server.start()

    @property
    def refused(self) -> list[tuple[str, str]]:
        """The (call, peer address) pairs refused so far (the first few hundred)."""
        return self._calls.refused if self._channel is not None else []

    def address(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def shutdown(self) -> None:
        self._server.stop(grace=0).wait()
        if self._channel is not None:
            self._channel.close()


class GatedManagerServer:
    """What torchft's Manager holds as its ManagerServer: the real one (on `internal`) and
    the gate (on LOCAL_ADDR, or None). `address()` is the internal URL, which torchft hands
    to the island's bridge ranks; the lighthouse advertises the real server's hostname."""

    def __init__(self, server: Any, internal: str, port: int, gate: ManagerGate | None) -> None:
        self.server, self.internal, self.port, self.gate = server, internal, port, gate

    def address(self) -> str:
        return f"http://{url_host(self.internal)}:{self.port}"

    def advertised(self) -> str:
        """The address other islands are given (http://LOCAL_ADDR:PORT)."""
        return str(self.server.address())

    def shutdown(self) -> None:
        if self.gate is not None:
            self.gate.shutdown()
        self.server.shutdown()


def _in_use(exc: BaseException) -> bool:
    text = str(exc)
    return "Address already in use" in text or "os error 98" in text


def gated_manager_server(original: Callable[..., Any], advertised: str) -> Callable[..., GatedManagerServer]:
    """A stand-in for torchft's ManagerServer constructor (`original`), which torchft calls
    with keywords on group rank 0: the real server on the internal address, hostname
    `advertised` (what the lighthouse hands out), and a gate on `advertised` at the same
    port when that is another address."""

    def build(*args: Any, bind: str, world_size: int, hostname: str = "", **kwargs: Any) -> GatedManagerServer:
        # torchft's `hostname` (build_manager passes LOCAL_ADDR) yields to `advertised`: the
        # address the lighthouse hands out and the one the gate listens on are one value.
        internal = internal_host(world_size, advertised)
        wanted = int(bind.rsplit(":", 1)[1])  # torchft's `[::]:PORT`: 0 or $TORCHFT_MANAGER_PORT

        def real(port: int) -> Any:
            return original(*args, bind=f"{url_host(internal)}:{port}", world_size=world_size,
                            hostname=advertised, **kwargs)

        if same_host(advertised, internal):
            server = real(wanted)
            return GatedManagerServer(server, internal, _port(server), None)
        return _build_gated(real, internal, advertised, wanted)

    return build


def _port(server: Any) -> int:
    return int(str(server.address()).rsplit(":", 1)[1])


def _build_gated(real: Callable[[int], Any], internal: str, advertised: str, wanted: int) -> GatedManagerServer:
    """The gate takes the port first (the real server, once up, registers with the
    lighthouse: a failed try must not leave one behind); a free port that is taken on the
    internal address is tried again, a fixed one ($TORCHFT_MANAGER_PORT) is an error."""
    for _ in range(_BIND_TRIES if wanted == 0 else 1):
        gate = ManagerGate(advertised, wanted)
        try:
            server = real(gate.port)
        except RuntimeError as exc:
            gate.shutdown()
            if _in_use(exc):
                continue
            raise
        except BaseException:
            gate.shutdown()
            raise
        gate.start(f"{url_host(internal)}:{gate.port}")
        return GatedManagerServer(server, internal, gate.port, gate)
    where = f"port {wanted} ($TORCHFT_MANAGER_PORT)" if wanted else f"{_BIND_TRIES} free ports of {advertised}"
    raise ManagerGateError(f"the torchft manager server cannot listen on {internal} at {where}: in use there; "
                           "choose another TORCHFT_MANAGER_PORT (or leave it unset), or stop the holder")
