"""Healing without pickle: the global state a joining island fetches from a peer.

torchft's own HTTP transport sends the state with `torch.save` and loads it with
`torch.load(weights_only=False)`: any peer (or anyone who can answer on its port) could
run code on the island that heals from it. This transport sends the same state in a
format that cannot execute anything (federation/state_format.py: a JSON skeleton and a
safetensors body, every structural assumption checked). The receiver
(`Healing.load`, federation/healing.py) then checks names, shapes, dtypes and finiteness against its
own state before applying anything.

With a federation key (federation/trust.py) both ways are signed frames: the request
carries a HEAL_REQUEST frame of the healing island with a fresh nonce; the answer is a
HEAL_STATE frame of the serving island whose quorum field carries that nonce, so neither
an outsider's request nor a recorded answer is accepted. Without a key anyone who
reaches the port can fetch the state.

The server binds LOCAL_ADDR when set, else loopback: a federation across machines sets
LOCAL_ADDR to the address its peers reach it at (docs/federation.md).

Every byte of a peer is hostile, the URL it advertises included. The healing island
fetches only `http://HOST:PORT/checkpoint/` (no file:, ftp: or data: handler is
reachable: http.client, not urllib), from the host of the member the quorum named when
the caller says which (`expect_source`), never through a redirect, at most a cap of
bytes (`max_state_bytes`, `expect_state_like`) checked against Content-Length before the
body is read, and all of it (connect, headers, body) within the `timeout` of
`recv_checkpoint`; only then is the signature checked and the state decoded. The
server gives a thread only to a connection whose request head has arrived (within
`request_timeout`), at most `max_connections` at a time (`http_serving.RequestServer`),
and sends a signed answer as its frame header, the served state in place and the tag: no
copy of the state per request (`_signed`).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import logging
import os
import secrets
import threading
import time
import urllib.parse
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

from torchft.checkpointing.transport import CheckpointTransport

from archipelago.federation.http_serving import CHUNK, FRAME_HEADER, DeadlineConnection, HeadHandler, RequestServer
from archipelago.federation.state_format import (
    StateFormatError,
    decode_state,
    encode_state,
    encoded_size,
)
from archipelago.federation.trust import (
    _HEADER,
    HEAL_REQUEST,
    HEAL_STATE,
    MAGIC,
    FederationKey,
    FrameHeader,
    FrameRefused,
    open_frame,
    seal,
)
from archipelago.netutil import local_address, url_host

log = logging.getLogger("archipelago.federation")

_MAX_NONCES = 4096  # nonces remembered against replayed requests
HEAL_PATH = "/checkpoint/"  # what `SafeHTTPTransport.address()` advertises after HOST:PORT


class HealingRefused(ValueError):
    """A peer's healing source or answer this island does not fetch or read: a URL that is
    not a healing server of the quorum's member, a redirect, an answer over the size cap or
    past the deadline. Nothing of it is applied."""


# ---- the healing client: what it fetches, how much, how long ----------------------------


def heal_cap(state_bytes: int) -> int:
    """The most bytes a healing answer may have when this island's own state takes
    `state_bytes`: a peer of the same federation sends the same tensors, but its strings
    (fingerprint, names) and the signed frame around them may be a little longer."""
    return int(state_bytes * 1.25) + (1 << 20)


def _memory_cap() -> int:
    """The cap when the caller set none and nothing was served: half the host memory. The
    answer and its decoded tensors are both held in host memory, so a larger one could
    only end in the island being killed for memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, OSError, ValueError):
        return 64 << 30


def _host_key(host: str) -> str:
    """`host` as compared: without IPv6 brackets, lower case, an IP literal in its one form."""
    host = host.strip().strip("[]").lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _source_problem(parts: urllib.parse.SplitResult, port: int, expected: str | None, fragment: bool) -> str | None:
    """Why a peer's advertised URL (split; `fragment`: it has a '#') is not one this island
    fetches, or None."""
    if parts.scheme != "http":
        return (f"its scheme is {parts.scheme or 'missing'!r}: only http:// is fetched (a file:, ftp: or data: "
                "URL would read this machine's files or another server)")
    if not parts.hostname or not port:
        return "it names no host and port"
    if parts.username is not None or parts.password is not None:
        return "it carries credentials"
    if parts.path != HEAL_PATH or parts.query or fragment:
        return f"its path is not {HEAL_PATH!r} (with no query or fragment)"
    if expected is not None and _host_key(parts.hostname) != _host_key(expected):
        return (f"its host {parts.hostname!r} is not {expected!r}, the host of the member the quorum named as "
                "the source")
    return None


def _read_capped(response: http.client.HTTPResponse, cap: int, url: str) -> bytes:
    """The body of `response`, refused (HealingRefused) past `cap` bytes: a declared
    Content-Length before any of the body is read, else after cap + 1 bytes."""
    if response.length is not None:
        if response.length > cap:
            raise HealingRefused(f"refusing the state at {url}: it declares {response.length} bytes, over the cap "
                                 f"of {cap}{_CAP_FIX}")
        return response.read()  # exactly Content-Length bytes, in one buffer
    chunks, got = [], 0
    while got <= cap:
        chunk = response.read(min(CHUNK, cap + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > cap:
        raise HealingRefused(f"refusing the state at {url}: more than the cap of {cap} bytes arrived{_CAP_FIX}")
    return b"".join(chunks)  # a second copy for a moment: answers without Content-Length are not ours


_CAP_FIX = (". A state of this federation is the size of this island's own; a larger one is another model or an "
            "attack. If this island's state is larger than the cap, the outer loop sets it from its own "
            "(SafeHTTPTransport.expect_state_like)")


# ---- the transport ----------------------------------------------------------------------


def frame_head(key: FederationKey, header: FrameHeader, size: int, digest: bytes) -> bytes:
    """The header `trust.seal` puts before a payload of `size` bytes whose SHA-256 is
    `digest`: with it the healing server signs a state it serves without joining header,
    state and tag (test_slow_senders checks the pieces against `seal` byte for byte)."""
    return _HEADER.pack(MAGIC, key.federation_id, header.quorum, header.step, header.fragment, header.island,
                        header.kind, header.tokens, header.weight, size, digest)



class SafeHTTPTransport(CheckpointTransport[dict[str, Any]]):
    """torchft's CheckpointTransport, serving `encode_state` bytes over HTTP.

    What the healing side accepts, set by the caller (torchft knows neither):
    `expect_source(host)` before each heal, the host of the member the quorum named
    (else any host is fetched from, http:// only, no redirect), and
    `expect_state_like(state)` once, the cap on the answer's size from this island's own
    state (else the size of the last state it served, with the same headroom, else half
    the host memory). `timeout` of `recv_checkpoint` bounds the whole fetch.

    The server closes a connection whose request head has not arrived within
    `request_timeout`, or that takes longer than that for a MiB of the answer (a peer
    that reads less than about 70 KB/s at the default), and handles at most
    `max_connections` requests at a time.
    """

    def __init__(self, timeout: timedelta, host: str | None = None, key: FederationKey | None = None,
                 island: int = 0, max_state_bytes: int | None = None, expected_host: str | None = None,
                 request_timeout: timedelta = timedelta(seconds=15), max_connections: int = 16) -> None:
        self._timeout = timeout
        self._host = host or local_address()
        self._key, self._island = key, island
        self.max_state_bytes, self.expected_host = max_state_bytes, expected_host
        self._served_bytes = 0  # the size of the last state served: a cap when none is set
        self._nonces: set[int] = set()
        self._ready = threading.Condition()
        self._step, self._body = -1, b""  # nothing is served until send_checkpoint
        self._digested: tuple[bytes, bytes] | None = None  # (the served body, its SHA-256), once per state
        self._digest_lock = threading.Lock()  # one hash of a state, however many requests ask at once
        self._server = RequestServer(self._host, self._handler_class(), request_timeout.total_seconds(),
                                      max_connections)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(HeadHandler):  # never reads a request body
            server_name = "healing server"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                try:
                    body = transport._body_for(self.path, self.headers.get(FRAME_HEADER, ""))
                except PermissionError as exc:
                    log.warning("healing server: refused a request from %s: %s", self.client_address[0], exc)
                    self.send_error(403, "not a member of this federation")
                    return
                if body is None:
                    self.send_error(404, "no such state here")
                    return
                self.reply_parts(200, body)

        return Handler

    def _body_for(self, path: str, frame_hex: str) -> list[bytes] | None:
        """The bytes for GET /checkpoint/STEP/full, in pieces sent one after another, waiting
        (bounded) for send_checkpoint; with a key, only for a signed request, as a signed
        answer (PermissionError if not)."""
        parts = path.split("/")
        if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] != "full" or not parts[2].isdigit():
            return None
        step = int(parts[2])
        nonce = self._check_request(step, frame_hex) if self._key is not None else 0
        with self._ready:
            self._ready.wait_for(lambda: self._step >= 0, timeout=self._timeout.total_seconds())
            body = self._body if self._step == step else None
        if body is None or self._key is None:
            return None if body is None else [body]
        return self._signed(body, step, nonce)

    def _signed(self, body: bytes, step: int, nonce: int) -> list[bytes]:
        """The HEAL_STATE frame of `body` for the request `nonce`: [header, body, tag], the
        bytes `seal` would join. Joined, each request made a copy of the whole state (two
        while its tag was computed), 16 requests at a time; here the state's SHA-256 (in the
        header) is computed once per served state, and the tag, which covers the nonce in the
        header, once per request, over the header and then the state where it lies."""
        assert self._key is not None
        head = frame_head(self._key, FrameHeader(quorum=nonce, step=step, fragment=0, island=self._island,
                                                 kind=HEAL_STATE), len(body), self._digest_of(body))
        mac = hmac.new(self._key.island_key(self._island), head, hashlib.sha256)
        mac.update(body)
        return [head, body, mac.digest()]

    def _digest_of(self, body: bytes) -> bytes:
        """The SHA-256 of the served `body`, computed by the first request that needs it
        (about 1 s per 2 GB, on a handler thread, not in send_checkpoint), kept while it is
        the state served (a replaced one is not kept alive by it)."""
        with self._digest_lock:
            cached = self._digested
            if cached is not None and cached[0] is body:
                return cached[1]
            digest = hashlib.sha256(body).digest()
            with self._ready:
                if self._body is body:
                    self._digested = (body, digest)
            return digest

    def _check_request(self, step: int, frame_hex: str) -> int:
        """The nonce of a valid request frame for `step` never seen before."""
        assert self._key is not None
        try:
            header, _ = open_frame(self._key, bytes.fromhex(frame_hex),
                                   FrameHeader(quorum=0, step=step, fragment=0, island=0, kind=HEAL_REQUEST),
                                   any_island=True, any_quorum=True)
        except ValueError as exc:  # FrameRefused, or not hex at all
            raise PermissionError(str(exc) or "no signed request") from exc
        with self._ready:
            if header.quorum in self._nonces:
                raise PermissionError("a replayed request")
            if len(self._nonces) >= _MAX_NONCES:
                self._nonces.clear()  # a 64-bit random nonce does not come back by chance
            self._nonces.add(header.quorum)
        return header.quorum

    def address(self) -> str:
        host, port = self._server.server_address[:2]
        host = url_host(str(host))
        return f"http://{host}:{port}{HEAL_PATH}"

    def metadata(self) -> str:
        return self.address()

    # ---- what the healing side accepts --------------------------------------------

    def expect_source(self, source: str | None) -> None:
        """Fetch the next heals only from `source`: the host of the member the quorum named
        as the healing source, or a URL on it (torchft's `recover_src_manager_address`,
        "http://HOST:PORT"). Hosts are compared as written (an IP literal in any of its
        forms), not resolved: the member advertises its healing server on the address its
        manager has (both LOCAL_ADDR). None: any host (http:// only, no redirect)."""
        if source is not None and "://" in source:
            source = urllib.parse.urlsplit(source).hostname
        self.expected_host = source

    def expect_state_like(self, state_dict: Any) -> int:
        """Cap the answers of peers by this island's own healing state (the dict torchft
        serves, or one shaped like it: its tensors are measured, not copied): its encoded
        size * 1.25 + 1 MiB. Returns the cap, also in `max_state_bytes`."""
        self.max_state_bytes = heal_cap(encoded_size(0, state_dict))
        return self.max_state_bytes

    def state_cap(self) -> int:
        """The most bytes a healing answer may have: `max_state_bytes` when set, else from
        the last state this island served, else half the host memory."""
        if self.max_state_bytes is not None:
            return self.max_state_bytes
        return heal_cap(self._served_bytes) if self._served_bytes else _memory_cap()

    # ---- torchft's CheckpointTransport ---------------------------------------------

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        # A snapshot (the trainer changes the state next), held while served: one copy of the
        # global state in host memory, as long as a peer may still ask for it.
        body = encode_state(step, state_dict)
        with self._ready:
            self._step, self._body, self._digested = step, body, None
            self._served_bytes = len(body)
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._step, self._body, self._digested = -1, b"", None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        """The state of federation `step` from the peer at `metadata` (the URL it advertised),
        all of it within `timeout`; HealingRefused for a URL, redirect, size or delay this
        island does not accept, FrameRefused for an answer not signed with the key."""
        deadline = time.monotonic() + timeout.total_seconds()
        host, port = self._source(metadata)
        nonce = secrets.randbits(64)
        headers = {}
        if self._key is not None:
            frame = seal(self._key, FrameHeader(quorum=nonce, step=step, fragment=0, island=self._island,
                                                kind=HEAL_REQUEST), b"")
            headers[FRAME_HEADER] = frame.hex()
        url = f"{metadata}{step}/full"
        try:
            blob = self._fetch(host, port, step, headers, deadline, url)
        except TimeoutError as exc:
            raise HealingRefused(f"the state at {url} did not arrive within the healing timeout of "
                                 f"{timeout.total_seconds():g} s (connect, headers and body together): a slow or "
                                 "stalled peer. The next quorum retries; over a slow link raise the fault "
                                 "tolerance timeout (process_group_timeout_ms), which bounds the fetch") from exc
        except OSError as exc:  # refused, reset: a peer that went away
            raise ConnectionError(f"could not fetch the state of federation step {step} from {url}: {exc}. The "
                                  "next quorum retries (from another member, if this one is gone)") from exc
        if self._key is not None:  # the answer to this request, from an island of the federation
            expect = FrameHeader(quorum=nonce, step=step, fragment=0, island=0, kind=HEAL_STATE)
            try:
                _, blob = open_frame(self._key, blob, expect, any_island=True)
            except FrameRefused as exc:
                raise FrameRefused(f"refusing the state served at {metadata} for federation step {step}: {exc}. "
                                   "The member that claims this step does not hold this federation's key (an "
                                   "unauthenticated member, or one with another key file); nothing of its "
                                   "answer was read. Stop that process, or restart the lighthouse without "
                                   "it") from exc
        state = decode_state(blob, step)
        manager = state.get("torchft") if isinstance(state, dict) else None
        if (not isinstance(manager, dict) or manager.get("step") != step or "user" not in state
                or not all(isinstance(manager.get(k), int) and manager[k] >= 0
                           for k in ("step", "batches_committed"))):
            raise StateFormatError(f"the peer's state does not hold federation step {step}")
        return state

    def _source(self, metadata: str) -> tuple[str, int]:
        """(host, port) of a peer's advertised healing URL, HealingRefused unless it is an
        http:// healing server of this federation's kind on the expected host."""
        problem, host, port = None, "", 0
        if not (isinstance(metadata, str) and metadata.isascii() and metadata.isprintable() and " " not in metadata):
            problem = "it is not a printable URL without spaces"
        else:
            try:
                parts = urllib.parse.urlsplit(metadata)
                port = parts.port or 0
            except ValueError as exc:
                problem = f"it is not a URL ({exc})"
            else:
                problem = _source_problem(parts, port, self.expected_host, "#" in metadata)
                host = parts.hostname or ""
        if problem is not None:
            raise HealingRefused(f"refusing to heal from {metadata!r}: {problem}. A member of this federation "
                                 f"advertises http://HOST:PORT{HEAL_PATH} on the address of its manager "
                                 "(LOCAL_ADDR); anything else is not such a member: stop that process, or "
                                 "restart the lighthouse without it")
        return host, port

    def _fetch(self, host: str, port: int, step: int, headers: dict[str, str], deadline: float, url: str) -> bytes:
        """The body of GET /checkpoint/STEP/full at host:port, all of it by `deadline` (else
        TimeoutError), at most the cap; nothing of an answer other than 200 is read."""
        connection = DeadlineConnection(host, port, deadline)
        try:
            connection.request("GET", f"{HEAL_PATH}{step}/full", headers=headers)
            response = connection.getresponse()
            if response.status != 200:
                raise self._status_error(response.status, url, step)
            return _read_capped(response, self.state_cap(), url)
        except http.client.HTTPException as exc:  # a malformed answer, or a short one
            raise HealingRefused(f"the answer at {url} is not a well-formed HTTP answer: {exc!r}") from exc
        finally:
            connection.close()

    def _status_error(self, status: int, url: str, step: int) -> Exception:
        if self._key is not None and status == 403:
            return FrameRefused(f"the island serving federation step {step} at {url} refused this island's signed "
                                "request (HTTP 403): it holds another federation key (check the key file on "
                                "both), or saw the request before")
        if 300 <= status < 400:
            return HealingRefused(f"the peer at {url} answered with a redirect (HTTP {status}): redirects are "
                                  "refused, the state comes only from the member the quorum named. Stop that "
                                  "process, or restart the lighthouse without it")
        return HealingRefused(f"the peer at {url} answered HTTP {status}, not the state of federation step {step} "
                              "(it moved on, or serves nothing now): the next quorum retries")

    def shutdown(self, wait: bool = True) -> None:
        self._server.close(wait)
