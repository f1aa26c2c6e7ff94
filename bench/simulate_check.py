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
window) and the rounds after the join. Table, ratio first: simulated / measured. In the kill
case the simulator is also told when the island died (the survivors' round end at which
its row was in flight) and that it never came back, and detects it after the heartbeat
timeout; the survivors' utilisation and rounds are compared.

With `--wan FILE` it checks a throttled island instead, from a finished `bench/wan.py` run
(FILE: its --out, whose run directories must still exist) of settings c (synchronous, int8)
and h (decoupled, int8) with one thin link (`--island-rates 100,100,5`): the thin link's
rate is calibrated on the synchronous run only (the rate at which the exchange, as the
simulator counts its bytes, takes the median seconds the island that waited least spent in
it), each run gives its own step times, and the simulator predicts both runs' utilisation
and round ends, the decoupled one with a link it never saw overlapped. The decoupled run is
compared over its steady rounds (bench/wan.py's `utilisation_steady`): the simulator does
not model the first exchange, which the platform waits for to measure it, nor the wait for
the last one at the end.

    python bench/simulate_check.py [--budget 90] [--out FILE]
    python bench/simulate_check.py --wan bench/results/wan-thin-5-cpu.json [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, num, outer_steps, read_summary, run_job, run_main, work_root, write_json  # noqa: E402
from heterogeneous import island_stats, run_cmd, slowdowns_of  # noqa: E402
from wan import steady_utilisation  # noqa: E402

from archipelago.federation.simulate import exchange_bytes, scenario_from_dict  # noqa: E402
from archipelago.federation.simulate_cli import simulate  # noqa: E402

# (speeds, setting): bench/heterogeneous.py's settings for 2 and 3 islands; "kill": island 2
# of 3 equal islands is SIGKILLed with its row of outer step KILL_AT in flight (the others
# retry that exchange without it once the lighthouse dropped it, after HEARTBEAT_MS).
CASES = [("1:3", "fixed-tokens"), ("1:3", "time-tokens"), ("1:1:2", "fixed-tokens"), ("1:1:2", "time-tokens"),
         ("1:1:1", "fixed-tokens-kill")]
KILL_AT, HEARTBEAT_MS = 4, 500


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
    p.add_argument("--wan", type=Path, default=None, help="check a bench/wan.py run with a thin link instead")
    p.add_argument("--only", default=None, help="run only the cases whose setting contains this (e.g. kill)")
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


def simulated(args: argparse.Namespace, inputs: dict[str, Any], ft: dict[str, Any], params: int,
              died_after_join_s: float | None = None) -> Any:
    # Rounds start until the budget is spent from the join's end, as the islands' time budget does.
    raw = {"simulation": {"hours": (inputs["exchange_s"] + args.budget) / 3600, "params": params,
                          "detect_s": HEARTBEAT_MS / 1000},
           "fault_tolerance": ft,
           "islands": [{"step_s": s, "tokens_per_step": args.batch_size * args.seq_len,
                        "bandwidth_mbit": inputs["mbit"], "latency_ms": 0.0, "restart_s": 1e9}
                       for s in inputs["step_s"]]}
    if died_after_join_s is None:
        return simulate(scenario_from_dict(raw))
    joined = simulate(scenario_from_dict(raw)).joined_s  # the same clock without the failure
    return simulate(scenario_from_dict(raw), fail_at=[(len(inputs["step_s"]) - 1, joined + died_after_join_s)])


def death_after_join(run_dir: Path) -> float:
    """Seconds from the join's end to the round end at which the killed island handed its
    row off: the survivors' round whose exchange was run again, less its sync seconds."""
    records = outer_steps(run_dir / "island-0")
    retried = next(r for r in records if r.get("retries"))
    return float(retried["time"] - retried["sync_s"] - records[0]["time"])


def check(args: argparse.Namespace, root: Path, speeds: str, setting: str) -> dict[str, Any]:
    name = f"{speeds.replace(':', 'x')}-{setting}"
    run_dir = root / name
    bench_args = argparse.Namespace(**vars(args))
    kill = setting.endswith("-kill")
    cmd = run_cmd(bench_args, speeds, setting.removesuffix("-kill"), run_dir, args.round_seconds)
    if kill:
        cmd += ["--inject", f"2:die_in_exchange@{KILL_AT}", "--heartbeat-timeout-ms", str(HEARTBEAT_MS)]
    run = run_job(cmd, root / f"{name}.log", args.timeout, None)
    if run.exit_code != 0 and not kill:  # `local` exits non-zero when an island was killed
        raise RuntimeError(f"{name} failed (exit code {run.exit_code}); see {root / f'{name}.log'}")
    factors = slowdowns_of(speeds)
    counted = len(factors) - 1 if kill else len(factors)  # the killed island's own figures end at its death
    measured = [island_stats(run_dir / f"island-{k}", k, f) for k, f in enumerate(factors[:counted])]
    params = int(read_summary(run_dir / "island-0", required=True)["params"])
    ft = federation_settings(args, setting.removesuffix("-kill"))
    inputs = measured_inputs(run_dir, counted, scenario_from_dict(
        {"fault_tolerance": ft, "islands": [{}]}).ft, params)
    if kill:
        # The survivors' mean step time over the window, not the median: three islands share
        # the two cores until the kill, two after it, and their steps speed up by half then
        # (the simulator has one step time per island). The dead island was their equal.
        inputs["step_s"] = [i["compute_s"] / i["inner_steps"] for i in measured]
        inputs["step_s"] = [*inputs["step_s"], statistics.fmean(inputs["step_s"])]
    window = statistics.fmean(i["window_s"] for i in measured)
    report = simulated(args, inputs, ft, params, death_after_join(run_dir) if kill else None)
    sim_window = report.ended_s - report.joined_s
    sim_util = [s.compute_s / sim_window for s in report.islands][:counted]
    return {"speeds": speeds, "setting": setting, "run_dir": str(run_dir), "inputs": inputs, "window_s": window,
            "simulated_window_s": sim_window,
            "measured_utilisation": [i["utilisation"] for i in measured],
            "simulated_utilisation": sim_util,
            "measured_rounds": max(i["rounds"] for i in measured), "simulated_rounds": report.committed - 1,
            "measured_inner_steps": [i["inner_steps"] for i in measured],
            "simulated_inner_steps": [round(s.compute_s / step) for s, step in zip(report.islands, inputs["step_s"])],
            "measured_retries": sum(int(r.get("retries") or 0) for r in outer_steps(run_dir / "island-0"))}


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


def wan_check(path: Path) -> list[dict[str, Any]]:
    """Calibrate on the wan run's synchronous setting (c), predict it and the decoupled one (h)."""
    from archipelago.config.loading import read_toml

    run = json.loads(path.read_text())
    runs = {key: run["settings"][key] for key in ("c", "h")}
    if not all(r.get("ok") for r in runs.values()):
        raise SystemExit(f"{path}: settings c and h must both have run (bench/wan.py --settings c,h)")
    if "time" in " ".join(run.get("extra", [])):
        raise SystemExit(f"{path}: a time-paced run; the check models bench/wan.py's step-paced rounds only")
    islands, params = int(run["islands"]), int(run["params"])
    ft = dict(read_toml(REPO / "configs/llama3/debug.toml").get("fault_tolerance", {}))
    ft.update(codec="int8", sync_steps=int(run["sync_steps"]), round_pacing="steps", outer_weighting="tokens")
    sync_dir = Path(runs["c"]["run_dir"])
    records = [outer_steps(sync_dir / f"island-{k}")[1:] for k in range(islands)]
    waited = [min(r["sync_s"] for r in rows) for rows in zip(*records)]  # per round: the exchange itself
    exchange_s = statistics.median(waited)
    modelled = exchange_bytes(scenario_from_dict({"fault_tolerance": ft, "islands": [{}]}).ft, params, islands)
    thin = min(range(islands), key=lambda k: run["rates"][k])
    mbit = [modelled * 8 / exchange_s / 1e6 if k == thin else float(rate) for k, rate in enumerate(run["rates"])]
    rows = []
    for key, mode in (("c", "synchronous"), ("h", "decoupled")):
        r = runs[key]
        step_s = r["compute_s_per_step"]  # each run's own, as the other checks; the link is c's
        outers = [outer_steps(Path(r["run_dir"]) / f"island-{k}") for k in range(islands)]
        trained = [[o for o in rs[1:] if o.get("inner_steps")] for rs in outers]
        if mode == "synchronous":  # the whole window, as the other checks
            window = [float(rs[-1]["time"] - rs[0]["time"]) for rs in outers]
            measured, measured_rounds = r["utilisation"], max(len(t) for t in trained)
        else:
            # The steady rounds (bench/wan.py's utilisation_steady): the simulator does not
            # model the first exchange, which the platform waits for to measure it, nor the
            # wait for the last one at the end of the run.
            window = [float(t[-1]["time"] - t[0]["time"]) for t in trained]
            measured = [steady_utilisation(rs) for rs in outers]
            # Round ends in it, by inner steps (the round end that hands off the first overlapped
            # exchange finishes none, so the next record covers two rounds).
            measured_rounds = max(round(sum(o["inner_steps"] for o in t[1:]) / ft["sync_steps"]) for t in trained)
        scenario = scenario_from_dict({
            "simulation": {"hours": statistics.fmean(window) / 3600, "params": params},
            "fault_tolerance": {**ft, "round_mode": mode},
            "islands": [{"step_s": s, "tokens_per_step": run["batch_size"] * run["seq_len"], "bandwidth_mbit": m,
                         "latency_ms": 0.0} for s, m in zip(step_s, mbit)]})
        report = simulate(scenario)
        span = report.ended_s - report.joined_s if mode == "synchronous" else statistics.fmean(window)
        rows.append({"speeds": "/".join(f"{m:.1f}" for m in mbit) + " Mbit/s", "setting": mode,
                     "run_dir": r["run_dir"], "inputs": {"step_s": step_s, "mbit": mbit[thin],
                                                         "exchange_s": exchange_s, "modelled_received": modelled},
                     "window_s": statistics.fmean(window), "measured_utilisation": measured,
                     "simulated_utilisation": [s.compute_s / span for s in report.islands],
                     "measured_rounds": measured_rounds,
                     "simulated_rounds": report.committed - 1 if mode == "synchronous" else report.committed})
    return rows


def main() -> None:
    args = parse_args()
    if args.wan is not None:
        rows = wan_check(args.wan)
        print_table(rows)
        if args.out:
            write_json(args.out, {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": rows})
        return
    root = work_root(args.root, "archipelago-simcheck-")
    rows = []
    for speeds, setting in CASES:
        if args.only and args.only not in setting:
            continue
        rows.append(check(args, root, speeds, setting))
        print_table(rows[-1:])
    print_table(rows)
    if args.out:
        write_json(args.out, {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": rows})


if __name__ == "__main__":
    run_main(main)
