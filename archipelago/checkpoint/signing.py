"""The island's local checkpoint key: what signs (HMAC) checkpoint manifests.

Manifests are not signed with a key derived from the federation secret: every member of
a federation holds that secret, so any of them could sign a checkpoint another island
would then load (and DCP unpickles parts of a checkpoint when it loads it). The local key
is 32 random bytes that never leave this machine: made on first use, kept OUTSIDE the
checkpoint folder (whoever can write that folder must not be able to read the key), in
`$ARCHIPELAGO_CHECKPOINT_KEY_FILE`, else `$XDG_CONFIG_HOME/archipelago/checkpoint.key`,
else `~/.config/archipelago/checkpoint.key`, as hex text, mode 0600.

Only rank 0 of an island signs and checks manifests, so only rank 0's machine needs the
key; a run whose rank 0 moves to another machine must take the key file along (or point
the variable at a copy every node of the island reads).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Any

KEY_FILE_ENV = "ARCHIPELAGO_CHECKPOINT_KEY_FILE"
KEY_BYTES = 32
_MAX_KEY_FILE = 4096  # a key file is 65 bytes; reading more would only hide a wrong path


class CheckpointKeyError(RuntimeError):
    """The checkpoint key file cannot be used safely; the message names the fix."""


def default_key_path() -> Path:
    """$ARCHIPELAGO_CHECKPOINT_KEY_FILE, else the per-user config location."""
    explicit = os.environ.get(KEY_FILE_ENV, "")
    if explicit:
        return Path(explicit).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME", "") or str(Path.home() / ".config")
    return Path(config) / "archipelago" / "checkpoint.key"


def load_or_create_key(path: Path) -> tuple[bytes, bool]:
    """(key, whether it was created now) from `path`, making a fresh key there if none exists."""
    try:
        return read_key(path), False
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CheckpointKeyError(f"cannot read the checkpoint key file {path} ({exc.strerror}): fix its "
                                 f"permissions or point ${KEY_FILE_ENV} at a file of your own") from exc
    try:
        _create_key(path)
    except OSError as exc:
        raise CheckpointKeyError(f"cannot create the checkpoint key file {path} ({exc.strerror}): point "
                                 f"${KEY_FILE_ENV} at a path you can write, outside the checkpoint folder") from exc
    return read_key(path), True


def read_key(path: Path) -> bytes:
    """The key in `path`; FileNotFoundError when there is none, CheckpointKeyError when unusable.

    Mode and owner are checked on the descriptor the key is read from, so the check and
    the read concern the same file.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        _check_private(path, os.fstat(fd))
        text = os.read(fd, _MAX_KEY_FILE).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise CheckpointKeyError(
            f"the checkpoint key file {path} does not hold {KEY_BYTES} bytes in hex: move it away (a new "
            f"key is made on the next save, and checkpoints signed with the old one are then refused) "
            f"or point ${KEY_FILE_ENV} at the right file")
    return key


def _check_private(path: Path, st: os.stat_result) -> None:
    """Refuse a key another user could read or replace: it would let them sign checkpoints."""
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointKeyError(f"the checkpoint key file {path} is not a regular file")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise CheckpointKeyError(
            f"the checkpoint key file {path} belongs to another user (uid {st.st_uid}): use a key file of "
            f"your own (${KEY_FILE_ENV})")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CheckpointKeyError(
            f"the checkpoint key file {path} can be read or written by other users "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): whoever reads it can sign checkpoints this island "
            f"loads. Run `chmod 600 {path}` (or move it away to get a new key; checkpoints signed with "
            "the old one are then refused)")


def _create_key(path: Path) -> None:
    """Write a fresh key to `path` unless a key appears there meanwhile (another process won).

    mkstemp makes the temporary file with O_CREAT|O_EXCL and mode 0600; os.link publishes
    it complete or not at all and fails if `path` exists, so two ranks or runs starting
    together end up with one key, and no reader ever sees a half-written file.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def manifest_hmac(key: bytes, step: int, files: dict[str, Any]) -> str:
    """HMAC-SHA256 over the manifest's step and file entries (canonical JSON)."""
    message = json.dumps({"step": step, "files": files}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
