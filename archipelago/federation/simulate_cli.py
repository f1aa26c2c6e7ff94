"""`archipelago simulate`: the command, and `simulate()`, which runs a scenario in its round mode.

The synchronous rounds are simulate.py's `Simulation`, the decoupled ones
simulate_decoupled.py's `DecoupledSimulation` (docs/scale.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from archipelago.config.errors import ConfigError
from archipelago.federation.simulate import (
    Report,
    Scenario,
    Simulation,
    _validate,
    format_report,
    load_scenario,
    scaled,
)
from archipelago.federation.simulate_decoupled import DecoupledSimulation


def simulate(scenario: Scenario, fail_at: list[tuple[int, float]] | None = None) -> Report:
    """Run the scenario in its `round_mode` (decoupled rounds: simulate_decoupled.py)."""
    if scenario.ft.round_mode == "decoupled":
        return DecoupledSimulation(scenario, fail_at).run()
    return Simulation(scenario, fail_at).run()



SIMULATE_HELP = """\
Simulate a federation of islands on a simulated clock (no training, no sockets): the
platform's round pacing, joins, weights and codec sizes, with the islands' speeds, links
and failures from a scenario file. Prints utilisation per group of islands, goodput,
outer steps per hour, bytes received and the time lost to failures (docs/scale.md).
"""


def cli(argv: list[str]) -> int:
    """`archipelago simulate SCENARIO [--islands N ...] [--hours H] [--seed S] [--json FILE]`."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="archipelago simulate", description=SIMULATE_HELP)
    p.add_argument("scenario", nargs="?", help="scenario TOML file (configs/scenarios/*.toml)")
    p.add_argument("--replay", type=Path, default=None, metavar="RUN_DIR",
                   help="instead: replay a recorded `archipelago local` run's rounds through the simulator's "
                        "decisions and list every round where they differ from the record")
    p.add_argument("--islands", type=int, nargs="+", default=None,
                   help="scale the scenario's groups to these island counts, one run each")
    p.add_argument("--hours", type=float, default=None, help="simulated hours (default: the scenario's)")
    p.add_argument("--seed", type=int, default=None, help="failure times' seed (default: the scenario's)")
    p.add_argument("--round-mode", choices=("synchronous", "decoupled"), default=None,
                   help="replace the scenario's fault_tolerance.round_mode (docs/rounds.md)")
    p.add_argument("--arrival-steps", type=int, default=None, metavar="N",
                   help="replace the scenario's fault_tolerance.arrival_steps: decoupled rounds apply each "
                        "overlapped exchange N inner steps into the next round (docs/rounds.md)")
    p.add_argument("--exchange-retries", type=int, default=None, metavar="N",
                   help="replace the scenario's fault_tolerance.exchange_retries: deaths a round's exchange survives")
    p.add_argument("--repair", choices=("restart", "segment"), default=None,
                   help="replace the scenario's simulation.repair: after a death, run the whole exchange again "
                        "(restart, the platform's) or only the dead member's segment (segment, not built yet)")
    p.add_argument("--json", type=Path, default=None, help="write every run's summary here as JSON")
    args = p.parse_args(argv)
    if args.replay is not None:
        return _replay(args.replay)
    if args.scenario is None:
        p.error("give a scenario file, or --replay RUN_DIR")
    scenario = load_scenario(args.scenario)
    settings = replace(scenario.settings, **{k: v for k, v in (("hours", args.hours), ("seed", args.seed),
                                                               ("repair", args.repair)) if v is not None})
    ft = replace(scenario.ft, **{k: v for k, v in (("round_mode", args.round_mode),
                                                   ("exchange_retries", args.exchange_retries),
                                                   ("arrival_steps", args.arrival_steps)) if v is not None})
    scenario = replace(scenario, settings=settings, ft=ft)
    _validate(scenario, args.scenario)
    runs = []
    for count in args.islands or [len(scenario.islands)]:
        s = scaled(scenario, count) if args.islands else scenario
        report = simulate(s)
        print(f"\n## {len(s.islands)} islands, {settings.hours:g} h, {s.ft.codec}, {s.ft.round_pacing} pacing, "
              f"{s.ft.round_mode} rounds\n\n{format_report(report, s.groups)}")
        runs.append(report.summary())
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _replay(run_dir: Path) -> int:
    from archipelago.federation.replay import compare, recorded

    if not (run_dir / "federation.json").is_file():
        raise ConfigError(f"{run_dir}: no federation.json; replay a run directory of `archipelago local`")
    rounds = recorded(run_dir)
    differ = compare(run_dir)
    print(f"{run_dir}: {len(rounds)} island-rounds over {len({r.outer_step for r in rounds})} outer steps")
    for want, got in differ:
        print(f"  differs: recorded {want}\n           replayed {got}")
    print("the replay reproduces every round (participants, inner steps, weights)" if not differ
          else f"{len(differ)} island-rounds differ")
    return 0 if not differ else 1
