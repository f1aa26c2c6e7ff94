"""The federation view of a run directory: one metrics.jsonl per island, merged.

A local federation (`archipelago local`) writes RUN_DIR/island-K/metrics.jsonl per
island and RUN_DIR/federation.json at the end. Both the launcher (to write
federation.json) and the report (to read a run whose launcher died before writing
it) build the same summary here, so the two can never disagree.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

from archipelago.metrics.jsonl import iter_records

log = logging.getLogger("archipelago.metrics")

FEDERATION_FILE = "federation.json"

# Island events worth a line in the federation's story; per-step noise is left out.
# "recovery" is what older runs called a heal.
ISLAND_EVENTS = ("join", "leave", "heal", "recovery", "quorum", "resume", "refused", "upload")

_ISLAND_DIR = re.compile(r"island-(\d+)$")


def island_dirs(run_dir: Path) -> dict[int, Path]:
    """island id -> RUN_DIR/island-K, for every island folder, by ascending id."""
    found = {}
    for path in Path(run_dir).glob("island-*"):
        match = _ISLAND_DIR.match(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def is_federation_dir(run_dir: Path) -> bool:
    """True for a local-federation run directory (federation.json or island-K/metrics.jsonl)."""
    run_dir = Path(run_dir)
    return (run_dir / FEDERATION_FILE).is_file() or any(
        (path / "metrics.jsonl").is_file() for path in island_dirs(run_dir).values())


def island_records(island_dir: Path) -> list[dict[str, Any]]:
    """Every record of an island's metrics.jsonl in file order; [] when it has none yet."""
    path = Path(island_dir) / "metrics.jsonl"
    return list(iter_records(path)) if path.is_file() else []


def is_step_record(record: dict[str, Any]) -> bool:
    step = record.get("step")
    return "event" not in record and isinstance(step, int) and not isinstance(step, bool)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def outer_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "outer_step"]


def summarize_island(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Final numbers of one island, taken in file order so a restart's records win."""
    steps = [r for r in records if is_step_record(r)]
    outer = outer_records(records)
    losses = [r["loss"] for r in steps if finite(r.get("loss"))]
    val_losses = [r["val_loss"] for r in steps if finite(r.get("val_loss"))]
    # Distinct numbers: a restarted island may log an outer step it already committed.
    committed = {r.get("outer_step") for r in outer if r.get("committed")}
    joins = [r for r in records if r.get("event") == "join"]
    return {
        "outer_steps_committed": len(committed),
        # A thin island (fault_tolerance.carrier) commits no outer step: its rows go up to its carrier.
        "carrier": joins[-1].get("carrier") if joins and joins[-1].get("carrier") else None,
        "uploads": sum(r.get("event") == "upload" for r in records),
        "final_step": final_step(steps, records),
        "final_loss": losses[-1] if losses else None,
        "final_val_loss": val_losses[-1] if val_losses else None,
        "final_outer_step": outer[-1].get("outer_step") if outer else None,
        "global_hash": outer[-1].get("global_hash") if outer else None,
        **round_totals(outer),
    }


def final_step(steps: list[dict[str, Any]], records: list[dict[str, Any]]) -> int | None:
    """The inner step an island ended at: its last logged step, or the step a heal caught
    it up to (a heal in the last round logs no training step after it)."""
    caught_up = [r["to_step"] for r in records
                 if r.get("event") == "heal" and isinstance(r.get("to_step"), int)]
    return max([r["step"] for r in steps] + caught_up, default=None)


def round_totals(outer: list[dict[str, Any]]) -> dict[str, Any]:
    """An island's rounds after its join round, summed: inner steps, tokens, compute and
    waiting seconds, and its utilisation: compute seconds / wall seconds from the end of
    the join round to the end of its last round (time killed or restarting counts as idle),
    leaving out the seconds it spent evaluating and checkpointing (`untimed_s`)."""
    rounds = outer[1:]
    window = rounds[-1]["time"] - outer[0]["time"] if rounds and all(
        finite(r.get("time")) for r in (outer[0], rounds[-1])) else 0.0
    compute = sum(float(r.get("compute_s") or 0.0) for r in rounds)
    untimed = sum(float(r.get("untimed_s") or 0.0) for r in rounds)
    busy_window = window - untimed
    return {"inner_steps": sum(int(r.get("inner_steps") or 0) for r in rounds),
            "tokens": sum(int(r.get("tokens") or 0) for r in rounds),
            "compute_s": compute, "wait_s": sum(float(r.get("sync_s") or 0.0) for r in rounds),
            "untimed_s": untimed, "window_s": window,
            "utilisation": compute / busy_window if busy_window > 0 else None}


def merge_outer_steps(records: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per outer step number: who committed it, who healed, whether the
    committing islands reported the same global-weights hash for it, and what crossed in
    it (`codec`, as the first committing island recorded it: `auto:int8`, `fp32`, ...)."""
    merged: dict[int, dict[str, Any]] = {}
    hashes: dict[int, set[str]] = {}
    for island, island_records_ in records.items():
        for record in outer_records(island_records_):
            number = record.get("outer_step")
            if not isinstance(number, int):
                continue
            entry = merged.setdefault(number, {"outer_step": number, "participants": 0,
                                               "islands": [], "healed": []})
            entry["participants"] = max(entry["participants"], int(record.get("participants") or 0))
            if record.get("committed"):
                _add(entry["islands"], island)
                hashes.setdefault(number, set()).add(str(record.get("global_hash")))
                if record.get("codec") and "codec" not in entry:
                    entry["codec"] = str(record["codec"])
            if record.get("healed"):
                _add(entry["healed"], island)
    for number, entry in merged.items():
        entry["hash_agree"] = len(hashes.get(number, ())) <= 1
    return [merged[n] for n in sorted(merged)]


def _add(ids: list[int], island: int) -> None:
    if island not in ids:
        ids.append(island)
        ids.sort()


def island_events(records: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The membership events of every island, each tagged with its island."""
    return [{**record, "island": island, "source": "island"}
            for island, island_records_ in records.items() for record in island_records_
            if record.get("event") in ISLAND_EVENTS]


def sort_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # A record without a time sorts first rather than being dropped.
    return sorted(events, key=lambda e: e["time"] if finite(e.get("time")) else 0.0)


def last_common_outer_step(islands: list[dict[str, Any]], outer_steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest outer step that every member committed (thin islands commit none), or None.

    Islands may legitimately end on different outer steps (one that finishes its inner
    steps later syncs once more alone), so their very last hashes can differ; the last
    step they all shared is where their global weights must be identical.
    """
    everyone = sorted(island["id"] for island in islands if not island.get("carrier"))  # members
    shared = [entry for entry in outer_steps if entry["islands"] == everyone]
    return shared[-1] if everyone and shared else None


def federation_summary(run_dir: Path, islands: list[dict[str, Any]],
                       launcher_events: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The federation.json record.

    `islands`: one dict per island with at least "id" (and, from the launcher,
    "ranks", "exit_code", "restarts"); the final numbers are read from each
    island's metrics.jsonl. `extra` (lighthouse, wall_s, ...) is stored as given.
    """
    run_dir = Path(run_dir)
    records = {island["id"]: island_records(run_dir / f"island-{island['id']}") for island in islands}
    rows = [{**island, **summarize_island(records[island["id"]])} for island in islands]
    outer_steps = merge_outer_steps(records)
    common = last_common_outer_step(rows, outer_steps)
    return {
        "run_dir": str(run_dir), **extra,
        "islands": rows,
        "outer_steps": outer_steps,
        "events": sort_events(island_events(records) + launcher_events),
        "global_hash_agree": bool(common and common["hash_agree"]),
        "global_hash_outer_step": common["outer_step"] if common else None,
    }


def load_federation(run_dir: Path) -> dict[str, Any]:
    """federation.json when the launcher wrote it, else the same summary rebuilt from the islands.

    The rebuilt one lacks what only the launcher knew (ranks, exit codes, kills).
    """
    path = Path(run_dir) / FEDERATION_FILE
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("islands"), list):
                return data
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s (%s); rebuilding from island metrics", path, exc)
    islands = [{"id": k, "ranks": None, "exit_code": None, "restarts": None} for k in island_dirs(run_dir)]
    return federation_summary(run_dir, islands, [], lighthouse=None, wall_s=None)
