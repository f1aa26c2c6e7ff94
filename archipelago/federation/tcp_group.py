"""The cross-island process group over TCP that no peer can make abort this process.

gloo's TCP transport checks the size of every message against the receive the process
posted, and a message larger than that throws inside gloo's own I/O thread: the process
aborts (SIGABRT, exit 134), and nothing in Python can catch it. Any member of a federation
could end every honest island that way, at any collective, by sending a few more bytes
than its peers expect. So the collectives between islands (all-gather and all-to-all,
the only two the exchange uses) run here instead, over plain sockets, with every length
set by the receiver:

    message = header (magic b"ARW1", sequence number u64, kind u8, bytes u64) | payload

Each peer gets one connection. Its reader reads a fixed 21-byte header and then only
what the collective it belongs to posted for that peer: a header with another magic,
sequence number, kind or length is refused (the collective fails with an error that names
the peer and both sizes, that peer's connection is closed), and nothing is ever allocated
from a peer's number. A peer that stalls is held by the collective's deadline
(`process_group_timeout_ms`), one that floods by TCP's own flow control: the reader reads
no payload before its collective is posted.

The connections meet through the quorum's store, as torchft's own groups do: each member
writes where it listens (LOCAL_ADDR, else loopback) and the higher rank of each pair
connects to the lower. With a federation key both ends prove it on every connection (a
challenge from the listener, an HMAC over both nonces, the store prefix and both ranks
under a key derived for this purpose), so an outsider who writes another address into
the store, which it can reach, only fails the quorum; it never joins the group. The
listener closes once the group is complete.

What it costs: one reader and one writer thread per peer, payloads read and written in
place (`recv_into` and `sendall` on the tensors' own memory: no copy), and Python's
per-call overhead, which is small beside a row (bench/federation.py measures the rounds).
CPU tensors only: an NCCL island keeps NCCL (its process_group), whose peers could abort
it in other ways (docs/federation.md, "Security").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions
from torchft.process_group import ProcessGroup, create_store_client

from archipelago.federation.trust import FederationKey
from archipelago.netutil import listening_socket, local_address, url_host

log = logging.getLogger("archipelago.federation")

MAGIC = b"ARW1"
_HEADER = struct.Struct(">4sQBQ")           # magic, sequence number, kind, payload bytes
_CHALLENGE = struct.Struct(">4s16s")        # the listener's fresh nonce
_HELLO = struct.Struct(">4s32sIII16s32s")   # store prefix digest, from, to, world size, nonce, tag
_ACK = struct.Struct(">4s32s")              # the listener's tag over both nonces
ALLGATHER, ALLTOALL = 1, 2
HANDSHAKE_S = 10.0      # the most a connection may take to prove itself
MAX_HANDSHAKES = 64     # connections proving themselves at once; more are closed at once
BACKEND = "archipelago-tcp"


class PeerRefused(ConnectionError):
    """A peer sent what this island did not post, or broke the protocol: its connection is closed."""


@dataclass
class _Op:
    """One collective in flight: done when every send and every receive of it is."""

    seq: int
    parts: int
    deadline: float
    future: torch.futures.Future = field(default_factory=torch.futures.Future)
    value: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed: bool = False

    def part_done(self) -> None:
        with self.lock:
            self.parts -= 1
            done = self.parts == 0 and not self.failed
        if done:
            self.future.set_result(self.value)

    def fail(self, error: Exception) -> None:
        with self.lock:
            if self.failed or self.future.done():
                return
            self.failed = True
        self.future.set_exception(error)


class _Work(torch.distributed.distributed_c10d.Work):
    """What torchft's `_ManagedWork` waits on: the collective's future."""

    def __init__(self, op: _Op) -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._op.future.wait()  # raises the collective's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._op.future


class _Chained(torch.distributed.distributed_c10d.Work):
    """A collective followed by local work on its result (the sum of an all-reduce)."""

    def __init__(self, first: _Work, future: torch.futures.Future) -> None:
        super().__init__()
        self._first, self._future = first, future

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place (what is received lands in the tensor)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"the tcp process group carries host tensors only, not {tensor.device}; "
                         "a GPU island's cross-island group is NCCL (fault_tolerance.process_group = \"nccl\")")
    if not tensor.is_contiguous():
        raise ValueError("the tcp process group needs contiguous tensors")
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


class _Peer:
    """One connection: a writer that sends queued messages in order, a reader that fills
    the receives posted for this peer in sequence order, checking each header first."""

    def __init__(self, group: _Mesh, rank: int, sock: socket.socket) -> None:
        self.group, self.rank, self.sock = group, rank, sock
        self.outbox: queue.Queue[tuple[_Op, int, memoryview] | None] = queue.Queue()
        self.posted: dict[int, tuple[_Op, int, memoryview]] = {}
        self.expected = 0  # the sequence number of the next message this peer must send
        self.cond = threading.Condition()
        self.closed = False
        self.threads = [threading.Thread(target=self._write, name=f"archipelago-tcp-send-{rank}", daemon=True),
                        threading.Thread(target=self._read, name=f"archipelago-tcp-recv-{rank}", daemon=True)]
        for thread in self.threads:
            thread.start()

    def post(self, op: _Op, kind: int, into: memoryview) -> None:
        with self.cond:
            self.posted[op.seq] = (op, kind, into)
            self.cond.notify_all()

    def send(self, op: _Op, kind: int, data: memoryview) -> None:
        self.outbox.put((op, kind, data))

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _write(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            op, kind, data = item
            try:
                self.sock.sendall(_HEADER.pack(MAGIC, op.seq, kind, len(data)))
                if len(data):
                    self.sock.sendall(data)
            except OSError as exc:
                self.group.peer_failed(self, ConnectionError(f"sending to the member at replica rank {self.rank} "
                                                             f"failed: {exc}"))
                return
            op.part_done()

    def _read(self) -> None:
        try:
            while True:
                head = self._exact(_HEADER.size)
                if head is None:
                    return
                magic, seq, kind, size = _HEADER.unpack(head)
                op, want_kind, into = self._posted(seq)
                if op is None:
                    return
                self._check(magic, seq, kind, size, want_kind, len(into))
                if size and not self._fill(into):
                    return
                op.part_done()
        except PeerRefused as exc:
            log.error("%s", exc)
            self.group.peer_failed(self, exc)
        except OSError as exc:
            self.group.peer_failed(self, ConnectionError(f"the connection to the member at replica rank {self.rank} "
                                                         f"failed: {exc}"))

    def _posted(self, seq: int) -> tuple[_Op | None, int, memoryview]:
        """The receive posted for message `seq` (waits for it: TCP holds the peer back meanwhile)."""
        with self.cond:
            if seq != self.expected:
                raise PeerRefused(f"the member at replica rank {self.rank} sent message {seq} where message "
                                  f"{self.expected} was due: refused, its connection closed")
            self.cond.wait_for(lambda: self.closed or seq in self.posted)
            if self.closed:
                return None, 0, memoryview(b"")
            self.expected += 1
            return self.posted.pop(seq)

    def _check(self, magic: bytes, seq: int, kind: int, size: int, want_kind: int, want: int) -> None:
        if magic != MAGIC:
            raise PeerRefused(f"the member at replica rank {self.rank} sent a message that is not of this "
                              "transport: refused, its connection closed")
        if kind != want_kind or size != want:
            raise PeerRefused(f"the member at replica rank {self.rank} announced {size} bytes for collective "
                              f"{seq} (kind {kind}) where this island posted {want} (kind {want_kind}): refused "
                              "before any of it was read, its connection closed")

    def _exact(self, size: int) -> bytes | None:
        data = bytearray(size)
        return bytes(data) if self._fill(memoryview(data)) else None

    def _fill(self, into: memoryview) -> bool:
        """Read exactly len(into) bytes into `into`; False when the connection closed first."""
        got = 0
        while got < len(into):
            n = self.sock.recv_into(into[got:])
            if n == 0:
                if not self.closed:
                    self.group.peer_failed(self, ConnectionError(f"the member at replica rank {self.rank} closed "
                                                                 "its connection"))
                return False
            got += n
        return True


class _Mesh:
    """The connections of one configured group (one quorum), and its collectives in flight."""

    def __init__(self, rank: int, world: int, timeout: float) -> None:
        self.rank, self.world, self.timeout = rank, world, timeout
        self.peers: dict[int, _Peer] = {}
        self.seq = 0
        self.lock = threading.Lock()
        self.ops: dict[int, _Op] = {}
        self.error: Exception | None = None
        self.closed = False
        self.watchdog = threading.Thread(target=self._watch, name="archipelago-tcp-deadlines", daemon=True)

    def start(self) -> None:
        self.watchdog.start()

    def begin(self, parts: int, value: Any) -> _Op:
        with self.lock:
            if self.closed or self.error is not None:
                raise ConnectionError(f"the cross-island group failed before: {self.error or 'aborted'}")
            op = _Op(self.seq, parts, time.monotonic() + self.timeout, value=value)
            self.seq += 1
            if parts:
                self.ops[op.seq] = op
                op.future.add_done_callback(lambda _, seq=op.seq: self._forget(seq))  # type: ignore[misc]
        if not parts:
            op.future.set_result(value)
        return op

    def _forget(self, seq: int) -> None:
        with self.lock:
            self.ops.pop(seq, None)

    def peer_failed(self, peer: _Peer, error: Exception) -> None:
        """A peer broke the protocol or went away: every collective in flight fails (the
        members' sequence numbers no longer match), and the group stays failed until torchft
        configures the next one."""
        with self.lock:
            if self.error is None and not self.closed:
                self.error = error
            pending = list(self.ops.values())
        for op in pending:
            op.fail(error)
        self.close()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            pending = list(self.ops.values())
        for peer in self.peers.values():
            peer.close()
        for op in pending:
            op.fail(self.error or ConnectionError("the cross-island group was aborted"))
        current = threading.current_thread()
        for peer in self.peers.values():  # after this, nothing writes into a posted tensor
            for thread in peer.threads:
                if thread is not current:
                    thread.join(timeout=5.0)

    def _watch(self) -> None:
        while not self.closed:
            time.sleep(0.05)
            now = time.monotonic()
            with self.lock:
                late = [op for op in self.ops.values() if op.deadline < now]
            if late:
                error = TimeoutError(f"a cross-island collective did not complete within {self.timeout:g} s "
                                     "(fault_tolerance.process_group_timeout_ms): a member is gone or stalls")
                with self.lock:
                    self.error = self.error or error
                self.close()
                return


class CheckedTCPGroup(ProcessGroup):
    """torchft's reconfigurable process group, between the members of each quorum, over
    length-checked TCP (module doc). `host` is where it listens (LOCAL_ADDR, else loopback);
    `key` makes every connection prove the federation key."""

    def __init__(self, timeout: timedelta | float = 60.0, key: FederationKey | None = None,
                 host: str | None = None) -> None:
        super().__init__(0, 1)
        self._timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self._key, self._host = key, host
        self._mesh: _Mesh | None = None
        self._world = 1

    # ---- torchft's ProcessGroup --------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
        self.abort()
        self._world = world_size
        mesh = _Mesh(rank, world_size, self._timeout)
        try:
            _connect_mesh(mesh, store_addr, self._timeout, self._key, self._host or local_address())
        except BaseException:
            mesh.close()
            raise
        mesh.start()
        self._mesh = mesh

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor],
                  opts: AllgatherOptions | None = None) -> _Work:
        """Every member's `input_tensor[0]` into `output_tensors[0][member]` (all of one size)."""
        mesh = self._live()
        outputs, payload = output_tensors[0], input_tensor[0]
        if len(outputs) != mesh.world:
            raise ValueError(f"allgather into {len(outputs)} tensors in a group of {mesh.world}")
        data = _byte_view(payload.contiguous())
        views = [_byte_view(out) for out in outputs]
        op = mesh.begin(2 * (mesh.world - 1), output_tensors)
        for member, peer in mesh.peers.items():
            peer.post(op, ALLGATHER, views[member])
        outputs[mesh.rank].copy_(payload)
        for peer in mesh.peers.values():
            peer.send(op, ALLGATHER, data)
        return _Work(op)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Chained:
        """The sum of every member's `tensors[0]` into it (torchft's Manager.allreduce asks
        for SUM, and divides for an average): an all-gather, then the sum in replica order,
        the same on every member. The exchange never calls it (its rows are judged one by
        one); torchft's own users of the manager may."""
        op = getattr(opts, "reduceOp", opts)
        if op is not None and op != torch.distributed.ReduceOp.SUM:
            raise ValueError(f"the tcp process group sums only, not {op}")
        tensor = tensors[0]
        rows = [torch.empty_like(tensor) for _ in range(self._live().world)]
        gathered = self.allgather([rows], [tensor])

        def summed(_: Any) -> list[torch.Tensor]:
            total = rows[0].clone()
            for row in rows[1:]:
                total += row
            tensor.copy_(total)
            return tensors

        return _Chained(gathered, gathered.get_future().then(summed))

    def allgather_each(self, outputs: list[torch.Tensor], own: torch.Tensor,
                       rows: dict[int, torch.Tensor]) -> _Work:
        """An all-gather in which member k gets `rows[k]` instead of one row for all: what a
        dishonest member can send (the `equivocate` drill, guard.Poison). Honest code never
        calls it; receivers cannot tell it from an all-gather, which is the point."""
        mesh = self._live()
        views = [_byte_view(out) for out in outputs]
        op = mesh.begin(2 * (mesh.world - 1), [outputs])
        for member, peer in mesh.peers.items():
            peer.post(op, ALLGATHER, views[member])
        outputs[mesh.rank].copy_(own)
        for member, peer in mesh.peers.items():
            peer.send(op, ALLGATHER, _byte_view(rows[member].contiguous()))
        return _Work(op)

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: AllToAllOptions | None = None) -> _Work:
        """Rows of `input_buffer` to each member by `input_split_sizes` (equal when empty),
        theirs into `output_buffer` by `output_split_sizes`, as torch's all_to_all_single."""
        mesh = self._live()
        sends = _pieces(input_buffer, input_split_sizes, mesh.world)
        receives = _pieces(output_buffer, output_split_sizes, mesh.world)
        op = mesh.begin(2 * (mesh.world - 1), output_buffer)
        for member, peer in mesh.peers.items():
            peer.post(op, ALLTOALL, receives[member])
        receives[mesh.rank][:] = sends[mesh.rank]
        for member, peer in mesh.peers.items():
            peer.send(op, ALLTOALL, sends[member])
        return _Work(op)

    def abort(self) -> None:
        if self._mesh is not None:
            self._mesh.close()
            self._mesh = None

    def shutdown(self) -> None:
        self.abort()

    def errored(self) -> Exception | None:
        return self._mesh.error if self._mesh is not None else None

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def _live(self) -> _Mesh:
        if self._mesh is None:
            raise ConnectionError("the cross-island group is not configured (no quorum yet, or it was aborted)")
        return self._mesh


def _pieces(buffer: torch.Tensor, splits: list[int], world: int) -> list[memoryview]:
    """`buffer`'s bytes cut into one piece per member along its first dimension."""
    rows = buffer.shape[0] if buffer.dim() else buffer.numel()
    if not splits:
        if rows % world:
            raise ValueError(f"an all-to-all of {rows} rows does not split evenly over {world} members")
        splits = [rows // world] * world
    if len(splits) != world or sum(splits) != rows:
        raise ValueError(f"all-to-all splits {splits} do not cover {rows} rows of {world} members")
    whole = _byte_view(buffer)
    row_bytes = len(whole) // rows if rows else 0
    pieces, start = [], 0
    for count in splits:
        pieces.append(whole[start:start + count * row_bytes])
        start += count * row_bytes
    return pieces


# ---- meeting through the store ------------------------------------------------------


def _mesh_key(key: FederationKey | None) -> bytes | None:
    return None if key is None else key.purpose_key(b"archipelago cross-island connections")


def _tag(secret: bytes | None, *parts: bytes) -> bytes:
    if secret is None:
        return b"\x00" * 32
    return hmac.new(secret, b"\n".join(parts), hashlib.sha256).digest()


def _connect_mesh(mesh: _Mesh, store_addr: str, timeout: float, key: FederationKey | None, host: str) -> None:
    """Connect `mesh` to every other member of the group at `store_addr`, each connection
    proven both ways (module doc); raises when that does not finish within `timeout`."""
    if mesh.world < 2:
        return
    secret = _mesh_key(key)
    prefix = hashlib.sha256(store_addr.encode()).digest()
    store = create_store_client(store_addr, timeout=timedelta(seconds=timeout))
    deadline = time.monotonic() + timeout
    listener = listening_socket(host) if mesh.rank < mesh.world - 1 else None
    try:
        if listener is not None:
            port = listener.getsockname()[1]
            store.set(f"archipelago/tcp/{mesh.rank}", f"{url_host(host)}:{port}")
            accepting = threading.Thread(target=_accept_all, args=(mesh, listener, prefix, secret, deadline),
                                         name="archipelago-tcp-accept", daemon=True)
            accepting.start()
        for lower in range(mesh.rank):
            address = store.get(f"archipelago/tcp/{lower}").decode()
            mesh.peers[lower] = _Peer(mesh, lower, _dial(address, mesh, lower, prefix, secret, deadline))
        if listener is not None:
            accepting.join(max(deadline - time.monotonic(), 0.0))
        missing = [r for r in range(mesh.world) if r != mesh.rank and r not in mesh.peers]
        if missing:
            raise TimeoutError(f"the cross-island group of {mesh.world} did not connect within {timeout:g} s: no "
                               f"proven connection from replica rank(s) {missing}")
    finally:
        if listener is not None:
            listener.close()


def _dial(address: str, mesh: _Mesh, lower: int, prefix: bytes, secret: bytes | None,
          deadline: float) -> socket.socket:
    """Connect to the member at `lower` and prove the key both ways."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=max(deadline - time.monotonic(), 0.1))
    try:
        sock.settimeout(min(HANDSHAKE_S, max(deadline - time.monotonic(), 0.1)))
        magic, challenge = _CHALLENGE.unpack(_recv_exact(sock, _CHALLENGE.size))
        mine = secrets.token_bytes(16)
        ranks = struct.pack(">III", mesh.rank, lower, mesh.world)
        sock.sendall(_HELLO.pack(MAGIC, prefix, mesh.rank, lower, mesh.world, mine,
                                 _tag(secret, b"hello", prefix, ranks, challenge, mine)))
        magic2, tag = _ACK.unpack(_recv_exact(sock, _ACK.size))
        if magic != MAGIC or magic2 != MAGIC or not hmac.compare_digest(
                tag, _tag(secret, b"ack", prefix, ranks, challenge, mine)):
            raise PeerRefused(f"the member at {address} (replica rank {lower}) did not prove the federation key: "
                              "another key, or not a member (the quorum's store may hold a forged address)")
        _ready(sock)
        return sock
    except BaseException:
        sock.close()
        raise


def _accept_all(mesh: _Mesh, listener: socket.socket, prefix: bytes, secret: bytes | None, deadline: float) -> None:
    """Take proven connections from every higher rank; anything else is closed."""
    expected = set(range(mesh.rank + 1, mesh.world))
    lock, proving = threading.Lock(), threading.BoundedSemaphore(MAX_HANDSHAKES)
    listener.settimeout(0.2)
    while time.monotonic() < deadline:
        with lock:
            if expected <= set(mesh.peers):
                return
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        if not proving.acquire(blocking=False):
            sock.close()
            continue
        threading.Thread(target=_prove, args=(mesh, sock, prefix, secret, deadline, expected, lock, proving),
                         name="archipelago-tcp-prove", daemon=True).start()


def _prove(mesh: _Mesh, sock: socket.socket, prefix: bytes, secret: bytes | None, deadline: float,
           expected: set[int], lock: threading.Lock, proving: threading.BoundedSemaphore) -> None:
    try:
        sock.settimeout(min(HANDSHAKE_S, max(deadline - time.monotonic(), 0.1)))
        challenge = secrets.token_bytes(16)
        sock.sendall(_CHALLENGE.pack(MAGIC, challenge))
        magic, their_prefix, sender, to, world, nonce, tag = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
        ranks = struct.pack(">III", sender, to, world)
        if (magic != MAGIC or their_prefix != prefix or to != mesh.rank or world != mesh.world
                or not hmac.compare_digest(tag, _tag(secret, b"hello", prefix, ranks, challenge, nonce))):
            raise PeerRefused("a connection that did not prove the federation key for this group")
        with lock:
            if sender not in expected or sender in mesh.peers:
                raise PeerRefused(f"a second connection claiming replica rank {sender}")
            sock.sendall(_ACK.pack(MAGIC, _tag(secret, b"ack", prefix, ranks, challenge, nonce)))
            _ready(sock)
            mesh.peers[sender] = _Peer(mesh, sender, sock)
    except (OSError, PeerRefused, struct.error) as exc:
        log.warning("cross-island group: refused a connection: %s", exc)
        sock.close()
    finally:
        proving.release()


def _ready(sock: socket.socket) -> None:
    sock.settimeout(None)  # collectives keep their own deadlines (the mesh's watchdog)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the connection closed during the handshake")
        got += n
    return bytes(data)
