"""Trust between islands: the federation secret, the keys derived from it, signed frames.

Every island of a federation holds the same secret (`archipelago secret new --out fed.key`).
From it each island derives, with HKDF-SHA256, the federation's public id and one signing
key per island id. Whatever crosses islands and can change model state travels as a
frame:

    header (fixed, 102 bytes) | payload | HMAC-SHA256 tag (32 bytes) | signature (64 bytes, round frames)

    header = magic b"ARF1" | federation id (16) | quorum id (u64) | step (u64) |
             fragment (u32) | island (u32) | kind (u16) | tokens (u64) | weight (f64) |
             payload length (u64) | SHA-256 of the payload (32)

The tag covers the header and the payload under the sending island's key. `open_frame`
checks the tag before it reads any field but the island id (a fixed offset, needed to
pick the key), then refuses a frame of another federation, round, fragment, island or
kind than the one expected: a valid frame replayed elsewhere is refused.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from archipelago.config.errors import ConfigError

log = logging.getLogger("archipelago.federation")

KEY_FILE_ENV = "ARCHIPELAGO_FEDERATION_KEY_FILE"
ALLOW_READABLE_KEY_ENV = "ARCHIPELAGO_ALLOW_READABLE_KEY"  # =1: load a key file other users can read (warned)
SECRET_BYTES = 32
MAGIC = b"ARF1"
_HEADER = struct.Struct(">4s16sQQIIHQdQ32s")
HEADER_BYTES = _HEADER.size
HEADER_FORMAT = _HEADER  # what a member shows of another's frame as evidence reads these fields (receipts.py)
TAG_BYTES = 32
_ISLAND_OFFSET = 4 + 16 + 8 + 8 + 4  # where the island id sits in the header

# Frame kinds.
HEAL_REQUEST = 1  # a healing island asks a peer for the global state (empty payload)
HEAL_STATE = 2    # the peer's answer: state_format.encode_state bytes

MEMBER_PREFIX = "island_"  # torchft reads the island id from the digits before the first ":"
# A member id, whole: `island_N:NONCE TAG` (N without leading zeros: one spelling per island),
# then nothing or exactly torchft's `:UUID` (str(uuid.uuid4())). Anything else after a valid
# token would let one token name any number of members.
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
# The NONCE is the member's own public signing key (Ed25519, 32 bytes in hex: `member_signer`).
_MEMBER_ID = re.compile(rf"(island_(0|[1-9][0-9]{{0,8}}):([0-9a-f]{{64}})([0-9a-f]{{32}}))(?::{_UUID})?", re.ASCII)
SIGNATURE_BYTES = 64  # an Ed25519 signature
# Derived island keys kept: a lookup of an uncached id costs one HKDF (tens of microseconds),
# never memory: ids come from the network (the gate's replica ids, a frame's island field).
ISLAND_KEYS_CACHED = 1024


class FrameRefused(ValueError):
    """A frame that is not from this federation, not for this place, or not intact."""


def new_secret() -> str:
    """A fresh federation secret, as the hex text `archipelago secret new` prints."""
    return secrets.token_hex(SECRET_BYTES)


def _derive(secret: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


class FederationKey:
    """The keys one secret gives: the federation id and a signing key per island id."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_BYTES:
            raise ConfigError(f"the federation secret has {len(secret)} bytes, at least {SECRET_BYTES} are "
                              "needed; make one with `archipelago secret new --out fed.key`")
        self._secret = secret
        self.federation_id = _derive(secret, b"archipelago federation id", 16)
        # Bounded (least recently used out) and thread-safe: the gate's workers and the
        # healing transport look keys up concurrently.
        self._islands = functools.lru_cache(maxsize=ISLAND_KEYS_CACHED)(self._derive_island)

    def __reduce__(self) -> tuple[type, tuple[bytes]]:  # picklable as before the cache (a dict then)
        return (FederationKey, (self._secret,))

    def _derive_island(self, island: int) -> bytes:
        return _derive(self._secret, b"archipelago island %d" % island)

    def island_key(self, island: int) -> bytes:
        return self._islands(island)

    def tag(self, island: int, message: bytes) -> bytes:
        return hmac.new(self.island_key(island), message, hashlib.sha256).digest()

    def purpose_key(self, purpose: bytes) -> bytes:
        """A key of its own for one use of the secret (HKDF-SHA256 with `purpose` as its
        info), so that a tag made for that use is never valid for another."""
        return _derive(self._secret, purpose)


DASHBOARD_TAG = "X-Archipelago-Tag"  # header of a dashboard push: hex HMAC of the body with the island's key


def dashboard_tag(key: FederationKey, island: int, body: bytes) -> dict[str, str]:
    """Headers that authenticate an island's push to the federation dashboard."""
    return {DASHBOARD_TAG: key.tag(island, b"dashboard push\n" + body).hex()}


def dashboard_verifier(key: FederationKey) -> Callable[[int, bytes, dict[str, str]], bool]:
    """What the dashboard checks a push with: the tag of the island it names, and a body
    written within the last 5 minutes (a replayed old push is refused)."""
    def verify(island: int, body: bytes, headers: dict[str, str]) -> bool:
        given = next((v for k, v in headers.items() if k.lower() == DASHBOARD_TAG.lower()), "")
        expected = dashboard_tag(key, island, body)[DASHBOARD_TAG]
        if not hmac.compare_digest(given, expected):
            return False
        try:
            written = float(json.loads(body).get("time", 0))
        except (ValueError, AttributeError, TypeError):
            return False
        return abs(time.time() - written) < 300
    return verify


def load_key(key_file: str = "", allow_readable: bool = False) -> FederationKey | None:
    """The federation key from `key_file`, else from $ARCHIPELAGO_FEDERATION_KEY_FILE, else None.

    A key file that other users can read or write is refused (ConfigError naming `chmod
    600`): whoever reads it is a member. `allow_readable`, or $ARCHIPELAGO_ALLOW_READABLE_KEY=1
    (a file system without Unix permissions), loads it anyway, with a warning.
    """
    path = key_file or os.environ.get(KEY_FILE_ENV, "")
    if not path:
        return None
    try:
        with open(path, "rb") as file:  # the mode of the file read, not of a path that may change
            mode = os.fstat(file.fileno()).st_mode
            text = file.read(1 << 16)  # a secret is 65 bytes; whatever else is there is not one
    except OSError as exc:
        raise ConfigError(f"cannot read the federation key file {path}: {exc.strerror}") from exc
    _check_private(path, mode, allow_readable or os.environ.get(ALLOW_READABLE_KEY_ENV, "") == "1")
    try:
        secret = bytes.fromhex(text.decode("ascii").strip())
    except ValueError as exc:  # UnicodeDecodeError included
        raise ConfigError(f"the federation key file {path} does not hold a secret in hex; make one with "
                          "`archipelago secret new --out fed.key`") from exc
    return FederationKey(secret)


def _check_private(path: str, mode: int, allowed: bool) -> None:
    if not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return
    if allowed:
        log.warning("the federation key file %s can be read by other users (mode %o); `chmod 600 %s`",
                    path, stat.S_IMODE(mode), path)
        return
    raise ConfigError(f"the federation key file {path} can be read or written by other users (mode "
                      f"{stat.S_IMODE(mode):o}): whoever reads it can join the federation. Run `chmod 600 {path}` "
                      f"(`archipelago secret new --out FILE` writes it so); where the file system has no Unix "
                      f"permissions, {ALLOW_READABLE_KEY_ENV}=1 loads it anyway")


def write_secret(path: str, force: bool = False) -> None:
    """A new secret into a new file `path`, mode 600 from its creation (it is never readable
    by others, whatever the umask). An existing `path` is refused unless `force`; then it is
    replaced at once (a new file renamed over it, so the old file's mode does not carry over)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}") if force else target
    try:
        fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(new_secret() + "\n")
        if force:
            os.replace(temporary, target)
    except FileExistsError:
        raise ConfigError(f"{path} exists; a new secret would lock every island holding the old one out. "
                          "Pick another file, or replace it with --force") from None
    except OSError as exc:
        if force:
            temporary.unlink(missing_ok=True)
        raise ConfigError(f"cannot write the federation key file {path}: {exc.strerror}") from None


# This process's member token per (federation, island): the token the island proves to the
# gate (gate.check_admission) must be the one torchft then sends. Keyed by process id too: a
# forked child mints its own (two processes of one island must not share a token).
_MINTED: dict[tuple[int, bytes, int], tuple[str, FederationKey, Ed25519PrivateKey]] = {}
_MINTED_LOCK = threading.Lock()


def member_id(key: FederationKey | None, island: int) -> str:
    """The replica id island `island` gives torchft: `island_N`, and with a key
    `island_N:NONCE TAG`, a member token the lighthouse gate checks (federation/gate.py).

    The tag is an HMAC of the id and a nonce under the island's key: only a holder of the
    secret can make one. The nonce is the public half of a signing key (Ed25519) this
    process made and keeps (`member_signer`): every member of a quorum learns every other's
    public key from the replica ids the lighthouse hands all of them alike, so a member's
    signature on what it sent is evidence that the others can check and that no other member
    can make, though every member holds the secret (federation/receipts.py). One process
    gets one token per island and key (made at the first call): the island proves to the
    gate that it holds the key for this token, and the gate then passes the token only from
    that address and under the first full id it sees with it (torchft appends `:UUID`). A
    token copied off the network is therefore useless from another host; the join frame
    (membership.fingerprint_row), bound to the quorum, is what keeps even a copy from the
    same host out of the averages.
    """
    name = f"{MEMBER_PREFIX}{island}"
    if key is None:
        return name
    slot = (os.getpid(), key.federation_id, island)
    with _MINTED_LOCK:
        if slot not in _MINTED:
            signer = Ed25519PrivateKey.generate()
            nonce = signer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
            token = f"{name}:{nonce}{key.tag(island, _member_message(name, nonce))[:16].hex()}"
            _MINTED[slot] = (token, key, signer)
        return _MINTED[slot][0]


def member_signer(key: FederationKey | None, island: int) -> Ed25519PrivateKey | None:
    """The signing key whose public half is in this process's member token for `island`
    (made with it, by `member_id`); None without a federation key."""
    if key is None:
        return None
    member_id(key, island)
    with _MINTED_LOCK:
        return _MINTED[(os.getpid(), key.federation_id, island)][2]


def share_member_signer(key: FederationKey | None, island: int, sums: Callable[[list[float]], list[float]],
                        rank: int) -> Ed25519PrivateKey | None:
    """The island's signing key on every one of its ranks: rank 0's (the one whose member
    token the lighthouse hands out, torchft's quorum goes through rank 0), sent over the
    island's own process group as 32 numbers that `sums` adds up (the other ranks add
    zeros). A collective: every rank of the island calls it. The bytes never leave the
    island (one owner)."""
    if key is None:
        return None
    signer = member_signer(key, island)
    assert signer is not None
    seed = signer.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    shared = bytes(int(v) for v in sums([float(b) for b in seed] if rank == 0 else [0.0] * len(seed)))
    if rank != 0:
        signer = Ed25519PrivateKey.from_private_bytes(shared)
        with _MINTED_LOCK:
            slot = (os.getpid(), key.federation_id, island)
            _MINTED[slot] = (_MINTED[slot][0], key, signer)
    return signer


def member_public_key(key: FederationKey | None, replica_id: str) -> bytes | None:
    """The public signing key a replica id's member token carries (checked: the token's tag
    must be valid under `key`), or None."""
    if key is None or verified_member(key, replica_id) is None:
        return None
    match = _MEMBER_ID.fullmatch(replica_id)
    return bytes.fromhex(match.group(3)) if match else None


def sign(signer: Ed25519PrivateKey, message: bytes) -> bytes:
    """An Ed25519 signature of `message` (about 50 us on this machine's CPU)."""
    return signer.sign(message)


def signed_by(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is the signature of `message` under `public_key` (never raises)."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def minted_key(replica_id: str) -> FederationKey | None:
    """The key this process made the member token of `replica_id` with (member_id), or None."""
    with _MINTED_LOCK:
        return next((key for (pid, _, _), (token, key, _) in _MINTED.items()
                     if pid == os.getpid() and (replica_id == token or replica_id.startswith(token + ":"))), None)


def _member_message(name: str, nonce: str) -> bytes:
    return f"archipelago member {name}:{nonce}".encode()


def verified_member(key: FederationKey, replica_id: str) -> tuple[int, str] | None:
    """(island id, member token `island_N:NONCETAG`) of a replica id `member_id(key, ...)`
    made, alone or followed by torchft's `:UUID`; None for anything else."""
    match = _MEMBER_ID.fullmatch(replica_id)
    if match is None:
        return None
    token, island, nonce, tag = match.group(1), int(match.group(2)), match.group(3), match.group(4)
    expected = key.tag(island, _member_message(f"{MEMBER_PREFIX}{island}", nonce))[:16].hex()
    return (island, token) if hmac.compare_digest(expected, tag) else None


def check_member_id(key: FederationKey, replica_id: str) -> int | None:
    """The island id of a replica id `member_id(key, ...)` made (torchft's `:UUID` after
    it or not), else None."""
    member = verified_member(key, replica_id)
    return None if member is None else member[0]


def member_island(key: FederationKey | None, replica_id: str) -> int:
    """The island id a replica id names: checked with a key (`check_member_id`), else read
    from its `island_N` prefix; -1 when it names none."""
    if key is not None:
        island = check_member_id(key, replica_id)
        return -1 if island is None else island
    match = re.match(rf"{MEMBER_PREFIX}(0|[1-9][0-9]{{0,8}})(?::|$)", replica_id)
    return int(match.group(1)) if match else -1


def admission_proof(key: FederationKey, island: int, token: str, challenge: bytes) -> bytes:
    """An island's answer to the gate's challenge for its member token: an HMAC under the
    island's key, which a token read off the network does not give."""
    return key.tag(island, b"archipelago admit\n" + token.encode() + b"\n" + challenge)


def redacted(replica_id: str) -> str:
    """A replica id as logs show it: `island_N` and the first 4 characters after it (a member
    token is a credential; the full id stays out of logs)."""
    name, colon, rest = replica_id.partition(":")
    return name[:24] + (f":{rest[:4]}..." if colon else "")


def refuse_exposed_without_key(key: FederationKey | None, insecure: bool) -> None:
    """An island that serves healing beyond loopback (LOCAL_ADDR) needs a key, or `insecure`."""
    address = os.environ.get("LOCAL_ADDR", "")
    if key is not None or not address or is_loopback(address):
        return
    if insecure:
        log.warning("no federation key and LOCAL_ADDR=%s: anyone who reaches that address can fetch the "
                    "global weights and join the averages (--federation_security.insecure)", address)
        return
    raise ConfigError(f"LOCAL_ADDR={address} exposes this island's healing server beyond this machine, and "
                      "no federation key is set: anyone who reaches it could fetch the global weights. Make "
                      "a key (`archipelago secret new --out fed.key`, the same file on every island) and set "
                      f"{KEY_FILE_ENV} or [federation_security] key_file; or accept the risk on a trusted "
                      "network with --federation_security.insecure")


def is_loopback(host: str) -> bool:
    """True for a loopback address (any of 127.0.0.0/8, ::1) or `localhost`."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class FrameHeader:
    """Where a frame belongs (all must match what the receiver expects) and what it claims."""

    quorum: int
    step: int
    fragment: int
    island: int
    kind: int
    tokens: int = 0
    weight: float = 0.0


def claimed_island(frame: bytes) -> int:
    """The island id a frame claims (at a fixed offset; -1 if too short): it picks the key
    that checks the tag, and names the sender of a refused frame in logs. It proves nothing."""
    if len(frame) < _ISLAND_OFFSET + 4:
        return -1
    return int(struct.unpack_from(">I", frame, _ISLAND_OFFSET)[0])


def seal(key: FederationKey, header: FrameHeader, payload: bytes) -> bytes:
    """`payload` framed and signed with the key of `header.island`."""
    raw = _HEADER.pack(MAGIC, key.federation_id, header.quorum, header.step, header.fragment, header.island,
                       header.kind, header.tokens, header.weight, len(payload), hashlib.sha256(payload).digest())
    return raw + payload + key.tag(header.island, raw + payload)


def open_frame(key: FederationKey, frame: bytes, expect: FrameHeader, any_island: bool = False,
               any_quorum: bool = False, any_step: bool = False) -> tuple[FrameHeader, bytes]:
    """The header and payload of `frame`, if it is intact and belongs where `expect` says
    (its tokens and weight are the sender's claims, returned, not compared). With
    `any_island` the frame may come from any island of the federation; with `any_quorum`
    its quorum field is returned, not compared (a healing request's nonce); with `any_step`
    its step likewise (the outer step of a carrier's global weights)."""
    if len(frame) < HEADER_BYTES + TAG_BYTES:
        raise FrameRefused(f"a frame of {len(frame)} bytes is shorter than a header and a tag")
    island = claimed_island(frame)
    body, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
    if not hmac.compare_digest(key.tag(island, body), tag):
        raise FrameRefused(f"a frame signed without the federation's key (claims island {island})")
    magic, fed, quorum, step, fragment, island, kind, tokens, weight, size, digest = _HEADER.unpack_from(frame)
    got = FrameHeader(quorum, step, fragment, island, kind, tokens, weight)
    payload = body[HEADER_BYTES:]
    if magic != MAGIC or fed != key.federation_id:
        raise FrameRefused("a frame of another federation")
    if size != len(payload) or hashlib.sha256(payload).digest() != digest:
        raise FrameRefused("a frame whose payload does not match its header")
    wanted = (expect.fragment, expect.kind) + (() if any_island else (expect.island,))
    actual = (fragment, kind) + (() if any_island else (island,))
    if not any_step:
        wanted, actual = (expect.step, *wanted), (step, *actual)
    if not any_quorum:
        wanted, actual = (expect.quorum, *wanted), (quorum, *actual)
    if wanted != actual:
        raise FrameRefused(f"a frame for quorum {quorum}, step {step}, fragment {fragment}, island {island}, "
                           f"kind {kind}: expected {expect} (a replay)")
    return got, payload
