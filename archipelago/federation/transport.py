"""Healing without pickle: the global state a joining island fetches from a peer.

torchft's own HTTP transport sends the state with `torch.save` and loads it with
`torch.load(weights_only=False)`: any peer (or anyone who can answer on its port) could
run code on the island that heals from it. This transport sends the same state as a
JSON skeleton (structure, numbers, strings) and a safetensors body (tensors), parsed by
two formats that cannot execute anything, with every structural assumption checked:

    b"ARCHST01" | header length (u64, big-endian) | header (JSON) | safetensors

The header holds the step and the tree of the state: `{"d": {...}}` a dict with string
keys, `{"l": [...]}` a list, `{"t": name}` a tensor of the body, `{"v": value}` a
number, string, boolean or null. Every tensor of the body is used exactly once. The
receiver (`OuterLoop._load_heal`) then checks names, shapes, dtypes and finiteness
against its own state before applying anything.

With a federation key (federation/trust.py) both ways are signed frames: the request
carries a HEAL_REQUEST frame of the healing island with a fresh nonce; the answer is a
HEAL_STATE frame of the serving island whose quorum field carries that nonce, so neither
an outsider's request nor a recorded answer is accepted. Without a key anyone who
reaches the port can fetch the state.

The server binds LOCAL_ADDR when set, else loopback: a federation across machines sets
LOCAL_ADDR to the address its peers reach it at (docs/federation.md).
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import struct
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torchft.checkpointing.transport import CheckpointTransport

from archipelago.federation.trust import (
    HEAL_REQUEST,
    HEAL_STATE,
    FederationKey,
    FrameHeader,
    FrameRefused,
    open_frame,
    seal,
)
from archipelago.netutil import local_address, url_host

log = logging.getLogger("archipelago.federation")

MAGIC = b"ARCHST01"
MAX_HEADER_BYTES = 16 << 20  # the skeleton of a state is kilobytes; more is an attack
MAX_DEPTH = 32
FRAME_HEADER = "X-Archipelago-Frame"  # the signed request, in hex
_MAX_NONCES = 4096  # nonces remembered against replayed requests


class StateFormatError(ValueError):
    """A peer's state that is not what an island sends: refused before anything is applied."""


# ---- the format -----------------------------------------------------------------------


def encode_state(step: int, state: Any) -> bytes:
    """`state` (nested dicts with string keys, lists, tensors, numbers, strings) as bytes."""
    tensors: dict[str, torch.Tensor] = {}

    def skeleton(value: Any) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().to("cpu").contiguous()
            return {"t": name}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"state keys must be strings, got {sorted(map(repr, value))[:5]}")
            return {"d": {k: skeleton(v) for k, v in value.items()}}
        if isinstance(value, (list, tuple)):
            return {"l": [skeleton(v) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"v": value}
        raise TypeError(f"cannot send a {type(value).__name__} in the healing state")

    header = json.dumps({"step": step, "tree": skeleton(state)}).encode()
    return MAGIC + struct.pack(">Q", len(header)) + header + save_tensors(tensors)


def decode_state(blob: bytes, step: int) -> Any:
    """The state `encode_state(step, ...)` made; StateFormatError for anything else."""
    if len(blob) < len(MAGIC) + 8 or not blob.startswith(MAGIC):
        raise StateFormatError("not an archipelago state (bad magic or truncated)")
    (size,) = struct.unpack(">Q", blob[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if size > MAX_HEADER_BYTES or start + size > len(blob):
        raise StateFormatError(f"header of {size} bytes does not fit the {len(blob)} received")
    try:
        header = json.loads(blob[start:start + size])
        tensors = load_tensors(blob[start + size:])
    except Exception as exc:  # noqa: BLE001 - whatever the parsers say, it is a bad state
        raise StateFormatError(f"unreadable state: {exc}") from exc
    if not isinstance(header, dict) or header.get("step") != step or "tree" not in header:
        raise StateFormatError(f"state for step {header.get('step') if isinstance(header, dict) else '?'}, "
                               f"expected step {step}")
    used: set[str] = set()
    state = _rebuild(header["tree"], tensors, used, 0)
    if used != tensors.keys():
        raise StateFormatError(f"{len(tensors.keys() - used)} tensor(s) of the body are not in the state")
    return state


def _rebuild(node: Any, tensors: dict[str, torch.Tensor], used: set[str], depth: int) -> Any:
    if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
        raise StateFormatError("malformed state tree")
    kind, value = next(iter(node.items()))
    if kind == "d" and isinstance(value, dict):
        return {k: _rebuild(v, tensors, used, depth + 1) for k, v in value.items()}
    if kind == "l" and isinstance(value, list):
        return [_rebuild(v, tensors, used, depth + 1) for v in value]
    if kind == "t" and isinstance(value, str) and value in tensors and value not in used:
        used.add(value)
        return tensors[value]
    if kind == "v" and (value is None or isinstance(value, (bool, int, float, str))):
        return value
    raise StateFormatError(f"malformed state tree node {kind!r}")


# ---- the transport ----------------------------------------------------------------------


class SafeHTTPTransport(CheckpointTransport[dict[str, Any]]):
    """torchft's CheckpointTransport, serving `encode_state` bytes over HTTP."""

    def __init__(self, timeout: timedelta, host: str | None = None, key: FederationKey | None = None,
                 island: int = 0) -> None:
        self._timeout = timeout
        self._host = host or local_address()
        self._key, self._island = key, island
        self._nonces: set[int] = set()
        self._ready = threading.Condition()
        self._step, self._body = -1, b""  # nothing is served until send_checkpoint
        transport = self

        class Handler(BaseHTTPRequestHandler):
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
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
                log.debug("healing server: " + format, *args)

        server_class = type("Server", (ThreadingHTTPServer,), {
            "address_family": socket.AF_INET6 if ":" in self._host else socket.AF_INET,
            "daemon_threads": True})
        self._server = server_class((self._host, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="healing-server", daemon=True)
        self._thread.start()

    def _body_for(self, path: str, frame_hex: str) -> bytes | None:
        """The bytes for GET /checkpoint/STEP/full, waiting (bounded) for send_checkpoint;
        with a key, only for a signed request, as a signed answer (PermissionError if not)."""
        parts = path.split("/")
        if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] != "full" or not parts[2].isdigit():
            return None
        step = int(parts[2])
        nonce = self._check_request(step, frame_hex) if self._key is not None else 0
        with self._ready:
            self._ready.wait_for(lambda: self._step >= 0, timeout=self._timeout.total_seconds())
            body = self._body if self._step == step else None
        if body is None or self._key is None:
            return body
        return seal(self._key, FrameHeader(quorum=nonce, step=step, fragment=0, island=self._island,
                                           kind=HEAL_STATE), body)

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
        return f"http://{host}:{port}/checkpoint/"

    def metadata(self) -> str:
        return self.address()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any],
                        timeout: timedelta) -> None:
        # A snapshot (the trainer changes the state next), held while served: one copy of the
        # global state in host memory, as long as a peer may still ask for it.
        body = encode_state(step, state_dict)
        with self._ready:
            self._step, self._body = step, body
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._step, self._body = -1, b""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        request = urllib.request.Request(f"{metadata}{step}/full")
        nonce = secrets.randbits(64)
        if self._key is not None:
            frame = seal(self._key, FrameHeader(quorum=nonce, step=step, fragment=0, island=self._island,
                                                kind=HEAL_REQUEST), b"")
            request.add_header(FRAME_HEADER, frame.hex())
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                blob = response.read()
        except urllib.error.HTTPError as exc:
            if self._key is None or exc.code != 403:
                raise
            raise FrameRefused(f"the island serving federation step {step} at {metadata} refused this "
                               "island's signed request (HTTP 403): it holds another federation key "
                               "(check the key file on both), or saw the request before") from exc
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

    def shutdown(self, wait: bool = True) -> None:
        def stop() -> None:
            self._server.shutdown()  # returns within serve_forever's 0.5 s poll
            self._server.server_close()

        if wait:
            stop()
        else:
            threading.Thread(target=stop, name="healing-server-stop", daemon=True).start()
