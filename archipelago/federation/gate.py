"""The lighthouse gate: torchft's lighthouse behind a door that only members pass.

torchft's lighthouse admits anyone who reaches it: whoever asks for a quorum is in it,
and can claim any step (a member far ahead becomes every other island's healing source).
With a federation key, `archipelago lighthouse` and `archipelago local` run torchft's
lighthouse on loopback and put this gate on the address the user chose. The gate speaks
the lighthouse's two gRPC calls (`Quorum`, `Heartbeat`), reads the replica id from each
request and forwards the request, byte for byte, only when

- the id is a member id, whole (`trust.verified_member`: `island_N:NONCETAG`, then nothing
  or torchft's `:UUID`), whose token only a holder of the key can make;
- the island proved, before torchft joined, that it holds the key for this token: `Admit`
  (the id) answers a challenge, `Prove` takes an HMAC of token and challenge under the
  island's key (`check_admission` does both). The challenge names the address it was
  asked from, and the token then passes from that address only. A token read off the
  network (or a log) is useless elsewhere; one never proven passes nowhere;
- it is the first full id seen with this token: one token is one member, never more.

Anything else is answered PERMISSION_DENIED and logged once per id (and reason), with the
id cut to `island_N:abcd...` (a token is a credential); past the first
_MAX_REFUSALS_LOGGED ids, refusals are counted and the count logged once a minute
(`RefusalLog`: a caller minting ids cannot flood the log, nor grow the gate's memory). An
outsider therefore never enters a quorum: it cannot be a healing source, take part in an
exchange, or learn the members' addresses.

The gate parses the whole of every request (a protobuf message, by `_fields`) and refuses
one whose replica id (or requester) field occurs more than once: torchft's decoder keeps
the last, and a gate that checked the first would let torchft register another. The bytes
it forwards are torchft's. All loopback addresses count as one address: an island on the
lighthouse's machine may reach it over 127.0.0.1 in one call and ::1 in the next, and
anyone on that machine can use torchft's dashboard on loopback anyway. torchft's
dashboard (and its unauthenticated kill endpoint) stays on the loopback address of the
inner lighthouse. What the gate costs: one Python hop per heartbeat and quorum request, a
few per second per island; memory: at most MAX_TOKENS proven tokens (~200 bytes each) and
_MAX_REFUSALS_LOGGED refused ids (~100 bytes each).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from archipelago.federation.refusal_log import RefusalLog
from archipelago.federation.trust import (
    FederationKey,
    admission_proof,
    is_loopback,
    minted_key,
    redacted,
    verified_member,
)
from archipelago.netutil import grpc_peer_address, url_host

log = logging.getLogger("archipelago.lighthouse")

SERVICE = "torchft.LighthouseService"
GATE_SERVICE = "archipelago.LighthouseGate"
ADMIT = f"/{GATE_SERVICE}/Admit"  # (replica id) -> a challenge, or PERMISSION_DENIED if the id has no valid token
PROVE = f"/{GATE_SERVICE}/Prove"  # (challenge | proof | replica id) -> b"" once the island proved its key
MAX_TOKENS = 65_536  # proven tokens remembered, least recently used out (only key holders make them)
CHALLENGE_TTL_S = 60.0  # a challenge older than this is refused
_CHALLENGE = struct.Struct(">Q32s")  # issue time (ms) | HMAC under the gate's own secret
_PROOF_BYTES = 32
_MAX_REFUSALS_LOGGED = 256  # distinct ids named in the log; more are counted, the count logged once a minute
_WORKERS = 64  # a quorum request waits (long poll) on a worker thread until the quorum forms
_MAX_FIELD_NUMBER = (1 << 29) - 1  # protobuf's largest
_MAX_REQUEST_BYTES = 1 << 16  # torchft's requests take a few hundred bytes; grpc's default allows 4 MiB

NOT_A_MEMBER = ("the replica id carries no valid member token (start the island with the federation's key "
                "file)")
NEVER_PROVEN = ("this member token was never proven to the gate (an island asks, with its key, before torchft "
                "joins: start it with this version of archipelago)")
MALFORMED = "a malformed request, or one with its replica id more than once"


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


# ---- the requests' bytes -------------------------------------------------------------


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            if value >> 64:
                raise ValueError("varint overflows 64 bits")
            return value, at


def _fields(data: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(number, wire type, start, end) of every field of a protobuf message, in order (a
    varint's bytes too), read lazily: a message of many tiny fields costs time, not memory.
    ValueError if the message is malformed, or uses a wire type that torchft's messages
    never use (groups, 3 and 4; 6 and 7 do not exist)."""
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        number, kind = tag >> 3, tag & 7
        if not 1 <= number <= _MAX_FIELD_NUMBER:
            raise ValueError(f"field number {number}")
        start = at
        if kind == 0:
            _, at = _varint(data, at)
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        elif kind == 2:
            size, start = _varint(data, at)
            at = start + size
        else:
            raise ValueError(f"wire type {kind}")
        if at > len(data):
            raise ValueError("truncated field")
        yield number, kind, start, at


def _only(data: bytes, number: int) -> bytes:
    """The bytes of field `number`, which must occur exactly once, length-delimited
    (ValueError otherwise: torchft's decoder keeps the last of repeated strings and merges
    repeated messages, so any repeat could hide the id it registers)."""
    found: tuple[int, int, int] | None = None
    for n, kind, start, end in _fields(data):  # every field: the message must parse to its end
        if n == number:
            if found is not None:
                raise ValueError(f"field {number} occurs more than once")
            found = (kind, start, end)
    if found is None or found[0] != 2:
        raise ValueError(f"field {number} is missing or not length-delimited")
    return data[found[1]:found[2]]


def replica_id(method: str, request: bytes) -> str:
    """The replica id of a serialized `Quorum` (requester = field 1, its replica_id =
    field 1) or `Heartbeat` (replica_id = field 1) request; ValueError (UnicodeDecodeError
    included) if the request is malformed or names an id more than once."""
    raw = _only(_only(request, 1), 1) if method == "Quorum" else _only(request, 1)
    return raw.decode("utf-8")


def peer_host(peer: str) -> str:
    """The address a gRPC peer (`ipv4:10.0.0.1:5000`, `ipv6:%5B::1%5D:5000`) calls from:
    an IP address as text, IPv4 for an IPv4-mapped one, "loopback" for any loopback one."""
    address = grpc_peer_address(peer)
    return "loopback" if is_loopback(address) and address != "localhost" else address


# ---- admissions: who proved which token, from where ---------------------------------


@dataclass
class _Member:
    host: str             # where its proof came from: the only address its calls pass from
    replica_id: str = ""  # the first full id (torchft's `:UUID` added) a call carried


class Admissions:
    """The gate's memory of proven member tokens (thread-safe, at most `capacity`).

    Challenges carry their own issue time and an HMAC under a secret of this gate (made at
    start): checking one needs no state, so asking for challenges costs the gate nothing.
    """

    def __init__(self, key: FederationKey, capacity: int = MAX_TOKENS) -> None:
        self._key, self._capacity = key, capacity
        self._secret = secrets.token_bytes(32)
        self._members: OrderedDict[str, _Member] = OrderedDict()
        self._lock = threading.Lock()

    def challenge(self, token: str, host: str, now: float | None = None) -> bytes:
        """A challenge for `token` asked from `host`."""
        issued = int((time.time() if now is None else now) * 1000)
        return _CHALLENGE.pack(issued, self._sign(issued, token, host))

    def _sign(self, issued: int, token: str, host: str) -> bytes:
        message = b"archipelago challenge\n%d\n%s\n%s" % (issued, token.encode(), host.encode())
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def prove(self, replica_id: str, host: str, challenge: bytes, proof: bytes) -> bool:
        """Record the token of `replica_id` as proven from `host`, if `challenge` is one this
        gate gave for it to `host` within CHALLENGE_TTL_S and `proof` its island's answer."""
        member = verified_member(self._key, replica_id)
        if member is None or len(challenge) != _CHALLENGE.size:
            return False
        island, token = member
        issued, mac = _CHALLENGE.unpack(challenge)
        fresh = 0 <= time.time() * 1000 - issued <= CHALLENGE_TTL_S * 1000
        if not (fresh and hmac.compare_digest(mac, self._sign(issued, token, host))
                and hmac.compare_digest(proof, admission_proof(self._key, island, token, challenge))):
            return False
        with self._lock:
            known = self._members.pop(token, None)
            self._members[token] = _Member(host, known.replica_id if known else "")  # a new proof moves it
            while len(self._members) > self._capacity:
                self._members.popitem(last=False)
        return True

    def refusal(self, replica_id: str, host: str) -> str | None:
        """Why a call with `replica_id` from `host` must not pass; None if it may. The first
        full id a proven token passes with is the only one it passes with from then on."""
        member = verified_member(self._key, replica_id)
        if member is None:
            return NOT_A_MEMBER
        with self._lock:
            known = self._members.get(member[1])
            if known is None:
                return NEVER_PROVEN
            if known.host != host:
                return (f"this member token was proven from {known.host}, not {host} (a copied token, or an island "
                        "that reaches the lighthouse by another address than torchft does: give it the "
                        "lighthouse's IP address)")
            if known.replica_id and known.replica_id != replica_id:
                return (f"this member token already belongs to {redacted(known.replica_id)} (one token, one "
                        "member: a copied token, or a second torchft manager in one island process)")
            known.replica_id = replica_id
            self._members.move_to_end(member[1])
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._members)


def check_admission(url: str, replica_id: str, timeout_s: float, key: FederationKey | None = None) -> bool:
    """Prove to the lighthouse at `url` that this island holds the key of `replica_id`'s member
    token (made by `trust.member_id`, in this process); from then on the gate passes
    torchft's calls with this token from this host. False if the gate refuses the id or
    the proof; True once it took the proof, or if it is torchft's lighthouse without a gate
    (every caller is admitted there) or an older gate that asks for no proof.

    `key`: the island's key; None: the key this process made `replica_id` with, if any.
    torchft itself would only retry a refused quorum request until its quorum timeout.
    """
    import grpc

    target = url.split("://", 1)[-1].rstrip("/")
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        try:
            challenge = channel.unary_unary(ADMIT)(replica_id.encode(), timeout=timeout_s)
            if not challenge:
                return True
            key = key or minted_key(replica_id)
            member = None if key is None else verified_member(key, replica_id)
            if key is None or member is None:
                return False  # a token this process did not make, or not with this key: nothing to prove
            proof = admission_proof(key, member[0], member[1], challenge)
            channel.unary_unary(PROVE)(challenge + proof + replica_id.encode(),
                                       timeout=max(deadline - time.monotonic(), 0.1))
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
        self.admissions = Admissions(key)
        self._refusals = RefusalLog(log, "lighthouse", _MAX_REFUSALS_LOGGED)
        target = "127.0.0.1:" + inner.address().rsplit(":", 1)[1]
        self._channel = grpc.insecure_channel(target)
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._handler(name)) for name in ("Quorum", "Heartbeat")}
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="gate"),
                                   options=[("grpc.max_receive_message_length", _MAX_REQUEST_BYTES)])
        admit = {"Admit": grpc.unary_unary_rpc_method_handler(self._admit),
                 "Prove": grpc.unary_unary_rpc_method_handler(self._prove)}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),
                                               grpc.method_handlers_generic_handler(GATE_SERVICE, admit)))
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

    def _refuse(self, who: str, context: Any, reason: str) -> None:
        self._log_refusal(who, context.peer(), reason)
        context.abort(self._grpc.StatusCode.PERMISSION_DENIED, f"not a member of this federation: {reason}")

    def _admit(self, request: bytes, context: Any) -> bytes:
        """`Admit(replica id)`: a challenge if the id carries a valid token, PERMISSION_DENIED if not."""
        who = request.decode("utf-8", errors="replace")
        member = verified_member(self._key, who)
        if member is None:
            self._refuse(who, context, NOT_A_MEMBER)
            raise AssertionError("unreachable: abort raises")
        return self.admissions.challenge(member[1], peer_host(context.peer()))

    def _prove(self, request: bytes, context: Any) -> bytes:
        """`Prove(challenge | proof | replica id)`: an empty answer once the token is proven
        from the caller's address, PERMISSION_DENIED if the proof does not hold."""
        size = _CHALLENGE.size
        challenge, proof = request[:size], request[size:size + _PROOF_BYTES]
        who = request[size + _PROOF_BYTES:].decode("utf-8", errors="replace")
        host = peer_host(context.peer())
        if not self.admissions.prove(who, host, challenge, proof):
            self._refuse(who, context, "a wrong or stale answer to the gate's challenge (another federation's key?)")
        log.info("lighthouse: %s proved its federation key from %s", redacted(who), host)
        return b""

    def _handler(self, method: str) -> Any:
        forward = self._channel.unary_unary(f"/{SERVICE}/{method}")

        def handle(request: bytes, context: Any) -> bytes:
            try:
                who = replica_id(method, request)
                reason = self.admissions.refusal(who, peer_host(context.peer()))
            except ValueError:  # UnicodeDecodeError included
                who, reason = "", MALFORMED
            if reason is not None:
                self._refuse(who, context, reason)
            try:
                return forward(request, timeout=_deadline(context))
            except self._grpc.RpcError as exc:  # the lighthouse's own answer (a quorum timeout, ...)
                context.abort(exc.code(), exc.details() or "")
            raise AssertionError("unreachable: abort raises")

        return handle

    def _log_refusal(self, who: str, peer: str, reason: str) -> None:
        self._refusals.refused(f"{who}\n{reason}", redacted(who),
                               f"lighthouse: refused an unauthenticated member (replica id {redacted(who)!r}, from "
                               f"{peer}): {reason}; it is kept out of every quorum")

    @property
    def refused(self) -> list[str]:
        """The replica ids refused so far, as logged (`island_N:abcd...`; the first _MAX_REFUSALS_LOGGED)."""
        return self._refusals.named

    def address(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def dashboard(self) -> str:
        """torchft's dashboard, on the inner lighthouse (this machine only)."""
        return "http://127.0.0.1:" + self._inner.address().rsplit(":", 1)[1]

    def shutdown(self) -> None:
        self._server.stop(grace=0).wait()
        self._refusals.flush()
        self._channel.close()
        self._inner.shutdown()
