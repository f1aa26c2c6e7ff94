"""Load a DCP checkpoint only from bytes that were checked against its manifest.

Hashing the files of a checkpoint folder and then letting DCP open them again by path
leaves a window: whoever can write the folder can swap a file after it was hashed (and DCP
unpickles `.metadata`, so a swapped one runs code). `VerifiedCopyReader` closes it. When
DCP asks for a file, the reader copies it, through the one descriptor it hashes it from,
into a private folder (`tempfile.mkdtemp`: mode 0700, under $TMPDIR), checks size and
SHA-256 of what it copied against the manifest, and only then lets DCP's FileSystemReader
read the copy. Nothing DCP reads comes from the checkpoint folder itself, and a file the
manifest does not list is never read.

Cost, per rank and load: the files this rank reads (`.metadata` and the shards holding its
part of the state, about checkpoint / ranks when the rank count has not changed) are
written once to $TMPDIR and read back, usually from the page cache. A shard is deleted
as soon as DCP has read it, so the scratch space needed at once is the largest file a rank
reads; ranks sharing a machine need that much each. Hashing reads the checkpoint once,
as before, but now only the files that are loaded.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

_CHUNK = 1 << 20  # 1 MiB: negligible syscall overhead, never more than this in memory
_METADATA = ".metadata"


class CorruptCheckpointFile(RuntimeError):
    """A file differs from its manifest entry (or is not listed): the checkpoint is skipped."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.name, self.problem = name, problem

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers failures across ranks by pickling them
        return (type(self), (self.name, self.problem))


class ScratchError(RuntimeError):
    """The private copies cannot be made (space, permissions): no checkpoint could load, so stop."""


def scratch_root(override: Path | None = None) -> Path:
    """Where private folders go: `override`, else $TMPDIR (tempfile's choice), refused if unsafe."""
    root = Path(override or tempfile.gettempdir()).resolve()
    check_private_parent(root)
    return root


def check_private_parent(root: Path) -> None:
    """Refuse a folder in which another user could rename our private folder away.

    Renaming needs write permission on the parent, so every folder from `root` up to `/`
    must belong to us or root and be writable by no one else, or have the sticky bit
    (as /tmp has: then only an entry's owner may rename it).
    """
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    for folder in (root, *root.parents):
        st = folder.stat()
        shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
        foreign = uid is not None and st.st_uid not in (0, uid)
        if shared or foreign:
            raise ScratchError(
                f"{folder} can be changed by other users, so private copies of checkpoint files under "
                f"{root} would not be private: set TMPDIR to a folder only you (and root) can write")


class VerifiedCopyReader(FileSystemReader):
    """A DCP FileSystemReader over a private folder it fills with verified copies on demand.

    Args:
        source: the checkpoint folder (never read by DCP itself).
        files: the manifest's entries, {relative name: {"size", "sha256"}}; a name missing
            here is refused. An entry without sha256 (an unsigned manifest written with
            checkpoint.verify = false, loaded on the user's say-so) is checked by size only.
        root: where the private folder is made (see `scratch_root`).
    """

    def __init__(self, source: Path, files: dict[str, dict[str, Any]], root: Path) -> None:
        try:
            self.private = Path(tempfile.mkdtemp(prefix="archipelago-ckpt-", dir=root))  # mode 0700
        except OSError as exc:
            raise ScratchError(f"cannot make a private folder in {root} ({exc.strerror}): set TMPDIR to a "
                               "local folder you can write") from exc
        super().__init__(self.private)
        self.source = Path(source)
        self.files = files
        self._copied: set[str] = set()
        # The first failure, as DCP reports it only as text when reading `.metadata` fails.
        self.failure: Exception | None = None

    def close(self) -> None:
        """Remove the private folder (call also when the load failed)."""
        shutil.rmtree(self.private, ignore_errors=True)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP asks again with rank= for per-rank metadata when `.metadata` fails; we never
        # write those, so such a name is simply not in the manifest and is refused.
        rank = kwargs.get("rank")
        self._materialize(_METADATA if rank is None else f"__{rank}{_METADATA}")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy, verify, hand to DCP and delete one file at a time (peak scratch: one file)."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            copy = self._materialize(name)
            super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            copy.unlink()  # read: frees its scratch space now, not at the end of the load
            self._copied.discard(name)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _materialize(self, name: str) -> Path:
        """The private, verified copy of `name` (made once); records the first failure."""
        try:
            return self._copy_once(name)
        except (CorruptCheckpointFile, ScratchError) as exc:
            self.failure = self.failure or exc
            raise

    def _copy_once(self, name: str) -> Path:
        target = self.private / _safe_relative(name)
        if name in self._copied:
            return target
        expected = self.files.get(name)
        if expected is None:
            raise CorruptCheckpointFile(name, "is read by DCP but not listed in the manifest")
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        size, digest = copy_hashed(self.source / name, target, int(expected.get("size") or 0))
        problem = _mismatch(expected, size, digest)
        if problem is not None:
            raise CorruptCheckpointFile(name, problem)
        self._copied.add(name)
        return target


def copy_hashed(source: Path, target: Path, expected_size: int) -> tuple[int, str]:
    """Copy `source` to a new `target` (mode 0600), returning size and SHA-256 of the bytes copied.

    One descriptor serves hashing and copying, so what is hashed is what was copied.
    O_NOFOLLOW and O_NONBLOCK keep a planted symlink or FIFO from redirecting or blocking
    the read; at most `expected_size` + 1 bytes are read, so a file that keeps growing
    cannot fill the disk.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        src = os.open(source, flags)
    except FileNotFoundError as exc:
        raise CorruptCheckpointFile(source.name, "is missing") from exc
    except OSError as exc:
        raise CorruptCheckpointFile(source.name, f"cannot be opened ({exc.strerror})") from exc
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise CorruptCheckpointFile(source.name, "is not a regular file")
        _check_space(target.parent, expected_size)
        return _pump(src, target, expected_size + 1)
    finally:
        os.close(src)


def _pump(src: int, target: Path, limit: int) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        while size < limit:
            chunk = os.read(src, min(_CHUNK, limit - size))
            if not chunk:
                break
            digest.update(chunk)
            _write_all(dst, chunk, target)
            size += len(chunk)
    finally:
        os.close(dst)
    return size, digest.hexdigest()


def _write_all(fd: int, data: bytes, target: Path) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ScratchError(f"no space left for the private copy {target}: set TMPDIR to a local "
                                   "folder with room for the checkpoint shards this rank loads") from exc
            raise


def _check_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ScratchError(
            f"{folder} has {free / 1e9:.2f} GB free, the private copy of a checkpoint file needs "
            f"{need / 1e9:.2f} GB: set TMPDIR to a local folder with room for the checkpoint shards "
            "each rank on this machine loads")


def _mismatch(expected: dict[str, Any], size: int, digest: str) -> str | None:
    if size != expected.get("size"):
        return f"has size {size}, expected {expected.get('size')} (truncated?)"
    want = expected.get("sha256")
    if want and digest != want:
        return f"sha256 mismatch (expected {want[:12]}..., got {digest[:12]}...)"
    return None


def _safe_relative(name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CorruptCheckpointFile(name, "is not a plain relative file name")
    return rel
