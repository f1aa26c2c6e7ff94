"""Append-only JSON-lines metrics log and a resume-aware reader.

One record per line. Step records carry a "step" key; event records (run
start, resume, checkpoint saved, ...) carry an "event" key. A resumed run
re-logs the steps after its checkpoint, so readers keep the LAST record per
step.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("archipelago.metrics")


def to_jsonable(value: Any) -> Any:
    """`value` with non-finite floats as None and numpy/torch scalars as Python.

    JSON has no NaN/Infinity; Python's json module would write them as bare
    `NaN`, which strict parsers (jq, JavaScript) refuse. Keys are kept so a
    NaN loss stays visible as `"loss": null`.
    """
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and callable(value.item):  # numpy / 0-d torch scalars
        try:
            return to_jsonable(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


class MetricsLog:
    """Appends one JSON object per line to `path`, flushed after every record.

    Flushing each record costs one write syscall per call (negligible at
    logging cadence) and means a crash loses at most the record in flight.
    Pass enabled=False on non-zero ranks: every method is then a no-op.
    """

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._file: IO[str] | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        """Append `record` as one line (non-finite floats become null)."""
        if self._file is None:
            return
        line = json.dumps(to_jsonable(record), allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class MetricsHistory:
    """Parsed metrics: de-duplicated step records (ascending step) and events."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def read_metrics(path: Path) -> MetricsHistory:
    """Read a metrics.jsonl file.

    Step records: the last occurrence of each step wins (a resumed run re-logs
    steps after its checkpoint), returned in ascending step order. Records with
    an "event" key, or without a "step", go to `events` in file order. A
    malformed line (typically the last one, cut by a crash) is skipped with a
    warning.
    """
    by_step: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for record in iter_records(path):
        step = record.get("step")
        if "event" in record or not isinstance(step, int) or isinstance(step, bool):
            events.append(record)
        else:
            by_step[step] = record
    return MetricsHistory(steps=[by_step[s] for s in sorted(by_step)], events=events)


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every well-formed record of a metrics.jsonl file, in file (= time) order.

    Unlike read_metrics nothing is de-duplicated: readers that care about what
    happened when (a restarted island re-logging steps) need every line.
    Malformed lines are skipped with a warning.
    """
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            record = _parse_line(path, lineno, line)
            if record is not None:
                yield record


def _parse_line(path: Path, lineno: int, line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        log.warning("%s:%d: skipping malformed metrics line (%s)", path, lineno, exc)
        return None
    if not isinstance(record, dict):
        log.warning("%s:%d: skipping non-object metrics line", path, lineno)
        return None
    return record
