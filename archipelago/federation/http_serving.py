"""The HTTP serving both healing (transport.py) and carrying (carry_link.py) stand on.

A server that gives a thread only to a connection whose request head (and, where the
server reads small bodies itself, whose body) has arrived (`RequestServer`), and a client
connection whose connect, request, headers and body all end by one deadline
(`DeadlineConnection`). Every byte arriving here is a peer's, and hostile: a request head is
read without blocking and capped; a body either the same way (`max_body`: the dashboard's
pushes), or where a handler reads one (`read_body`: a declared length within the handler's
cap, each read within a short limit and all of it by a deadline: a carrier's rows, which a
thin link sends for minutes).
"""

from __future__ import annotations

import http.client
import io
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from archipelago.netutil import listening_socket

log = logging.getLogger("archipelago.federation")

FRAME_HEADER = "X-Archipelago-Frame"  # a signed request frame, in hex (healing's, a thin island's)

MAX_REQUEST_BYTES = 16 << 10  # a request head: ours are < 1 KiB (a method, a path, a hex frame)
MAX_PENDING = 256  # connections whose request head is still arriving (a descriptor each)
CHUNK = 1 << 20  # bytes per read of an answer without Content-Length, per send of ours
PENDING_BODY_BYTES = 16 << 20  # declared body bytes a server with `max_body` buffers at once (all peers together)


class DeadlineSocket(socket.socket):
    """A connected socket whose every read and write ends by `deadline` (time.monotonic()).

    A per-socket timeout bounds one recv only: a server that sends a byte a second never
    trips it and held a healing island forever. Here each recv and send gets the time left
    of the whole fetch, and none starts after it (one clock read per operation)."""

    deadline = 0.0

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.settimeout(left)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._arm()
        return super().recv(bufsize, flags)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._arm()
        super().sendall(data, flags)


class DeadlineConnection(http.client.HTTPConnection):
    """http.client to one host and port, connect, request, headers and body by `deadline`.

    http.client has no file:, ftp: or data: handler and follows no redirect (urllib's
    urlopen did both); the name lookup of a host name is the one step outside the deadline."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 0.001))
        self._deadline = deadline

    def connect(self) -> None:
        plain = socket.create_connection((self.host, self.port), max(self._deadline - time.monotonic(), 0.001))
        self.sock = DeadlineSocket(fileno=plain.detach())
        self.sock.deadline = self._deadline


@dataclass
class _Pending:
    """A connection whose request is still arriving: by `deadline`, from `address`, the
    bytes so far; `want`, once the head is complete, the bytes of head and body together;
    `body`, the body bytes reserved for it in the server's PENDING_BODY_BYTES."""

    deadline: float
    address: Any
    data: bytearray
    want: int | None = None
    body: int = 0


def _head_end(data: bytearray) -> int:
    """Where the blank line that ends a request head ends in `data`, or -1."""
    ends = [at + len(mark) for mark in (b"\n\r\n", b"\n\n") if (at := data.find(mark)) >= 0]
    return min(ends, default=-1)


class RequestServer:
    """A server's sockets (the healing server's, the carry server's, the dashboard's). One
    thread accepts connections and reads each request head without blocking (at most
    MAX_REQUEST_BYTES, within `request_timeout`), then gives the complete request to a
    handler thread, at most `max_connections` at a time; over that, the connection is
    closed unanswered (the client retries: a member at its next quorum). With `max_body`,
    a body the head declares (Content-Length) of at most that many bytes is read the same
    way, head and body together within `request_timeout`, before a handler is given: a
    peer that sends its body slowly never holds a thread, and the bodies waiting take at
    most PENDING_BODY_BYTES (the oldest waiting one closed for a newer). A longer or
    undeclared body is the handler's to refuse or read (`read_body`). A handler's socket
    then gives each send (and read) `send_timeout`, `request_timeout` unless set.

    http.server's ThreadingHTTPServer (and werkzeug's threaded server, the dashboard's
    before) started a thread per connection and waited for its request without a deadline:
    10,000 idle connections were 10,000 threads, forever. Here an idle or slow-drip
    connection costs a descriptor until its deadline, not a thread; with MAX_PENDING of them
    waiting, the oldest is closed for the newest, so a flood cannot hold a member's request
    (sent at once, read in milliseconds) out for long.
    """

    def __init__(self, host: str, handler: Callable[..., Any], request_timeout: float, max_connections: int,
                 port: int = 0, send_timeout: float | None = None, max_body: int = 0) -> None:
        if max_body > PENDING_BODY_BYTES:
            raise ValueError(f"max_body {max_body}: at most PENDING_BODY_BYTES ({PENDING_BODY_BYTES}); a larger "
                             "body is the handler's to read (read_body)")
        self._listener = listening_socket(host, port)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._handler, self.request_timeout = handler, request_timeout
        self.send_timeout = request_timeout if send_timeout is None else send_timeout
        self.max_body, self._body_bytes = max_body, 0  # the body bytes reserved by pending requests
        self._slots = threading.BoundedSemaphore(max_connections)
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="archipelago-request-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake, selectors.EVENT_READ)
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._until_next_deadline()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake:
                        self._read_head(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        except Exception:  # a bug, not a peer: say so, this island serves no heal from now on
            log.exception("request server: stopped")
        finally:
            for conn in list(self._pending):
                self._drop(conn)
            self._selector.close()
            for sock in (self._listener, self._wake, self._waker):
                sock.close()

    def _until_next_deadline(self) -> float | None:
        if not self._pending:
            return None
        return max(next(iter(self._pending.values())).deadline - time.monotonic(), 0.0)

    def _accept(self) -> None:
        for _ in range(64):  # then the pending heads get their turn
            try:
                conn, address = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of descriptors: make room, or let the backlog wait
                log.debug("request server: accept failed: %s", exc)
                if self._pending:
                    self._drop(next(iter(self._pending)))
                else:
                    time.sleep(0.05)  # the listener stays readable: not a busy loop meanwhile
                return
            conn.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending)))
            self._pending[conn] = _Pending(time.monotonic() + self.request_timeout, address, bytearray())
            self._selector.register(conn, selectors.EVENT_READ)

    def _read_head(self, conn: socket.socket) -> None:
        pending = self._pending.get(conn)
        if pending is None:  # dropped for a newer one earlier in this select's events
            return
        room = (MAX_REQUEST_BYTES + 1 if pending.want is None else pending.want) - len(pending.data)
        try:
            data = conn.recv(room)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        pending.data += data
        if pending.want is None:
            end = _head_end(pending.data)
            if end < 0:
                if len(pending.data) > MAX_REQUEST_BYTES:
                    log.debug("request server: a request head of more than %d bytes from %s", MAX_REQUEST_BYTES,
                              pending.address)
                    self._drop(conn)
                return
            body = self._body_to_read(bytes(pending.data[:end]))
            if body and not self._reserve(conn, body):
                return
            pending.want = end + body
        if len(pending.data) >= pending.want:
            self._selector.unregister(conn)
            self._forget(conn)
            self._dispatch(conn, pending.address, bytes(pending.data))

    def _body_to_read(self, head: bytes) -> int:
        """The body bytes to read here before a handler is given: the declared
        Content-Length when it is within `max_body`, else 0 (the handler refuses or reads
        it). Parsed as the handler will parse it (http.client), so both see one length."""
        if not self.max_body:
            return 0
        try:
            headers = http.client.parse_headers(io.BytesIO(head.split(b"\n", 1)[-1]))
            length = int(headers.get("Content-Length", ""))
        except (http.client.HTTPException, ValueError):
            return 0
        return length if 0 < length <= self.max_body else 0

    def _reserve(self, conn: socket.socket, body: int) -> bool:
        """Room for `body` more bytes among the bodies waiting: the oldest waiting ones are
        closed until it fits (as with heads, the newest is the one most likely to be a
        member's, sent at once). False (and `conn` closed) if even then it does not fit."""
        for other in [c for c, p in self._pending.items() if p.body and c is not conn]:
            if self._body_bytes + body <= PENDING_BODY_BYTES:
                break
            log.debug("request server: bodies waiting from slow senders: closing the oldest, from %s",
                      self._pending[other].address)
            self._drop(other)
        if self._body_bytes + body > PENDING_BODY_BYTES:  # only with max_body > PENDING_BODY_BYTES
            self._drop(conn)
            return False
        self._pending[conn].body = body
        self._body_bytes += body
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            conn, pending = next(iter(self._pending.items()))
            if pending.deadline > now:
                return
            log.debug("request server: no whole request from %s within %.0f s", pending.address,
                      self.request_timeout)
            self._drop(conn)

    def _forget(self, conn: socket.socket) -> None:
        pending = self._pending.pop(conn, None)
        if pending is not None:
            self._body_bytes -= pending.body

    def _drop(self, conn: socket.socket) -> None:
        self._forget(conn)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _dispatch(self, conn: socket.socket, address: Any, head: bytes) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("request server: all handlers busy, closing a request from %s", address)
            conn.close()
            return
        try:
            threading.Thread(target=self._handle, args=(conn, address, head), name="archipelago-request",
                             daemon=True).start()
        except RuntimeError:  # no thread to be had: as if all were busy
            self._slots.release()
            conn.close()

    def _handle(self, conn: socket.socket, address: Any, head: bytes) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(self.send_timeout)  # each send of the answer (a chunk) within it
            self._handler((conn, head), address, self)
        except Exception as exc:  # noqa: BLE001 - a peer that went away, or stopped reading
            log.debug("request server: the request from %s ended early: %s", address, exc)
        finally:
            try:
                conn.shutdown(socket.SHUT_WR)  # the answer's end, before the close
            except OSError:
                pass
            conn.close()
            self._slots.release()

    def close(self, wait: bool = True) -> None:
        self._stopping = True
        try:
            self._waker.send(b"x")
        except OSError:  # the loop has closed it: it is stopped
            pass
        if wait:
            self._thread.join()


def read_body(conn: socket.socket, started: bytes, length: int, deadline: float,
              chunk_timeout: float | None = None) -> bytes:
    """A request body of `length` bytes (its declared Content-Length, already checked
    against the handler's cap): the `started` bytes that came with the head, then the rest
    from `conn`, all of it by `deadline` (time.monotonic(); TimeoutError after it), and with
    `chunk_timeout` each read within that many seconds: a peer that stops sending frees its
    handler after `chunk_timeout`, one that sends a byte now and then at the deadline."""
    body = bytearray(started[:length])
    while len(body) < length:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request body did not arrive by its deadline")
        conn.settimeout(left if chunk_timeout is None else min(left, chunk_timeout))
        chunk = conn.recv(min(CHUNK, length - len(body)))
        if not chunk:
            raise ConnectionError(f"the request body ended after {len(body)} of {length} bytes")
        body += chunk
    return bytes(body)


class HeadHandler(BaseHTTPRequestHandler):
    """http.server's handler for a request whose head RequestServer has read: parsed from
    memory (`rfile` then holds whatever of a body came with the head; nothing more is read
    unless the handler asks, `read_body`), answered a MiB per send (`reply`)."""

    server_name = "request server"  # in debug logs

    def setup(self) -> None:
        self.connection, head = self.request
        self.rfile = io.BytesIO(head)
        self.wfile = self.connection.makefile("wb")

    def reply(self, status: int, body: bytes, content_type: str = "application/octet-stream") -> None:
        """Answer `status` with `body`, each MiB of it within the socket's timeout (sendall's
        is for the whole call): a peer that stops reading frees its handler."""
        self.reply_parts(status, (body,), content_type)

    def reply_parts(self, status: int, parts: Sequence[bytes | memoryview],
                    content_type: str = "application/octet-stream") -> None:
        """`reply` with a body that is `parts` one after another, sent as they are: a signed
        frame goes as its header, the served state and its tag, never joined (joining is a
        copy of the whole state per request)."""
        views = [memoryview(part).cast("B") for part in parts]
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(sum(len(view) for view in views)))
        self.end_headers()
        self.wfile.flush()
        for view in views:
            for start in range(0, len(view), CHUNK):
                self.connection.sendall(view[start:start + CHUNK])

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        log.debug(f"{self.server_name}: " + format, *args)
