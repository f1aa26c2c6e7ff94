"""Replay a recorded federation run through the round decisions, as the simulator makes them.

A run directory of `archipelago local` holds what each island decided in each round (its
`outer_step` records: participants, inner steps, weight) and what those decisions were
made from: when each island asked to join, was killed or left (federation.json's
events), how long each inner step took (time-paced records carry the seconds from the
round's start at each step's end, `pacing_elapsed_s`), its batch (config.json). The replay
recomputes the decisions from those inputs alone with the functions the simulator uses
(policy.round_is_up, part_in_round, outer_core.contribution_weight) and this membership rule: an island is in
a round's quorum when it has asked to join before the quorum formed (the latest of its
participants' arrivals at the outer step) and did not die or leave before it arrived
there itself; when it died, whether it would have arrived first is replayed from its step
records (their times, with `metrics.log_every = 1` every step's) through the same pacing.
(The simulator's rule is coarser: an island is in a round when it is up at the round's
start, so a returning island waits for the next round.) `compare` lists every round where
replay and record differ.

Exact for 1-rank islands: a multi-rank island ends a time-paced round when any rank's
clock says so, and only rank 0's are recorded. Runs with streaming fragments or a
`fragment_sync_delay` are refused (their rounds and weights follow other rules).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archipelago.config.errors import ConfigError
from archipelago.federation.outer_core import contribution_weight
from archipelago.federation.policy import Membership, part_in_round, round_is_up
from archipelago.metrics.islands import is_step_record, island_records, outer_records


@dataclass(frozen=True)
class RoundDecision:
    """One island's round: who was in it, how many inner steps it trained, its weight."""

    outer_step: int
    island: int
    participants: tuple[int, ...]
    inner_steps: int
    weight: float


def recorded(run_dir: Path) -> list[RoundDecision]:
    """The decisions the run made, from its records."""
    members = _members(run_dir)
    return [RoundDecision(r["outer_step"], k, members[r["outer_step"]], r["inner_steps"], float(r["weight"]))
            for k, records in _islands(run_dir).items() for r in records if r.get("committed")]


def replayed(run_dir: Path) -> list[RoundDecision]:
    """The decisions recomputed from the run's inputs (see the module docstring)."""
    fed = json.loads((Path(run_dir) / "federation.json").read_text())
    presence = _presence(fed["events"])
    islands = _islands(run_dir)
    quorum_at = _quorum_times(islands)
    configs = {k: json.loads((Path(run_dir) / f"island-{k}" / "config.json").read_text()) for k in islands}
    fts = {k: config["fault_tolerance"] for k, config in configs.items()}
    steps_of = {k: [r for r in island_records(Path(run_dir) / f"island-{k}") if is_step_record(r) and "time" in r]
                for k in islands}
    members: dict[int, tuple[int, ...]] = {}  # outer step -> the islands the rule puts in it

    def present(step: int) -> tuple[int, ...]:
        if step not in members:
            at = quorum_at[step]
            members[step] = tuple(sorted(j for j, spans in presence.items()
                                         if any(a <= at and _arrives(fts[j], islands[j], steps_of[j], at, b)
                                                for a, b in spans)))
        return members[step]

    out = []
    for k, records in islands.items():
        ft, per_step = fts[k], configs[k]["training"]["batch_size"] * configs[k]["data"]["seq_len"]
        if int(ft.get("num_fragments", 1)) != 1 or int(ft.get("fragment_sync_delay", 0)) != 0:
            raise ConfigError(f"island {k}: a run with num_fragments = {ft.get('num_fragments')} and "
                              f"fragment_sync_delay = {ft.get('fragment_sync_delay')}; the replay covers one "
                              "fragment without an overlap")
        joining = True
        for r in records:
            if r.get("event") == "join":
                joining = True
                continue
            steps = 0 if joining else _paced_steps(ft, r)
            part = part_in_round(Membership(outer_step=r["outer_step"] - 1, healed=bool(r["healed"])), joining, 1)
            weight = contribution_weight(ft["outer_weighting"], steps * per_step, part.contributes,
                                         r.get("own_refused") is None)
            if r.get("committed"):
                out.append(RoundDecision(r["outer_step"], k, present(r["outer_step"]), steps, weight))
                joining = False
    return out


def compare(run_dir: Path) -> list[tuple[RoundDecision | None, RoundDecision | None]]:
    """(recorded, replayed) pairs that differ; [] when the replay reproduces every round."""
    want = {(d.outer_step, d.island): d for d in recorded(run_dir)}
    got = {(d.outer_step, d.island): d for d in replayed(run_dir)}
    return [(want.get(key), got.get(key)) for key in sorted(set(want) | set(got)) if want.get(key) != got.get(key)]


def _islands(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each island's join events and outer_step records, in file order."""
    out = {}
    for path in sorted(Path(run_dir).glob("island-*")):
        records = [r for r in island_records(path) if r.get("event") in ("join", "outer_step")]
        out[int(path.name.split("-")[1])] = records
    return out


def _members(run_dir: Path) -> dict[int, tuple[int, ...]]:
    """Each committed outer step's islands, as their records say."""
    members: dict[int, set[int]] = {}
    for k, records in _islands(run_dir).items():
        for r in outer_records(records):
            if r.get("committed"):
                members.setdefault(r["outer_step"], set()).add(k)
    return {step: tuple(sorted(islands)) for step, islands in members.items()}


def _presence(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, float]]]:
    """When each island was there: from each join event to its next kill, exit or leave."""
    spans: dict[int, list[tuple[float, float]]] = {}
    open_since: dict[int, float] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        k = e.get("island")
        if k is None:
            continue
        if e["event"] == "join":
            open_since.setdefault(k, e["time"])
        elif e["event"] in ("kill", "exit", "leave") and k in open_since:
            spans.setdefault(k, []).append((open_since.pop(k), e["time"]))
    for k, since in open_since.items():
        spans.setdefault(k, []).append((since, float("inf")))
    return spans


def _quorum_times(islands: dict[int, list[dict[str, Any]]]) -> dict[int, float]:
    """When each outer step's quorum formed: the last of its participants' arrivals (of
    the round that committed: a failed round is numbered as the next one will be)."""
    at: dict[int, float] = {}
    for records in islands.values():
        for r in outer_records(records):
            if not r.get("committed"):
                continue
            arrived = r["time"] - r["sync_s"]
            at[r["outer_step"]] = max(at.get(r["outer_step"], arrived), arrived)
    return at


def _arrives(ft: dict[str, Any], records: list[dict[str, Any]], steps: list[dict[str, Any]], quorum_at: float,
             gone_at: float) -> bool:
    """Whether an island that was there when a round's quorum formed reached that outer
    step before it died or left at `gone_at`: its round from its last outer step before
    the quorum, step by step (its step records' times) through the pacing."""
    if gone_at == float("inf"):
        return True
    previous = max((r for r in outer_records(records) if r["time"] <= quorum_at), key=lambda r: r["time"],
                   default=None)
    if previous is None:
        return gone_at > quorum_at
    # Its compute for this round ended (it reached the outer step) before it died: the
    # arrival its own record of the round gives, or else its step records replayed.
    if any(previous["time"] < r["time"] - r["sync_s"] <= min(quorum_at, gone_at) for r in outer_records(records)):
        return True
    start, last = previous["time"], 0.0
    for s in steps:
        if s["time"] <= start or s["step"] <= previous["step"]:
            continue
        if s["time"] > gone_at:
            return False
        n, elapsed = s["step"] - previous["step"], s["time"] - start
        if ft["round_pacing"] == "time":
            if round_is_up(n, ft["min_inner_steps"], ft["max_inner_steps"], elapsed, elapsed - last,
                           ft["round_seconds"]):
                return True
        elif n >= int(ft["sync_steps"]):
            return True
        last = elapsed
    return False


def _paced_steps(ft: dict[str, Any], record: dict[str, Any]) -> int:
    """Inner steps of a round: `sync_steps`, or under time pacing the first step at which
    round_is_up said the round was up, from the recorded seconds at each step's end."""
    if ft["round_pacing"] != "time":
        return int(ft["sync_steps"])
    if "pacing_elapsed_s" not in record:
        raise ConfigError(f"outer step {record['outer_step']}: a time-paced record without pacing_elapsed_s "
                          "(written before runs recorded it): this run cannot be replayed")
    previous = 0.0
    for n, elapsed in enumerate(record["pacing_elapsed_s"], start=1):
        if round_is_up(n, ft["min_inner_steps"], ft["max_inner_steps"], elapsed, elapsed - previous,
                       ft["round_seconds"]):
            return n
        previous = elapsed
    return -1  # no recorded step ended the round: not reproduced
