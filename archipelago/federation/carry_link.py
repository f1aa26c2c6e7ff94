"""A thin island and its carrier over HTTP (the messages and their checks: carry.py).

The carrier serves two paths on its own address (LOCAL_ADDR, else loopback), on the request
server healing stands on (http_serving.RequestServer: a thread only for a request whose
head has arrived, a few at a time):

* `GET /carry/weights`: the thin island's signed request (`carry.pack_request`) in the
  X-Archipelago-Frame header; the answer is the global weights the carrier last published,
  signed for that request and that island (`CarrierBook.answer`).
* `PUT /carry/row`: the thin island's signed row (`carry.pack_row`) as the body; 204 when
  the carrier took it (staged for its next hand-off, `take_uploads`), 403 with the reason
  when it refused it.

Only the thin island connects, so it needs no open port: a small cluster or a workstation
behind NAT can be one. Unlike the healing server, this one reads a request body, on a
handler thread (a thin link may take minutes over a row), so who may send one is decided
before a byte of it is read:

* only from an address a signed download was served to (the row must name one anyway):
  an outsider's PUT is refused at once, and cannot hold the few handlers with half-sent
  bodies (it held all four for `quorum_timeout`, 600 s, and the thin island waited);
* of at most the carry codec's payload plus the frame (both sides know it from the model);
* each read within READ_TIMEOUT_S (a sender that stops frees its handler then), all of it
  within `request_timeout` (http_serving.read_body).

Request heads are read within READ_TIMEOUT_S too, on the server's one selector thread.
Nothing of a body is used before the signature, the download it names and its values are
checked (`CarrierBook.receive`).
"""

from __future__ import annotations

import http.client
import logging
import secrets
import threading
import time
import urllib.parse
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

import torch

from archipelago.federation.carry import (
    CarrierBook,
    CarryRefused,
    Upload,
    open_weights,
    pack_request,
    pack_row,
)
from archipelago.federation.codecs import Codec
from archipelago.federation.http_serving import FRAME_HEADER, DeadlineConnection, HeadHandler, RequestServer, read_body
from archipelago.federation.policy import Allowance
from archipelago.federation.trust import HEADER_BYTES, TAG_BYTES, FederationKey
from archipelago.netutil import canonical_host, local_address, url_host

log = logging.getLogger("archipelago.federation")

WEIGHTS_PATH = "/carry/weights"
ROW_PATH = "/carry/row"
READ_TIMEOUT_S = 15.0  # a request head, and each read of an upload's body: a thin island sends at once
DOWNLOADERS_KEPT = 16  # addresses that took a signed download, from which uploads are read (newest kept)


def peer_host(address: object) -> str:
    """The host of a connection's peer address (`client_address`), an IPv4-mapped IPv6
    address as IPv4: one thin island is one host however the carrier's socket names it."""
    return canonical_host(str(address[0]) if isinstance(address, tuple) and address else str(address))


def row_frame_bytes(codec: Codec) -> int:
    """The size of a thin island's row frame with `codec`: what the carrier reads at most."""
    return HEADER_BYTES + codec.payload_bytes() + TAG_BYTES


def weights_frame_bytes(numel: int) -> int:
    """The size of the carrier's answer: `numel` bf16 values in a frame."""
    return HEADER_BYTES + 2 * numel + TAG_BYTES


class CarryServer:
    """The carrier's side: serves its published global weights to the thin islands it
    carries and takes their rows (judged by `book`, decoded with `codec`, within
    `allowance`), staged until the outer loop takes them at its hand-off. `request_timeout`
    bounds an upload's whole body and each MiB of a download's answer (a thin link's pace);
    `head_timeout` a request head (READ_TIMEOUT_S unless set)."""

    def __init__(self, book: CarrierBook, codec: Codec, allowance: Allowance, weighting: str = "tokens",
                 host: str | None = None, request_timeout: float = 60.0, max_connections: int = 4,
                 port: int = 0, head_timeout: float | None = None) -> None:
        self.book, self.codec, self.allowance, self.weighting = book, codec, allowance, weighting
        self.request_timeout = request_timeout
        self._lock = threading.Lock()  # the book, the weights and the staged rows: handlers run on threads
        self._published: tuple[int, torch.Tensor] | None = None
        self._uploads: list[Upload] = []
        self._downloaders: OrderedDict[str, None] = OrderedDict()  # hosts served a signed download, newest last
        self._server = RequestServer(host or local_address(), self._handler_class(),
                                     READ_TIMEOUT_S if head_timeout is None else head_timeout, max_connections,
                                     port, send_timeout=request_timeout)

    def publish(self, step: int, weights: torch.Tensor, allowance: Allowance | None = None) -> None:
        """The global weights at outer `step`, served from now on (a bf16 copy is kept), and
        the allowance uploads are judged against from now on (its norm bound follows the
        global weights' norm)."""
        copy = weights.detach().to("cpu", torch.bfloat16, copy=True)
        with self._lock:
            self._published = (step, copy)
            self.allowance = allowance or self.allowance

    def restage(self, uploads: list[Upload]) -> None:
        """Rows taken but not carried in (the round that carried them failed): they go in
        the next row, first."""
        with self._lock:
            self._uploads = list(uploads) + self._uploads

    def take_uploads(self) -> list[Upload]:
        """The rows taken since the last call, in arrival order."""
        with self._lock:
            taken, self._uploads = self._uploads, []
        return taken

    def address(self) -> str:
        """`http://HOST:PORT`, what a thin island's `fault_tolerance.carrier` names."""
        host, port = self._server.server_address[:2]
        return f"http://{url_host(str(host))}:{port}"

    def close(self, wait: bool = True) -> None:
        self._server.close(wait)

    # ---- the two paths ---------------------------------------------------------------

    def answer_download(self, frame_hex: str) -> tuple[int, bytes]:
        """(HTTP status, body) for a download request."""
        with self._lock:
            if self._published is None:
                return 503, b"this carrier has published no global weights yet: retry after its first round"
            step, weights = self._published
            try:
                return 200, self.book.answer(bytes.fromhex(frame_hex), step, weights)
            except ValueError as exc:  # CarryRefused, or a header that is not hex
                log.warning("carry: refused a download request: %s", exc)
                return 403, str(exc).encode()

    def served(self, host: str) -> None:
        """`host` took a signed download: its uploads are read from now on."""
        with self._lock:
            self._downloaders[host] = None
            self._downloaders.move_to_end(host)
            while len(self._downloaders) > DOWNLOADERS_KEPT:
                self._downloaders.popitem(last=False)

    def upload_refusal(self, host: str) -> bytes | None:
        """Why an upload from `host` is refused before its body is read, or None."""
        with self._lock:
            if host in self._downloaders:
                return None
        log.warning("carry: refused an upload from %s before reading it: no signed download was served there", host)
        return (f"an upload from {host}, where this carrier served no download: a thin island uploads from the "
                "address it downloaded from (its row names that download)").encode()

    def take_row(self, frame: bytes) -> tuple[int, bytes]:
        """(HTTP status, body) for an upload whose bytes all arrived."""
        with self._lock:
            try:
                upload = self.book.receive(frame, self.codec, self.allowance, self.weighting)
            except CarryRefused as exc:
                log.warning("carry: %s", exc)
                return 403, str(exc).encode()
            self._uploads.append(upload)
        log.info("carry: took the row of thin island %d (%g tokens, trained from outer step %d)",
                 upload.island, upload.tokens, upload.base_step)
        return 204, b""

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(HeadHandler):
            server_name = "carry server"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != WEIGHTS_PATH:
                    self._reply(404, b"no such path here")
                    return
                status, body = server.answer_download(self.headers.get(FRAME_HEADER, ""))
                if status == 200:
                    server.served(peer_host(self.client_address))
                self._reply(status, body)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's name
                if self.path != ROW_PATH:
                    self._reply(404, b"no such path here")
                    return
                refusal = server.upload_refusal(peer_host(self.client_address))
                if refusal is not None:
                    self._reply(403, refusal)
                    return
                cap = row_frame_bytes(server.codec)
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._reply(411, b"an upload declares its Content-Length")
                    return
                if not 0 < length <= cap:
                    self._reply(413, f"an upload of {length} bytes: a row of this carrier's carry codec "
                                     f"takes at most {cap} (fault_tolerance.carry_codec and the topk_* keys must "
                                     "be the same on the thin island and its carrier)".encode())
                    return
                deadline = time.monotonic() + server.request_timeout
                frame = read_body(self.connection, self.rfile.read(), length, deadline, READ_TIMEOUT_S)
                self._reply(*server.take_row(frame))

            def _reply(self, status: int, body: bytes) -> None:
                self.reply(status, body, "application/octet-stream" if status == 200 else "text/plain")

        return Handler


@dataclass(frozen=True)
class Download:
    """Global weights a thin island downloaded: the request's nonce (its row names it), the
    carrier's outer step, the fp32 weights."""

    nonce: int
    step: int
    weights: torch.Tensor


class CarryClient:
    """The thin island's side: downloads the global weights from its carrier at `url`
    (island `carrier`) and uploads its rows there; every call ends within `timeout` seconds."""

    def __init__(self, key: FederationKey, island: int, carrier: int, url: str, numel: int,
                 timeout: float = 600.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port or parts.path not in ("", "/"):
            raise ValueError(f"fault_tolerance.carrier = {url!r}: expected http://HOST:PORT, the address the "
                             "carrier island's log prints when it starts carrying")
        self.key, self.island, self.carrier, self.numel, self.timeout = key, island, carrier, numel, timeout
        self.host, self.port, self.url = parts.hostname, parts.port, url.rstrip("/")

    def download(self) -> Download:
        """The carrier's global weights, fresh (a new nonce); CarryRefused for an answer that
        is not the carrier's for this request, ConnectionError when it cannot be had now."""
        nonce = secrets.randbits(63)
        request = pack_request(self.key, self.island, nonce)
        status, body = self._call("GET", WEIGHTS_PATH, {FRAME_HEADER: request.hex()}, b"",
                                  weights_frame_bytes(self.numel))
        if status != 200:
            raise self._refusal("download", status, body)
        step, weights = open_weights(self.key, self.carrier, self.island, nonce, self.numel, body)
        return Download(nonce, step, weights)

    def upload(self, download: Download, tokens: float, codec: Codec, values: torch.Tensor) -> None:
        """Send the pseudo-gradient trained from `download` (encoded with `codec`, claiming
        `tokens`); CarryRefused with the carrier's reason if it did not take it."""
        frame = pack_row(self.key, self.island, download.nonce, tokens, codec, values)
        status, body = self._call("PUT", ROW_PATH, {"Content-Type": "application/octet-stream"}, frame, 4096)
        if status != 204:
            raise self._refusal("upload", status, body)

    def _call(self, method: str, path: str, headers: dict[str, str], body: bytes, cap: int) -> tuple[int, bytes]:
        deadline = time.monotonic() + self.timeout
        connection = DeadlineConnection(self.host, self.port, deadline)
        try:
            connection.request(method, path, body=body or None, headers=headers)
            response = connection.getresponse()
            if response.length is None or response.length > cap:
                raise CarryRefused(f"the carrier at {self.url} answered {response.length} bytes (at most {cap} "
                                   "expected): not a carrier of this federation's model")
            return response.status, response.read()
        except TimeoutError as exc:
            raise ConnectionError(f"the carrier at {self.url} did not answer within {self.timeout:g} s: a slow "
                                  "or stalled link; the thin island retries") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise ConnectionError(f"could not reach the carrier at {self.url}: {exc!r}. Check "
                                  "fault_tolerance.carrier and that the carrier island is running") from exc
        finally:
            connection.close()

    def _refusal(self, what: str, status: int, body: bytes) -> Exception:
        reason = body[:2000].decode("utf-8", "replace")
        if status == 403:
            return CarryRefused(f"the carrier at {self.url} refused this island's {what}: {reason}")
        if status == 503:
            return ConnectionError(f"the carrier at {self.url}: {reason}")
        return CarryRefused(f"the carrier at {self.url} answered HTTP {status} to this island's {what}: {reason}")
