"""The DaCe backend's compiled programs, cached signed and loaded only from verified copies.

A compiled program is native code: DaCe's own cache (`compiler.use_cache`) loads whatever
library lies in the build folder, so whoever could write `data.cache_dir` ran code in
every island process that used the backend. Here the cache is checked as checkpoints are
(checkpoint/signing.py, verified.py): the two files DaCe loads for a program (its library
and the stub that loads it) are built in a private folder, their sizes and SHA-256 recorded
in `RECORD` beside the cached copies and signed (HMAC-SHA256) with the island's own local
key, which never lies in the cache folder. A later run copies each file, through the one
descriptor it hashes it from, into a private folder of its own (`tempfile.mkdtemp` under
$TMPDIR: mode 0700, its parents checked by `scratch_root`), compares with the signed
record, and DaCe loads the copies: nothing loaded is read from the cache folder itself, so
a file swapped after its check is never loaded. A missing, forged or mismatching record:
the program is built anew, with a warning naming the file.

Cost: a copy and a hash of two files of a few hundred KiB per process start (milliseconds),
and the private folder under $TMPDIR until the process ends. $TMPDIR must allow loading
code (not mounted `noexec`): dace.py's error says so when it does not.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from archipelago.checkpoint.signing import KEY_FILE_ENV, CheckpointKeyError, default_key_path, load_or_create_key
from archipelago.checkpoint.verified import CorruptCheckpointFile, ScratchError, copy_hashed, scratch_root

RECORD = "archipelago-build.json"  # in a program's cached folder, beside DaCe's `build/`
_DOMAIN = b"archipelago dace build\n"  # a build record's HMAC can never pass for a checkpoint manifest's
_MAX_RECORD = 1 << 16  # a record is a few hundred bytes
_MAX_LIBRARY = 1 << 30  # more than any compiled program: a planted endless file is not read to its end


class BuildCacheError(ValueError):
    """The cache cannot be checked safely here (its key, its private copies); the message names the fix."""


def library_names(program: str) -> tuple[str, str]:
    """The files DaCe loads for `program` (the SDFG's name): its library and the stub that loads it
    (dace.codegen.compiler.get_binary_name; compiled_sdfg.ReloadableDLL)."""
    return f"lib{program}.so", f"libdacestub_{program}.so"


def cached(folder: Path, program: str) -> bool:
    """Whether any file of a build of `program` lies in `folder` (a planted one included)."""
    return any(os.path.lexists(folder / "build" / name) for name in library_names(program))


def local_key(cache_folder: Path) -> bytes:
    """The island's local key (checkpoint/signing.py: made on first use, outside the cache folder)."""
    path = default_key_path()
    if path.expanduser().resolve().is_relative_to(cache_folder.resolve()):
        raise BuildCacheError(f"the local key file {path} is inside the DaCe cache folder {cache_folder}: whoever can "
                              f"write the folder could read or replace it. Point ${KEY_FILE_ENV} elsewhere")
    try:
        return load_or_create_key(path)[0]
    except CheckpointKeyError as exc:
        raise BuildCacheError(str(exc)) from exc


def private_folder() -> Path:
    """A fresh folder only this user can enter, removed when the process ends."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="archipelago-dace-", dir=scratch_root()))  # mode 0700
    except ScratchError as exc:
        raise BuildCacheError(str(exc)) from exc
    except OSError as exc:
        raise BuildCacheError(f"cannot make a private folder under $TMPDIR ({exc.strerror}): set TMPDIR to a local "
                              "folder you can write") from exc
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _signature(key: bytes, program: str, files: dict[str, Any]) -> str:
    message = json.dumps({"program": program, "files": files}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, _DOMAIN + message, hashlib.sha256).hexdigest()


def _hashed(path: Path) -> dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def publish(built: Path, cached: Path, program: str, key: bytes) -> None:
    """Copy `program`'s library files from `built` (this process's private build) to `cached`/build
    and sign their record in `cached`: each file, then the record, replaced whole (a reader
    sees an old file or a new one, never half of one)."""
    names = library_names(program)
    files = {name: _hashed(built / name) for name in names}  # hashed where no one else can write
    (cached / "build").mkdir(parents=True, exist_ok=True)
    for name in names:
        _replace(cached / "build" / name, (built / name).read_bytes())
    record = {"program": program, "files": files, "hmac": _signature(key, program, files)}
    _replace(cached / RECORD, json.dumps(record, sort_keys=True, indent=1).encode())


def _replace(path: Path, data: bytes) -> None:
    """Write `path` whole: a new file beside it (O_EXCL), renamed over it (a planted symlink is
    replaced, never followed)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def verified_copies(cached: Path, program: str, key: bytes, private: Path) -> str | None:
    """Copy `program`'s library files from `cached`/build into `private`, each checked against the
    signed record in `cached`: None when every copy matches (then load the copies, never the
    cached files), else why not, naming the file."""
    names = library_names(program)
    record_path = cached / RECORD
    files, problem = _read_record(record_path, key, program, names)
    if files is None:
        return problem
    for name in names:
        source = cached / "build" / name
        expected = files[name]
        try:
            size, digest = copy_hashed(source, private / name, min(expected["size"], _MAX_LIBRARY))
        except CorruptCheckpointFile as exc:
            return f"the cached DaCe build file {source} {exc.problem}"
        except ScratchError as exc:  # no room under $TMPDIR: a problem of this host, not of the cache
            raise BuildCacheError(str(exc)) from exc
        if size != expected["size"] or not _same(digest, expected["sha256"]):
            return (f"the cached DaCe build file {source} differs from its signed record {record_path} "
                    f"(size {size}, sha256 {digest[:12]}...; signed: size {expected['size']}, "
                    f"sha256 {expected['sha256'][:12]}...)")
    return None


def _same(text: str, expected: str) -> bool:
    """Constant-time equality of two strings, whatever characters a planted record holds."""
    return hmac.compare_digest(text.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def _read_record(path: Path, key: bytes, program: str, names: tuple[str, ...]) -> tuple[dict[str, Any] | None, str]:
    """The signed record's file entries, or None and why it cannot be used (naming `path`)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, (f"the cached DaCe build in {path.parent} has no signed record {path} (built before "
                      "records were kept, or not by this island)")
    except OSError as exc:
        return None, f"the signed record {path} of a cached DaCe build cannot be opened ({exc.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, f"the signed record {path} of a cached DaCe build is not a regular file"
        raw = os.read(fd, _MAX_RECORD + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(raw) if len(raw) <= _MAX_RECORD else None
    except (ValueError, RecursionError):
        record = None
    files = record.get("files") if isinstance(record, dict) else None
    well_formed = (isinstance(files, dict) and set(files) == set(names)
                   and all(isinstance(e, dict) and type(e.get("size")) is int and e["size"] >= 0
                           and isinstance(e.get("sha256"), str) for e in files.values()))
    if not (well_formed and isinstance(record, dict) and isinstance(record.get("hmac"), str)):
        return None, f"the signed record {path} of a cached DaCe build is malformed"
    assert isinstance(files, dict)
    if record.get("program") != program or not _same(record["hmac"], _signature(key, program, files)):
        return None, (f"the signed record {path} of a cached DaCe build is not signed with this island's local key "
                      f"(${KEY_FILE_ENV}) for this program: forged, or signed on another machine")
    return files, ""
