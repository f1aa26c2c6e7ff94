"""Goodput of the round modes at 10 to 1,000 islands, simulated (`archipelago simulate`).

For each shipped scenario (configs/scenarios/mixed-speeds.toml, continents.toml), each
island count and each failure seed, four ways to run the rounds, all from the same file:

* `before`: synchronous rounds as main had them before exchange retries
  (`exchange_retries = 0`: a death inside the exchange loses the round);
* `sync+retry`: synchronous rounds with the platform's default `exchange_retries = 2`
  (the survivors run the exchange again);
* `decoupled`: `round_mode = "decoupled"`, the whole exchange run again after each
  death (as the platform's retry does), as many times as it takes;
* `decoupled+segment`: the same with only the dead member's segment sent again
  (`simulation.repair = "segment"`, not built yet: what it would be worth).

Table, ratio first: each mode's goodput over `before`'s, mean over the report seeds (the
failure times; seed 0 was used while designing, so it is left out by default), with the
spread, staleness and rounds lost.

    python bench/rounds_scale.py [--seeds 1 2 3] [--hours H] [--mtbf H] [--out bench/results/rounds-scale.json]

docs/scale.md's first table (synchronous rounds without retries, the file's failure seed
0, the file's failure rates, once a week, none):
`--modes before --seeds 0 --islands 10 100 1000 [--mtbf 168 | --mtbf 0]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    REPO,
    where_measured,
    write_json,
)

from archipelago.federation.simulate import Scenario, load_scenario, scaled  # noqa: E402
from archipelago.federation.simulate_cli import simulate  # noqa: E402

SCENARIOS = {"mixed-speeds": (10, 100, 1000), "continents": (14, 100, 1000)}
MODES = {  # name: (round_mode, exchange_retries (None: the island count), repair)
    "before": ("synchronous", 0, "restart"),
    "sync+retry": ("synchronous", 2, "restart"),
    "decoupled": ("decoupled", None, "restart"),
    "decoupled+segment": ("decoupled", None, "segment"),
}


def run(scenario: Scenario, islands: int, mode: str, seed: int, hours: float | None,
        mtbf_hours: float | None = None) -> dict[str, Any]:
    round_mode, retries, repair = MODES[mode]
    s = scaled(scenario, islands)
    if mtbf_hours is not None:
        s = replace(s, groups=[replace(g, mtbf_hours=mtbf_hours) for g in s.groups])
    settings = replace(s.settings, seed=seed, repair=repair, hours=hours or s.settings.hours)
    ft = replace(s.ft, round_mode=round_mode, exchange_retries=islands if retries is None else retries)
    began = time.perf_counter()
    summary = simulate(replace(s, settings=settings, ft=ft)).summary()
    return {"mode": mode, "islands": islands, "seed": seed, "seconds": time.perf_counter() - began, **summary}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| goodput / before | goodput (spread) | mode | scenario | islands | staleness mean / max "
             "| rounds lost | outer steps |", "|---:|---|---|---|---:|---|---:|---:|"]
    keyed: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["scenario"], r["islands"], r["mode"]), []).append(r)
    for (name, islands, mode), runs in keyed.items():
        good = [r["goodput"] for r in runs]
        before = statistics.fmean(r["goodput"] for r in keyed[(name, islands, "before")])
        ratio = f"{statistics.fmean(good) / before:.2f}" if before > 0 else "inf" if statistics.fmean(good) else "-"
        spread = f"{statistics.fmean(good):.1%} ({min(good):.1%}-{max(good):.1%})"
        stale = (f"{statistics.fmean(r['staleness_mean'] for r in runs):.2f} / "
                 f"{max(r['staleness_max'] for r in runs)}") if mode.startswith("decoupled") else "-"
        lost = statistics.fmean(r["failed_rounds"] for r in runs)
        steps = statistics.fmean(r["outer_steps"] for r in runs)
        lines.append(f"| {ratio} | {spread} | {mode} | {name} | {islands} | {stale} | {lost:.1f} | {steps:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="failure seeds to report on")
    p.add_argument("--islands", type=int, nargs="+", default=None, help="island counts (default: per scenario)")
    p.add_argument("--hours", type=float, default=None, help="simulated hours (default: each scenario's)")
    p.add_argument("--mtbf", type=float, default=None,
                   help="every island's mean time between failures, hours (0: none; default: each scenario's)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--out", type=Path, default=REPO / "bench/results/rounds-scale.json")
    args = p.parse_args()
    rows = []
    for name, counts in SCENARIOS.items():
        scenario = load_scenario(REPO / "configs/scenarios" / f"{name}.toml")
        for islands in args.islands or counts:
            for mode in ["before", *[m for m in args.modes if m != "before"]]:
                for seed in args.seeds:
                    row = {"scenario": name, **run(scenario, islands, mode, seed, args.hours, args.mtbf)}
                    rows.append(row)
                    print(f"{name} {islands} {mode} seed {seed}: goodput {row['goodput']:.1%} "
                          f"({row['seconds']:.1f} s)", flush=True)
    print("\n" + table(rows))
    write_json(args.out, {"where": where_measured(), "seeds": args.seeds, "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
