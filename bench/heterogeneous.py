"""Heterogeneous islands: round pacing and outer weighting at an equal wall-clock budget.

Two 1-rank islands of llama3 debug on Shakespeare (`archipelago local --islands 1,1`), one
made slower by emulation (`--slowdown 1,3`: island 1 sleeps 2x each inner step's compute
time after it, so its steps take 3x as long), with 1:1 as the control. Every run gets the
same wall-clock budget (`--training.time_budget_s`: an island stops at the first outer
step after that many seconds from joining, then evaluates the validation loss). Three
settings per speed ratio:

1. fixed-equal:  round_pacing steps, outer_weighting equal (plain DiLoCo; the baseline)
2. fixed-tokens: round_pacing steps, outer_weighting tokens
3. time-tokens:  round_pacing time (round_seconds), outer_weighting tokens

Measured per island from its `outer_step` records (RUN_DIR/island-K/metrics.jsonl); the
first record is the join round (no inner steps) and is left out:

* utilisation = sum(compute_s) / (time of the last record - time of the join record),
  i.e. the fraction of the island's training window spent in inner steps. compute_s
  includes the emulated slowdown (a slow island's sleep is its "compute"); the rest of
  the window is sync_s (blocked at the outer step: waiting for the slower island, the
  all-reduce) plus small per-round overheads (logging, hashing the global weights);
* tokens and inner steps: sums of the records' `tokens` / `inner_steps`;
* wait_s: sum of sync_s.

Per run: the validation loss at the end (summary.json `val_loss`, the mean over islands;
after the final outer step both hold the same global weights). The table compares every
run with the fixed-equal run of the same speed ratio (ratio first): the utilisation of
the least utilised island, and the validation loss.

Unless --round-seconds is given, time pacing uses the median round length of the slowest
island in the same speed's first fixed-steps run (its compute_s per round), so both
pacings synchronise about equally often. Under time pacing an island ends its round
within about half a step of round_seconds, so the faster one still waits up to about one
slow-island step per round, and every round pays the exchange (~0.5 s for llama3 debug
over loopback): keep rounds many steps long. The defaults (sync_steps 20, a 90 s budget)
give rounds of ~11 s at 1:1 and ~20 s at 1:3 on a 2-core CPU. Run directories are kept
under a new /tmp/bench-het-* folder (printed). Nothing here needs a network; islands
talk over loopback to an in-process lighthouse.

    python bench/heterogeneous.py [--budget 90] [--sync-steps 20] [--speeds 1:1,1:3] [--out FILE]

Defaults take about 13 minutes on a 2-core machine (6 runs of ~90 s training plus
start-up and validation).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Process handling shared by the benchmarks: a unique token in every started process's
# environment, everything carrying it killed by PID on timeout/error/Ctrl-C.
from harness import REPO, num, outer_steps, ratio, read_summary, run_job, run_main, work_root, write_json  # noqa: E402

from archipelago.metrics.islands import round_totals  # noqa: E402

# setting -> (round_pacing, outer_weighting)
SETTINGS: dict[str, tuple[str, str]] = {
    "fixed-equal": ("steps", "equal"),
    "fixed-tokens": ("steps", "tokens"),
    "time-tokens": ("time", "tokens"),
}
BASELINE = "fixed-equal"
FALLBACK_ROUND_S = 6.0  # time pacing without --round-seconds and no fixed-steps run to match


# ------------------------------------------------------------------ commands


def slowdowns_of(speed: str) -> list[float]:
    """"1:3" -> [1.0, 3.0]: each island's emulated slowdown factor."""
    return [float(x) for x in speed.split(":")]


def run_cmd(args: argparse.Namespace, speed: str, setting: str, run_dir: Path,
            round_s: float) -> list[str]:
    pacing, weighting = SETTINGS[setting]
    factors = slowdowns_of(speed)
    return [sys.executable, "-m", "archipelago.launch.cli", "local",
            "--islands", ",".join("1" for _ in factors), "--no-table",
            "--slowdown", ",".join(f"{f:g}" for f in factors),
            "--config", str(args.config), "--job.run_dir", str(run_dir),
            # A step count far out of reach: the time budget is what ends every run (under
            # time pacing steps x tokens/step x islands is the federation's token budget).
            "--training.steps", str(args.max_steps), "--training.time_budget_s", f"{args.budget:g}",
            "--fault_tolerance.sync_steps", str(args.sync_steps),
            "--fault_tolerance.round_pacing", pacing, "--fault_tolerance.round_seconds", f"{round_s:.3f}",
            "--fault_tolerance.outer_weighting", weighting,
            # val_every > 0 so the final step evaluates; no other evaluation, IO or logging cost.
            "--checkpoint.no_enable", "--metrics.no_tensorboard", "--training.val_every", str(args.max_steps),
            "--training.batch_size", str(args.batch_size), "--data.seq_len", str(args.seq_len)]


# ------------------------------------------------------------------ results


def island_stats(island_dir: Path, island: int, slowdown: float) -> dict[str, Any]:
    """Utilisation, tokens, inner steps of one island (see the module docstring)."""
    records = outer_steps(island_dir)
    if len(records) < 2:
        raise RuntimeError(f"{island_dir}: fewer than two outer_step records (no round after the join)")
    join, rounds = records[0], records[1:]
    summary = read_summary(island_dir)
    # utilisation, tokens, inner_steps, compute_s, wait_s, window_s: as in federation.json
    return {"id": island, "slowdown": slowdown, **round_totals(records),
            "rounds": len(rounds), "committed": sum(1 for r in rounds if r.get("committed")),
            "join_inner_steps": join.get("inner_steps"), "round_compute_s": [r["compute_s"] for r in rounds],
            "val_loss": summary.get("val_loss"), "summary_tokens": summary.get("tokens"),
            "summary_steps": summary.get("steps")}


def measure(args: argparse.Namespace, root: Path, speed: str, setting: str, round_s: float) -> dict[str, Any]:
    name = f"{speed.replace(':', 'x')}-{setting}"
    run_dir = root / name
    cmd = run_cmd(args, speed, setting, run_dir, round_s)
    result: dict[str, Any] = {"speed": speed, "setting": setting, "round_pacing": SETTINGS[setting][0],
                              "outer_weighting": SETTINGS[setting][1], "run_dir": str(run_dir), "cmd": cmd,
                              "round_seconds": round_s if SETTINGS[setting][0] == "time" else None}
    try:
        run = run_job(cmd, root / f"{name}.log", args.timeout, None)
        result.update(exit_code=run.exit_code, wall_s=run.wall_s)
        if run.exit_code != 0:
            raise RuntimeError(f"exit code {run.exit_code}; see {root / f'{name}.log'}")
        islands = [island_stats(run_dir / f"island-{k}", k, f) for k, f in enumerate(slowdowns_of(speed))]
    except (RuntimeError, KeyError, OSError, ValueError) as err:  # one bad run must not sink the rest
        print(f"  run {name} FAILED: {err}", file=sys.stderr, flush=True)
        result.update(error=str(err), islands=[], val_loss=None)
        return result
    losses = [i["val_loss"] for i in islands if i["val_loss"] is not None]
    result.update(islands=islands, val_loss=statistics.fmean(losses) if losses else None,
                  train_s=max(i["window_s"] for i in islands))
    return result


def matched_round_s(runs: list[dict[str, Any]], speed: str) -> float | None:
    """Median per-round compute_s of the slowest island in this speed's first fixed-steps
    run: the round length time pacing needs to synchronise as often as fixed steps did."""
    for run in runs:
        if run["speed"] == speed and run["round_pacing"] == "steps" and run["islands"]:
            per_round = zip(*(i["round_compute_s"] for i in run["islands"]))
            return statistics.median(max(r) for r in per_round)
    return None


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """Each run vs the baseline of the same speed: least-utilised island and val loss."""
    for run in runs:
        base = next((r for r in runs if r["speed"] == run["speed"] and r["setting"] == BASELINE), None)
        run["min_utilisation"] = min_util(run)
        run["min_utilisation_ratio"] = ratio(run["min_utilisation"], min_util(base) if base else None)
        run["val_loss_ratio"] = ratio(run["val_loss"], base["val_loss"] if base else None)


def min_util(run: dict[str, Any]) -> float | None:
    utils = [i["utilisation"] for i in run["islands"] if i["utilisation"] is not None]
    return min(utils) if utils else None


# ------------------------------------------------------------------ report


def per_island(run: dict[str, Any], key: str, fmt: str) -> str:
    return " / ".join(num(i[key], fmt) for i in run["islands"]) or "-"


def print_table(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"\nllama3 debug, 2 islands x 1 rank, batch {c['batch_size']} x {c['seq_len']} tokens per step, "
          f"budget {c['budget_s']:g} s per run, sync_steps {c['sync_steps']}; ratios vs {BASELINE} "
          "at the same speed; per-island columns: island 0 / island 1 (island 1 the slowed one); "
          "train s: join to last outer step (the budget ends a run at the first outer step after it)\n")
    print("| min-utilisation ratio | val-loss ratio | speed | setting | val loss | utilisation "
          "| tokens | inner steps | wait s | rounds | train s | round s |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in result["runs"]:
        if run.get("error"):
            print(f"| - | - | {run['speed']} | {run['setting']} | FAILED: {run['error']} | | | | | | | |")
            continue
        rounds = run["islands"][0]["rounds"] if run["islands"] else None
        print(f"| {num(run['min_utilisation_ratio'], '.2f')} | {num(run['val_loss_ratio'], '.3f')} "
              f"| {run['speed']} | {run['setting']} | {num(run['val_loss'], '.4f')} "
              f"| {per_island(run, 'utilisation', '.2f')} | {per_island(run, 'tokens', ',d')} "
              f"| {per_island(run, 'inner_steps', 'd')} | {per_island(run, 'wait_s', '.1f')} "
              f"| {num(rounds, 'd')} | {num(run['train_s'], '.1f')} | {num(run['round_seconds'], '.1f')} |")


# ------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/debug.toml")
    p.add_argument("--budget", type=float, default=90.0,
                   help="wall-clock training budget of every run, seconds (--training.time_budget_s)")
    p.add_argument("--sync-steps", type=int, default=20, help="inner steps per round under fixed-steps pacing")
    p.add_argument("--round-seconds", type=float, default=None,
                   help="round length under time pacing (default: the slow island's median round "
                        f"compute time in the same speed's fixed-steps run, else {FALLBACK_ROUND_S:g})")
    p.add_argument("--speeds", default="1:1,1:3",
                   help="comma-separated slowdown ratios island0:island1 (1:3: island 1 three times slower)")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated subset of {', '.join(SETTINGS)} (run in this order)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per island per inner step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--max-steps", type=int, default=100000,
                   help="training.steps: kept out of reach so that the budget ends every run")
    p.add_argument("--timeout", type=float, default=None, help="hard limit per run, seconds (default: budget + 300)")
    p.add_argument("--work-dir", type=Path, default=None, help="run directories (default: a new /tmp/bench-het-*)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args()
    args.speeds = [s.strip() for s in args.speeds.split(",") if s.strip()]
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
    for speed in args.speeds:
        try:
            factors = slowdowns_of(speed)
        except ValueError:
            p.error(f"--speeds: {speed!r} is not like 1:3")
        if len(factors) != 2 or min(factors) < 1:
            p.error(f"--speeds: {speed!r} needs two factors >= 1, like 1:3")
    if args.timeout is None:
        args.timeout = args.budget + 300  # start-up, the round that overruns the budget, validation


def run_all(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for speed in args.speeds:
        for setting in args.settings:
            round_s = args.round_seconds or matched_round_s(runs, speed) or FALLBACK_ROUND_S
            runs.append(measure(args, root, speed, setting, round_s))
    add_ratios(runs)
    return runs


def main() -> None:
    args = parse_args()
    root = work_root(args.work_dir, "bench-het-")
    started = time.time()
    runs = run_all(args, root)
    config = {"config": str(args.config), "budget_s": args.budget, "sync_steps": args.sync_steps,
              "round_seconds": args.round_seconds, "speeds": args.speeds, "settings": args.settings,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "max_steps": args.max_steps,
              "baseline": BASELINE, "work_dir": str(root), "total_wall_s": time.time() - started}
    result = {"config": config, "runs": runs}
    print_table(result)
    write_json(root / "results.json", result, announce=False)
    if args.out is not None:
        write_json(args.out, result)
    print(f"run directories and results.json: {root}")


if __name__ == "__main__":
    run_main(main)
