"""The lighthouse gate: torchft's lighthouse behind a door that only members pass.

torchft's lighthouse admits anyone who reaches it: whoever asks for a quorum is in it,
and can claim any step (a member far ahead becomes every other island's healing source).
With a federation key, `archipelago lighthouse` and `archipelago local` run torchft's
lighthouse on loopback and put this gate on the address the user chose. The gate speaks
the lighthouse's two gRPC calls (`Quorum`, `Heartbeat`), reads the replica id from each
request and forwards the request, byte for byte, only when the id carries a valid member
token (`trust.member_id`); anything else is answered PERMISSION_DENIED and logged once per
id. An outsider therefore never enters a quorum: it cannot be a healing source, take
part in an exchange, or learn the members' addresses.

The gate parses nothing but the replica id (a protobuf string at a fixed field number, read
by `_field`); the bytes it forwards are torchft's. torchft's dashboard (and its
unauthenticated kill endpoint) stays on the loopback address of the inner lighthouse.
What the gate costs: one Python hop per heartbeat and quorum request, a few per second per
island.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent import futures
from typing import Any

from archipelago.federation.trust import FederationKey, check_member_id
from archipelago.netutil import url_host

log = logging.getLogger("archipelago.lighthouse")

SERVICE = "torchft.LighthouseService"
ADMIT = "/archipelago.LighthouseGate/Admit"  # an island asks, before torchft joins, whether its id passes
_MAX_REFUSALS_LOGGED = 256  # distinct ids named in the log; more are counted only
_WORKERS = 64  # a quorum request waits (long poll) on a worker thread until the quorum forms


class GateError(RuntimeError):
    """The gate could not listen where it was told."""


def _probe(host: str, port: int) -> None:
    """Raise GateError with the operating system's reason if `host:port` cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            probe.bind((host, port))
    except OSError as exc:
        raise GateError(exc.strerror or str(exc)) from None


def _deadline(context: Any) -> float | None:
    """The caller's time left, for the forwarded call; None when it set no deadline (grpc
    then reports about 2^63 seconds, which overflows into an instant DEADLINE_EXCEEDED)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e6 else max(remaining, 0.0)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _field(data: bytes, number: int) -> bytes:
    """The bytes of the first length-delimited field `number` of a protobuf message
    (ValueError if the message is malformed or has none)."""
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        kind = tag & 7
        if kind == 0:
            _, at = _varint(data, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == 2:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise ValueError("truncated field")
            if tag >> 3 == number:
                return data[at:at + size]
            at += size
        else:
            raise ValueError(f"wire type {kind}")
    raise ValueError(f"no field {number}")


def replica_id(method: str, request: bytes) -> str:
    """The replica id of a serialized `Quorum` (requester = field 1, its replica_id =
    field 1) or `Heartbeat` (replica_id = field 1) request."""
    raw = _field(_field(request, 1), 1) if method == "Quorum" else _field(request, 1)
    return raw.decode("utf-8")


def check_admission(url: str, replica_id: str, timeout_s: float) -> bool:
    """False if the lighthouse at `url` is a gate that would refuse `replica_id`; True if it
    admits it or is torchft's lighthouse without a gate (every caller is admitted there).
    torchft itself would only retry a refused quorum request until its quorum timeout."""
    import grpc

    target = url.split("://", 1)[-1].rstrip("/")
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(ADMIT)(replica_id.encode(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc.code() != grpc.StatusCode.PERMISSION_DENIED  # UNIMPLEMENTED: no gate
    return True


class LighthouseGate:
    """A gRPC server on `host:port` that forwards members' calls to the lighthouse at
    `inner` (HOST:PORT, on loopback) and refuses everyone else's."""

    def __init__(self, inner: Any, host: str, port: int, key: FederationKey) -> None:
        import grpc

        _probe(host, port)  # grpc logs why a bind failed but raises without the reason
        self._grpc, self._inner, self._key = grpc, inner, key
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        target = "127.0.0.1:" + inner.address().rsplit(":", 1)[1]
        self._channel = grpc.insecure_channel(target)
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._handler(name)) for name in ("Quorum", "Heartbeat")}
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="gate"))
        admit = {"Admit": grpc.unary_unary_rpc_method_handler(self._admit)}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),
                                               grpc.method_handlers_generic_handler(ADMIT.split("/")[1], admit)))
        where = f"{url_host(host)}:{port}"
        try:
            self.port = self._server.add_insecure_port(where)
        except RuntimeError as exc:
            self._channel.close()
            raise GateError(f"cannot listen on {where}: {exc}") from None
        if not self.port:  # older grpcio answers 0 instead of raising
            self._channel.close()
            raise GateError(f"cannot listen on {where}: the address is in use or not this machine's")
        self.host = host
        self._server.start()

    def _refuse(self, who: str, context: Any) -> None:
        self._log_refusal(who, context.peer())
        context.abort(self._grpc.StatusCode.PERMISSION_DENIED,
                      "not a member of this federation: the replica id carries no valid member token "
                      "(start the island with the federation's key file)")

    def _admit(self, request: bytes, context: Any) -> bytes:
        """`Admit(replica id)`: an empty answer if the id would pass, PERMISSION_DENIED if not."""
        who = request.decode("utf-8", errors="replace")
        if check_member_id(self._key, who) is None:
            self._refuse(who, context)
        return b""

    def _handler(self, method: str) -> Any:
        forward = self._channel.unary_unary(f"/{SERVICE}/{method}")

        def handle(request: bytes, context: Any) -> bytes:
            try:
                who = replica_id(method, request)
            except (ValueError, UnicodeDecodeError):
                who = ""
            if not who or check_member_id(self._key, who) is None:
                self._refuse(who, context)
            try:
                return forward(request, timeout=_deadline(context))
            except self._grpc.RpcError as exc:  # the lighthouse's own answer (a quorum timeout, ...)
                context.abort(exc.code(), exc.details() or "")
            raise AssertionError("unreachable: abort raises")

        return handle

    def _log_refusal(self, who: str, peer: str) -> None:
        with self._lock:
            first = who not in self._refused
            if first and len(self._refused) < _MAX_REFUSALS_LOGGED:
                self._refused.add(who)
        if first:
            log.warning("lighthouse: refused an unauthenticated member (replica id %r, from %s): no valid member "
                        "token for this federation's key; it is kept out of every quorum", who[:80], peer)

    @property
    def refused(self) -> list[str]:
        """The replica ids refused so far (up to the first few hundred)."""
        with self._lock:
            return sorted(self._refused)

    def address(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def dashboard(self) -> str:
        """torchft's dashboard, on the inner lighthouse (this machine only)."""
        return "http://127.0.0.1:" + self._inner.address().rsplit(":", 1)[1]

    def shutdown(self) -> None:
        self._server.stop(grace=0).wait()
        self._channel.close()
        self._inner.shutdown()
