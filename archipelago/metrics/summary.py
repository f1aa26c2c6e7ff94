"""Atomic JSON writes for run summaries (summary.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archipelago.fsutil import write_text_atomic
from archipelago.metrics.jsonl import to_jsonable


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    """Write `obj` as pretty JSON to `path`; readers never see a partial file.

    Non-finite floats are written as null.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n"
    write_text_atomic(path, text)
