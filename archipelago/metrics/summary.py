"""Atomic JSON writes for run summaries (summary.json)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from archipelago.metrics.jsonl import to_jsonable


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    """Write `obj` as pretty JSON to `path`; readers never see a partial file.

    The temp file is created next to `path` because os.replace is only atomic
    within one filesystem; fsync before the rename so a crash cannot leave an
    empty file under the final name. Non-finite floats are written as null.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n"
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
