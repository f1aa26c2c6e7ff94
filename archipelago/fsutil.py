"""Small filesystem helpers for crash-safe files: atomic writes, fsync, hashing."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

# 1 MiB reads: large enough that syscall overhead is negligible, small enough
# that hashing a multi-GB shard never holds more than this in memory.
_HASH_CHUNK = 1 << 20


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename/create inside it survives power loss.

    Some filesystems (and all of Windows) refuse to open directories; there the
    rename is as durable as the platform allows and we silently move on.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so readers see either the old or the new file.

    The temp file lives in the same folder because os.replace is only atomic
    within one filesystem.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks.

    Cost: one full sequential read of the file (~1-2 GB/s on local NVMe, often
    slower on network storage). For multi-hundred-GB checkpoints that is
    minutes, which is why CheckpointManager(verify=False) exists.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
