"""Decoupled rounds against synchronous ones, in the quality simulator (archipelago/quality_simulator.py).

Every run trains llama3 `debug` islands in one process (`simulate()`, lockstep, the
federation's outer step), with `fault_tolerance.no_average_optimizer_state` in BOTH round
modes (decoupled rounds exchange pseudo-gradients only) and the config otherwise as
shipped (configs/llama3/federation.toml: sync_steps 10, outer_lr 1, no outer momentum,
token weighting). Every run is evaluated on the same `--eval-windows` held-out windows at
its end.

A. Equal islands, equal tokens: 2 islands, synchronous against decoupled (no link ticks;
   every decoupled run has `overlap_threshold` 0, so each exchange overlaps the next round,
   staleness 1: at the default 0.05 an exchange this short is waited for and decoupled
   rounds are the synchronous round). Cost = decoupled / sync - 1.
B. Speeds 1:3 and 1:10 at equal wall-clock: 2 islands, the last `slow_period` 3 / 10 times
   slower, every exchange 3 ticks (`link_ticks` [3, 3]: a synchronous round idles every
   island 3 ticks after each 10-tick round, decoupled overlaps it), both stopped at tick
   `--wall-ticks` (schedules follow ticks). B takes A's tuned settings (2 islands, staleness
   1 as in A), so choosing B runs A's tuning too.
C. One thin-link island at equal wall-clock: 3 equal-speed islands, `link_ticks` [1, 1, 16]
   (the third island's exchange lasts 1.6 rounds, as a 20 Mbit/s island of
   configs/scenarios/mixed-speeds.toml), stopped at tick `--wall-ticks`. Baselines:
   synchronous with all 3 islands (each round waits 16 ticks) and synchronous without the
   thin island (2 islands, link_ticks [1, 1]); the method: decoupled with all 3.

Tuning, on `--tuning-seed` only, for A and C: decoupled takes the `staleness_exponent`
(`--exponents`) with the lowest final val loss; each synchronous baseline is tuned as
hard, over as many `outer_lr` values (`--outer-lrs`; the defaults match what the exponents
do to a staleness-1 contribution, whose weight is (1 + 1)^-a of its undiscounted share:
1, 0.71, 0.5). The report seeds (`--seeds`) then run with the chosen values only.
`max_staleness` keeps its default (4): it binds nowhere here (A and B's contributions enter
at staleness 1, C's thin island's at 2 or 3; the `dropped` column shows whether any was left
out).

`--arrival-steps N` makes every decoupled run apply each overlapped exchange N inner steps
into the next round (`fault_tolerance.arrival_steps`; its rows are then not stale).

Decoupled rounds end with the last contributions still in flight, so `val_loss` (island 0,
what it holds at the end, as the simulator evaluates) is also given drained:
`val_loss_drained`, the global weights once those contributions have entered (an outer step
with no more training, as a synchronous run's last round ends; in B and C it would take
extra wall-clock).

Prints the tuning table, then the comparisons (ratio first: method / baseline - 1 per seed,
paired by seed, then their mean), with the staleness of the contributions that entered.
`--out` gets machine, device, threads, torch, commit, each run's settings and numbers;
every finished run is also appended at once to `--log` (default: --out with .runs.jsonl),
which `--resume` reuses.

    python bench/rounds_quality.py --steps 120 --workers 2 --out bench/results/rounds-quality-cpu.json
    python bench/rounds_quality.py --only A --seeds 1 2 3 --tuning-seed 100
    python bench/rounds_quality.py --only A --config configs/llama3/compute-optimal.toml --steps 4300 \
        --eval-windows 512 --workers 2 --extra --training.batch_size 16 --training.val_offset 0

On a 2-core CPU shared with other work one 120-step run of 2 islands took 3 to 5.5 minutes
(one thread each, two at a time), and the whole benchmark at --steps 120 about 1 h 45 min.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, num, where_measured, write_json  # noqa: E402

FT = "--fault_tolerance."
COMMON = (f"{FT}enable", f"{FT}no_average_optimizer_state", f"{FT}no_adam_federation_batch")
SPEEDS = (3, 10)
THIN_LINKS = [1, 1, 16]


# ------------------------------------------------------------------ runs


def fmt(value: float) -> str:
    return f"{value:g}"


def sync_job(experiment: str, family: str, islands: int, lr: float, sim: dict[str, Any]) -> dict[str, Any]:
    return {"experiment": experiment, "family": family, "setting": f"{family} lr={fmt(lr)}", "islands": islands,
            "overrides": [f"{FT}round_mode=synchronous", f"{FT}outer_lr={fmt(lr)}"], "sim": sim}


def decoupled_job(experiment: str, family: str, islands: int, exponent: float,
                  sim: dict[str, Any], arrival: int = 0) -> dict[str, Any]:
    """`arrival` (--arrival-steps): each overlapped exchange applied that far into the next
    round (0: at its end)."""
    applied = [f"{FT}arrival_steps={arrival}"] if arrival else []
    return {"experiment": experiment, "family": family, "setting": f"{family} a={fmt(exponent)}", "islands": islands,
            "overrides": [f"{FT}round_mode=decoupled", f"{FT}staleness_exponent={fmt(exponent)}",
                          f"{FT}overlap_threshold=0", *applied], "sim": sim}


def jobs_a(lrs: list[float], exponents: list[float], arrival: int = 0) -> list[dict[str, Any]]:
    return ([sync_job("A", "sync", 2, lr, {}) for lr in lrs]
            + [decoupled_job("A", "decoupled", 2, a, {}, arrival) for a in exponents])


def jobs_b(lr: float, exponent: float, wall: int, arrival: int = 0) -> list[dict[str, Any]]:
    jobs = []
    for period in SPEEDS:
        sim = {"slow_period": period, "link_ticks": [3, 3], "wall_ticks": wall}
        jobs += [sync_job(f"B 1:{period}", f"sync 1:{period}", 2, lr, sim),
                 decoupled_job(f"B 1:{period}", f"decoupled 1:{period}", 2, exponent, sim, arrival)]
    return jobs


def jobs_c(lrs3: list[float], lrs2: list[float], exponents: list[float], wall: int,
           arrival: int = 0) -> list[dict[str, Any]]:
    thin = {"link_ticks": THIN_LINKS, "wall_ticks": wall}
    return ([sync_job("C", "sync-3", 3, lr, thin) for lr in lrs3]
            + [sync_job("C", "sync-2", 2, lr, {"link_ticks": [1, 1], "wall_ticks": wall}) for lr in lrs2]
            + [decoupled_job("C", "decoupled-3", 3, a, thin, arrival) for a in exponents])


def key(job: dict[str, Any]) -> str:
    """What makes two runs the same run (for --resume)."""
    return json.dumps([job["experiment"], job["setting"], job["islands"], job["overrides"], job["sim"],
                       job["seed"], job["steps"], job["eval_windows"], job["config"]]
                      + ([job["extra"]] if job.get("extra") else []), sort_keys=True)


def run_job(job: dict[str, Any], threads: int) -> dict[str, Any]:
    import torch

    import archipelago.quality_simulator as simulation
    from archipelago.config import load_config

    torch.set_num_threads(threads)
    cfg = load_config(["--config", job["config"], *job.get("extra", []), *COMMON, *job["overrides"],
                       "--training.steps", str(job["steps"]), "--training.seed", str(job["seed"])])
    captured: list[Any] = []

    class Recorded(simulation._Decoupled):  # the same rounds; only remembered for the drain below
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            captured.append(self)

    began = time.perf_counter()
    original, simulation._Decoupled = simulation._Decoupled, Recorded
    try:
        # drain False: the recorded table leaves the contributions still in flight at the end out
        # (it was measured before the platform let them in; simulate's default now does).
        result = simulation.simulate(cfg, job["islands"], eval_windows=job["eval_windows"], eval_every=0,
                                     **{"drain": False, **job["sim"]})
    finally:
        simulation._Decoupled = original
    row = {**job, "val_loss": result.final.val_loss, "tokens": result.final.tokens,
           "inner_steps": result.inner_steps, "bytes_sent": result.bytes_sent,
           "entered": len(result.staleness), "staleness": dict(sorted(Counter(result.staleness).items())),
           "mean_staleness": statistics.fmean(result.staleness) if result.staleness else None,
           "dropped": result.dropped, "curve": [[p.step, p.tokens, p.val_loss] for p in result.points]}
    if captured:
        row.update(drain(cfg, captured[0], job["eval_windows"]))
    row["seconds"] = time.perf_counter() - began
    return row


def drain(cfg: Any, rounds: Any, windows: int) -> dict[str, Any]:
    """Decoupled rounds end with the last contributions still in flight: island 0 (what
    `val_loss` evaluates) holds the global weights plus its own progress since its last
    hand-off, without the other islands'. `val_loss_drained` evaluates the global weights
    once every contribution in flight has entered (the exchanges finished, no more
    training), as a synchronous run's last round ends."""
    import archipelago.quality_simulator as simulation

    rounds.carry_the_rest()
    in_flight = len(rounds.in_flight)
    before = len(rounds.staleness)
    while rounds.in_flight:
        rounds.boundary += 1
        rounds.enter_due()
    island = rounds.islands[0]
    island.write(0, rounds.core.globals[0].detach().clone())
    judge = simulation.evaluation_task(cfg, windows)
    judge.prepare(log=lambda _m: None)
    metrics = simulation.evaluate(island.model, judge, island.device, island.dtype)
    return {"val_loss_drained": metrics["val_loss"], "drained_in_flight": in_flight,
            "drained_staleness": rounds.staleness[before:], "drained_dropped": rounds.dropped}


def _worker(args: tuple[dict[str, Any], int]) -> dict[str, Any]:
    return run_job(*args)


class Runner:
    """Runs jobs on a pool of worker processes; appends each finished run to the log at once,
    and reuses the log's runs with --resume."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rows, self.began = args, [], time.monotonic()
        self.done: dict[str, dict[str, Any]] = {}
        if args.resume and args.log.is_file():
            for line in args.log.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if "decoupled" in row["overrides"][0] and "val_loss_drained" not in row:
                        continue  # from before the drain was measured: run again
                    self.done[key(row)] = row
        self.pool = mp.get_context("spawn").Pool(args.workers)

    def run(self, jobs: list[dict[str, Any]], seed: int, phase: str) -> list[dict[str, Any]]:
        return self.run_many([(job, seed, phase) for job in jobs])

    def run_many(self, batch: list[tuple[dict[str, Any], int, str]]) -> list[dict[str, Any]]:
        a = self.args
        jobs = [{**job, "seed": seed, "phase": phase, "steps": a.steps, "eval_windows": a.eval_windows,
                 "config": str(a.config), "extra": a.extra} for job, seed, phase in batch]
        out, todo = [], []
        for job in jobs:
            if key(job) in self.done:
                row = {**self.done[key(job)], "phase": job["phase"], "reused": True}
                print(f"  {row['setting']} seed {row['seed']}: {row['val_loss']:.4f} (from {a.log})", flush=True)
                out.append(row)
            else:
                todo.append(job)
        for row in self.pool.imap_unordered(_worker, [(job, a.threads) for job in todo]):
            a.log.parent.mkdir(parents=True, exist_ok=True)
            with a.log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[{time.monotonic() - self.began:6.0f}s] {row['experiment']} {row['setting']} seed {row['seed']}: "
                  f"val loss {row['val_loss']:.4f} (drained {num(row.get('val_loss_drained'), '.4f')}), "
                  f"steps {row['inner_steps']}, staleness {row['staleness']}, "
                  f"dropped {row['dropped']} ({row['seconds']:.0f} s)", flush=True)
            out.append(row)
        self.rows += out
        return out

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def best(rows: list[dict[str, Any]], experiment: str, family: str) -> dict[str, Any]:
    """The tuning run of `family` with the lowest final val loss."""
    group = [r for r in rows if r["experiment"] == experiment and r["family"] == family]
    return min(group, key=lambda r: r["val_loss"])


def chosen(row: dict[str, Any]) -> float:
    """The tuned value of a tuning run: its outer_lr (sync) or staleness_exponent (decoupled).
    Looked up by name: other overrides (arrival_steps) may follow the tuned one."""
    name = f"{FT}outer_lr=" if row["family"].startswith("sync") else f"{FT}staleness_exponent="
    return next(float(o[len(name):]) for o in row["overrides"] if o.startswith(name))


# ------------------------------------------------------------------ report


def compare(rows: list[dict[str, Any]], label: str, experiment: str, method: str, baseline: str) -> dict[str, Any]:
    """`method` / `baseline` - 1 per report seed (paired), their mean and spread."""
    rep = [r for r in rows if r["phase"] == "report" and r["experiment"] == experiment]
    m = {r["seed"]: r for r in rep if r["setting"] == method}
    b = {r["seed"]: r for r in rep if r["setting"] == baseline}
    seeds = sorted(set(m) & set(b))
    cost = [m[s]["val_loss"] / b[s]["val_loss"] - 1 for s in seeds]
    drained = [m[s]["val_loss_drained"] / b[s]["val_loss"] - 1 for s in seeds if "val_loss_drained" in m[s]]
    mloss, bloss = [m[s]["val_loss"] for s in seeds], [b[s]["val_loss"] for s in seeds]
    stale: Counter[int] = Counter()
    for s in seeds:
        stale.update({int(k): v for k, v in m[s]["staleness"].items()})
    return {"comparison": label, "experiment": experiment, "method": method, "baseline": baseline, "seeds": seeds,
            "cost": statistics.fmean(cost) if cost else None, "cost_per_seed": cost,
            "cost_spread": max(cost) - min(cost) if cost else None,
            "drained_cost": statistics.fmean(drained) if drained else None, "drained_cost_per_seed": drained,
            "method_val_loss_drained": [m[s].get("val_loss_drained") for s in seeds],
            "method_val_loss": mloss, "baseline_val_loss": bloss,
            "method_mean": statistics.fmean(mloss) if mloss else None,
            "method_spread": max(mloss) - min(mloss) if mloss else None,
            "baseline_mean": statistics.fmean(bloss) if bloss else None,
            "baseline_spread": max(bloss) - min(bloss) if bloss else None,
            "method_tokens": [m[s]["tokens"] for s in seeds], "baseline_tokens": [b[s]["tokens"] for s in seeds],
            "method_inner_steps": [m[s]["inner_steps"] for s in seeds],
            "baseline_inner_steps": [b[s]["inner_steps"] for s in seeds],
            "entered": [m[s]["entered"] for s in seeds], "staleness": dict(sorted(stale.items())),
            "dropped": [m[s]["dropped"] for s in seeds]}


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"


def print_tuning(rows: list[dict[str, Any]], seed: int) -> None:
    tune = [r for r in rows if r["phase"] == "tuning"]
    if not tune:
        return
    print(f"\ntuning (seed {seed}): final val loss of every setting, ratio to the best of its experiment first\n")
    print("| val loss / best of experiment | val loss | drained val loss | tokens "
          "| inner steps | staleness (count) | dropped "
          "| experiment | setting |")
    print("|---:|---:|---:|---:|---|---|---:|---|---|")
    for exp in sorted({r["experiment"] for r in tune}):
        group = [r for r in tune if r["experiment"] == exp]
        low = min(r["val_loss"] for r in group)
        for r in sorted(group, key=lambda r: (r["family"], r["setting"])):
            stale = ", ".join(f"{k}: {v}" for k, v in r["staleness"].items()) or "-"
            print(f"| {r['val_loss'] / low:.4f} | {r['val_loss']:.4f} | {num(r.get('val_loss_drained'), '.4f')} "
                  f"| {r['tokens']:,} "
                  f"| {'/'.join(map(str, r['inner_steps']))} | {stale} | {r['dropped']} | {exp} | {r['setting']} |")


def print_comparisons(table: list[dict[str, Any]]) -> None:
    print("\nreport seeds: method / baseline - 1 (paired by seed; negative = the method is better); "
          "drained: the method's global weights once its contributions in flight at the end have entered\n")
    print("| method / baseline - 1 (mean) | per seed | drained method / baseline - 1 (mean) "
          "| method val loss (mean, spread) "
          "| baseline val loss (mean, spread) | tokens method / baseline (first seed) "
          "| contributions entered per run | staleness (count, all seeds) | dropped | comparison |")
    print("|---:|---|---:|---:|---:|---:|---|---|---|---|")
    for t in table:
        per = " ".join(f"s{s}: {pct(c)}" for s, c in zip(t["seeds"], t["cost_per_seed"]))
        stale = ", ".join(f"{k}: {v}" for k, v in t["staleness"].items()) or "-"
        tokens = (f"{t['method_tokens'][0]:,} / {t['baseline_tokens'][0]:,}" if t["seeds"] else "-")
        print(f"| {pct(t['cost'])} | {per} | {pct(t['drained_cost'])} "
              f"| {num(t['method_mean'], '.4f')} ({num(t['method_spread'], '.4f')}) "
              f"| {num(t['baseline_mean'], '.4f')} ({num(t['baseline_spread'], '.4f')}) | {tokens} "
              f"| {'/'.join(map(str, t['entered']))} | {stale} | {'/'.join(map(str, t['dropped']))} "
              f"| {t['comparison']}: {t['method']} vs {t['baseline']} |")


# ------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/federation.toml")
    p.add_argument("--steps", type=int, default=200, help="training.steps: inner steps per island (A), "
                   "the schedule's length (B, C) (default 200)")
    p.add_argument("--wall-ticks", type=int, default=0, help="B and C: stop at this tick (default: --steps)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="report seeds (default 1 2 3)")
    p.add_argument("--tuning-seed", type=int, default=100, help="the seed the tuning runs on (default 100)")
    p.add_argument("--only", default="A,B,C", help="experiments to run, comma-separated (default A,B,C)")
    p.add_argument("--exponents", type=float, nargs="+", default=[0.0, 0.5, 1.0],
                   help="decoupled: staleness_exponent values tuned (default 0 0.5 1)")
    p.add_argument("--outer-lrs", type=float, nargs="+", default=[1.0, 0.7, 0.5],
                   help="synchronous baselines: outer_lr values tuned (default 1 0.7 0.5)")
    p.add_argument("--arrival-steps", type=int, default=0, help="decoupled runs: each overlapped exchange enters "
                   "this many inner steps into the next round, the islands keeping their progress since "
                   "(fault_tolerance.arrival_steps; default 0: at the next round's end)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows every run evaluates (default 256)")
    p.add_argument("--workers", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/rounds-quality-cpu.json",
                   help="results JSON (default bench/results/rounds-quality-cpu.json)")
    p.add_argument("--log", type=Path, default=None, help="one JSON line per finished run (default: --out with "
                   ".runs.jsonl)")
    p.add_argument("--resume", action="store_true", help="reuse the runs --log already holds")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="anything after --extra overrides the config of every run, before the experiment's own "
                        "settings (e.g. --model.flavor tiny --training.batch_size 16)")
    args = p.parse_args()
    args.only = sorted({x.strip().upper() for x in args.only.split(",") if x.strip()})
    if not args.only or set(args.only) - {"A", "B", "C"}:
        p.error(f"--only takes A, B and/or C, not {args.only}")
    args.wall_ticks = args.wall_ticks or args.steps
    args.log = args.log or args.out.with_suffix(".runs.jsonl")
    return args


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the spawned workers inherit it
    meta = where_measured(threads_per_run=args.threads, workers=args.workers)
    began = time.monotonic()
    runner = Runner(args)
    want_a, want_b, want_c = ("A" in args.only or "B" in args.only), "B" in args.only, "C" in args.only
    choices: dict[str, Any] = {}
    table: list[dict[str, Any]] = []
    try:
        # Stage 1: A's tuning (B's settings come from it). Stage 2: A's report and C's
        # tuning. Stage 3: C's report and B.
        arrival = args.arrival_steps
        tune_a = jobs_a(args.outer_lrs, args.exponents, arrival)
        tune_c = jobs_c(args.outer_lrs, args.outer_lrs, args.exponents, args.wall_ticks, arrival)
        stage: list[tuple[dict[str, Any], int, str]] = []
        if want_a:
            rows = runner.run(tune_a, args.tuning_seed, "tuning")
            choices["A"] = {"outer_lr": chosen(best(rows, "A", "sync")),
                            "staleness_exponent": chosen(best(rows, "A", "decoupled"))}
            print(f"A chosen on seed {args.tuning_seed}: {choices['A']}", flush=True)
        if "A" in args.only:
            ca = choices["A"]
            stage += [(job, seed, "report") for seed in args.seeds
                      for job in jobs_a([ca["outer_lr"]], [ca["staleness_exponent"]], arrival)]
        if want_c:
            stage += [(job, args.tuning_seed, "tuning") for job in tune_c]
        rows = runner.run_many(stage)
        stage = []
        if want_c:
            tuned = [r for r in rows if r["phase"] == "tuning"]
            choices["C"] = {"sync-3 outer_lr": chosen(best(tuned, "C", "sync-3")),
                            "sync-2 outer_lr": chosen(best(tuned, "C", "sync-2")),
                            "staleness_exponent": chosen(best(tuned, "C", "decoupled-3"))}
            print(f"C chosen on seed {args.tuning_seed}: {choices['C']}", flush=True)
            cc = choices["C"]
            stage += [(job, seed, "report") for seed in args.seeds
                      for job in jobs_c([cc["sync-3 outer_lr"]], [cc["sync-2 outer_lr"]],
                                        [cc["staleness_exponent"]], args.wall_ticks, arrival)]
        if want_b:
            ca = choices["A"]
            stage += [(job, seed, "report") for seed in args.seeds
                      for job in jobs_b(ca["outer_lr"], ca["staleness_exponent"], args.wall_ticks, arrival)]
        runner.run_many(stage)
    finally:
        runner.close()
    rows = runner.rows
    if "A" in args.only:
        ca = choices["A"]
        table.append(compare(rows, "A equal islands, equal tokens", "A", f"decoupled a={fmt(ca['staleness_exponent'])}",
                             f"sync lr={fmt(ca['outer_lr'])}"))
    if want_b:
        ca = choices["A"]
        for period in SPEEDS:
            table.append(compare(rows, f"B speeds 1:{period}, equal wall-clock ({args.wall_ticks} ticks)",
                                 f"B 1:{period}", f"decoupled 1:{period} a={fmt(ca['staleness_exponent'])}",
                                 f"sync 1:{period} lr={fmt(ca['outer_lr'])}"))
    if want_c:
        cc = choices["C"]
        method = f"decoupled-3 a={fmt(cc['staleness_exponent'])}"
        table.append(compare(rows, f"C thin link, equal wall-clock ({args.wall_ticks} ticks)", "C", method,
                             f"sync-3 lr={fmt(cc['sync-3 outer_lr'])}"))
        table.append(compare(rows, f"C thin link, equal wall-clock ({args.wall_ticks} ticks)", "C", method,
                             f"sync-2 lr={fmt(cc['sync-2 outer_lr'])}"))
    wall = time.monotonic() - began
    print(f"\n{args.config.name} {' '.join(args.extra)}, training.steps {args.steps}, "
          f"wall ticks {args.wall_ticks} (B, C), "
          f"eval windows {args.eval_windows}, report seeds {' '.join(map(str, args.seeds))}, "
          f"tuning seed {args.tuning_seed}; chosen: {json.dumps(choices)}")
    print_tuning(rows, args.tuning_seed)
    print_comparisons(table)
    print(f"\n{len(rows)} runs ({sum(1 for r in rows if not r.get('reused'))} new) in {wall:.0f} s")
    meta.update({"load_average_at_end": list(os.getloadavg()), "wall_s": wall, "config": str(args.config),
                 "extra": args.extra, "steps": args.steps, "wall_ticks": args.wall_ticks,
                 "eval_windows": args.eval_windows, "seeds": args.seeds, "tuning_seed": args.tuning_seed,
                 "exponents": args.exponents, "outer_lrs": args.outer_lrs, "only": args.only,
                 "arrival_steps": args.arrival_steps,
                 "common_overrides": list(COMMON), "max_staleness": "default (4)"})
    write_json(args.out, {"meta": meta, "choices": choices, "comparisons": table,
                          "runs": sorted(rows, key=lambda r: (r["phase"], r["experiment"], r["setting"], r["seed"]))})


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # runs main's finally, which terminates the workers


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    main()
