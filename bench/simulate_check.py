"""The simulator (`archipelago simulate`) against measured federations of 2 and 3 islands.

Each setting runs for real first: `archipelago local` with 1-rank islands of llama3
`debug`, made unlike by emulation (`--slowdown`), steps- or time-paced, for a wall-clock
budget (bench/heterogeneous.py's commands and measures). Then the simulator runs the same
federation from what the run measured of its inputs only:

* each island's step time: the median of its rounds' compute seconds per inner step;
* the link: the rate at which the island that waited least (the slowest) got its rows,
  its bytes received over its median sync seconds (the exchange, and the round's
  bookkeeping, as seen by the island nobody waits for);
* the window: the measured one (from the join to the last outer step).

and predicts what the run then did: each island's utilisation (compute seconds over the
window) and the rounds after the join. Table, ratio first: simulated / measured.

    python bench/simulate_check.py [--budget 90] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, num, outer_steps, read_summary, run_job, run_main, work_root, write_json  # noqa: E402
from heterogeneous import island_stats, run_cmd, slowdowns_of  # noqa: E402

from archipelago.federation.simulate import exchange_bytes, scenario_from_dict  # noqa: E402
from archipelago.federation.simulate_cli import simulate  # noqa: E402

# (speeds, setting): bench/heterogeneous.py's settings for 2 and 3 islands.
CASES = [("1:3", "fixed-tokens"), ("1:3", "time-tokens"), ("1:1:2", "fixed-tokens"), ("1:1:2", "time-tokens")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/federation.toml")
    p.add_argument("--budget", type=float, default=90.0, help="wall-clock seconds of training per run")
    p.add_argument("--sync-steps", type=int, default=10)
    p.add_argument("--round-seconds", type=float, default=15.0, help="time pacing's round length")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--root", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def measured_inputs(run_dir: Path, islands: int, ft: Any, params: int) -> dict[str, Any]:
    """What the simulator is given: step times and the link rate (at which the simulated
    exchange, its bytes as the simulator counts them, takes the measured seconds)."""
    records = [outer_steps(run_dir / f"island-{k}")[1:] for k in range(islands)]  # without the join
    step_s = [statistics.median(r["compute_s"] / r["inner_steps"] for r in rs if r["inner_steps"]) for rs in records]
    slowest = max(range(islands), key=lambda k: step_s[k])
    rows = [r for r in records[slowest] if r.get("bytes_received")]
    exchange_s = statistics.median(r["sync_s"] for r in rows)
    received = statistics.median(r["bytes_received"] for r in rows)
    modelled = exchange_bytes(ft, params, islands)
    return {"step_s": step_s, "exchange_s": exchange_s, "received": received, "modelled_received": modelled,
            "mbit": modelled * 8 / exchange_s / 1e6}


def federation_settings(args: argparse.Namespace, setting: str) -> dict[str, Any]:
    """The run's [fault_tolerance] as the simulator reads it: the config's, with the bench's pacing."""
    from archipelago.config.loading import read_toml

    ft = dict(read_toml(args.config).get("fault_tolerance", {}))
    ft.update(sync_steps=args.sync_steps, round_pacing="time" if setting.startswith("time") else "steps",
              round_seconds=args.round_seconds, outer_weighting="tokens")
    return ft


def simulated(args: argparse.Namespace, inputs: dict[str, Any], ft: dict[str, Any], params: int) -> Any:
    # Rounds start until the budget is spent from the join's end, as the islands' time budget does.
    scenario = scenario_from_dict({
        "simulation": {"hours": (inputs["exchange_s"] + args.budget) / 3600, "params": params},
        "fault_tolerance": ft,
        "islands": [{"step_s": s, "tokens_per_step": args.batch_size * args.seq_len,
                     "bandwidth_mbit": inputs["mbit"], "latency_ms": 0.0} for s in inputs["step_s"]]})
    return simulate(scenario)


def check(args: argparse.Namespace, root: Path, speeds: str, setting: str) -> dict[str, Any]:
    name = f"{speeds.replace(':', 'x')}-{setting}"
    run_dir = root / name
    bench_args = argparse.Namespace(**vars(args))
    run = run_job(run_cmd(bench_args, speeds, setting, run_dir, args.round_seconds), root / f"{name}.log",
                  args.timeout, None)
    if run.exit_code != 0:
        raise RuntimeError(f"{name} failed (exit code {run.exit_code}); see {root / f'{name}.log'}")
    factors = slowdowns_of(speeds)
    measured = [island_stats(run_dir / f"island-{k}", k, f) for k, f in enumerate(factors)]
    params = int(read_summary(run_dir / "island-0", required=True)["params"])
    ft = federation_settings(args, setting)
    inputs = measured_inputs(run_dir, len(factors), scenario_from_dict(
        {"fault_tolerance": ft, "islands": [{}]}).ft, params)
    window = statistics.fmean(i["window_s"] for i in measured)
    report = simulated(args, inputs, ft, params)
    sim_window = report.ended_s - report.joined_s
    sim_util = [s.compute_s / sim_window for s in report.islands]
    return {"speeds": speeds, "setting": setting, "run_dir": str(run_dir), "inputs": inputs, "window_s": window,
            "simulated_window_s": sim_window,
            "measured_utilisation": [i["utilisation"] for i in measured],
            "simulated_utilisation": sim_util,
            "measured_rounds": max(i["rounds"] for i in measured), "simulated_rounds": report.committed - 1,
            "measured_inner_steps": [i["inner_steps"] for i in measured],
            "simulated_inner_steps": [round(s.compute_s / step) for s, step in zip(report.islands, inputs["step_s"])]}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| utilisation, simulated / measured | rounds, simulated / measured | islands | pacing "
          "| utilisation measured | simulated | rounds measured | simulated | step s | link Mbit/s |")
    print("|---|---:|---|---|---|---|---:|---:|---|---:|")
    for r in rows:
        ratios = " / ".join(f"{s / m:.3f}" for s, m in zip(r["simulated_utilisation"], r["measured_utilisation"]))
        print(f"| {ratios} | {r['simulated_rounds'] / r['measured_rounds']:.3f} | {r['speeds']} "
              f"| {r['setting'].split('-')[0]} | {' / '.join(f'{u:.3f}' for u in r['measured_utilisation'])} "
              f"| {' / '.join(f'{u:.3f}' for u in r['simulated_utilisation'])} | {r['measured_rounds']} "
              f"| {r['simulated_rounds']} | {' / '.join(f'{s:.2f}' for s in r['inputs']['step_s'])} "
              f"| {num(r['inputs']['mbit'], '.0f')} |")


def main() -> None:
    args = parse_args()
    root = work_root(args.root, "archipelago-simcheck-")
    rows = []
    for speeds, setting in CASES:
        rows.append(check(args, root, speeds, setting))
        print_table(rows[-1:])
    print_table(rows)
    if args.out:
        write_json(args.out, {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": rows})


if __name__ == "__main__":
    run_main(main)
