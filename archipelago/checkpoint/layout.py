"""The checkpoint folder's layout: step directories, the commit marker and `latest`.

    folder/
      latest                  # text: name of the newest committed step dir
      step-00000100/
        .metadata             # written by DCP (coordinator rank)
        __0_0.distcp ...      # written by DCP, one or more per rank
        COMPLETE.json         # written LAST by rank 0: commit marker + manifest

A step directory without COMPLETE.json was interrupted mid-save and is never loaded.
These helpers only name and read the layout; what is trusted is decided in manager.py.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("archipelago.checkpoint")

COMPLETE_NAME = "COMPLETE.json"
LATEST_NAME = "latest"
MAX_MANIFEST_BYTES = 64 << 20  # ~300k files; a bigger COMPLETE.json is not ours
_STEP_DIR_RE = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """Directory name for `step`; zero-padded so names sort like steps."""
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """Step number encoded in a directory name, or None if it is not one."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def is_committed(path: Path) -> bool:
    """Whether the step directory `path` holds its commit marker."""
    return (path / COMPLETE_NAME).is_file()


def scan_steps(folder: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step directory in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        step = parse_step_dir(child.name)
        if step is not None and child.is_dir():
            found.append((step, child))
    return sorted(found)


def read_latest_marker(folder: Path) -> str | None:
    """The directory name `latest` holds, or None when there is none."""
    try:
        text = (folder / LATEST_NAME).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return text or None


def list_files(path: Path) -> list[str]:
    """The files DCP wrote into `path`, as sorted relative names."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                  if p.is_file() and p.name != COMPLETE_NAME and not p.name.endswith(".tmp"))


def remove_checkpoint_dir(path: Path) -> None:
    """Delete a step directory, its commit marker first; a failure is logged, not raised."""
    # If we crash halfway through rmtree, the remains read as "incomplete" (skipped
    # quietly) rather than "corrupt".
    try:
        (path / COMPLETE_NAME).unlink(missing_ok=True)
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("could not remove %s (%s): delete it by hand to reclaim space", path, exc)


def read_manifest(path: Path) -> dict[str, Any]:
    """`path`'s COMPLETE.json, read from one open, with the fields the loader relies on."""
    with open(path / COMPLETE_NAME, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"larger than {MAX_MANIFEST_BYTES} bytes")
    manifest = json.loads(raw.decode("utf-8"))
    files = manifest["files"]
    if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
        raise TypeError("'files' is not a mapping of file entries")
    if manifest["step"] != parse_step_dir(path.name):  # a renamed dir would resume as another step
        raise ValueError(f"it is the manifest of step {manifest['step']}")
    return dict(manifest)
