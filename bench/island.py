"""Unlike ranks inside one island: how the batch split sets throughput.

A 2-rank island of llama3 debug on Shakespeare where rank 1 is emulated 2x slower
(`--island.rank_slowdown 1,2`: it waits as long again as its forward and backward took).
Settings, each a real `archipelago train --nproc 2` run in this one benchmark:

* even:    every rank takes batch/2 samples (the default; the fast rank waits half the step)
* hand:    SynerFuse's README split, 6 x 3 and 2 x 3 micro-batches of 24 (scaled to the batch):
           a 3:1 guess for a 2:1 gap
* planned: what `archipelago plan` measured and chose for these two ranks (run first, here)
* replanned: what `archipelago plan --from-run` chose from a run of the planned split (its
           ranks' idle shares and step time: each rank's speed as the island ran it, run
           first, here)
* rebalanced: `--parallelism.auto --parallelism.rebalance_after 4`: the island plans at start,
           then splits again from its own first records, in the one run (its throughput from
           the records after the re-plan)
* rebalanced-even: `--parallelism.rebalance_after 4` alone: from the even split, no profile
* ideal:   the sum of what each rank trains alone at its own speed (two 1-rank runs,
           rank_slowdown 1 and 2, at the same time, so that each shares the machine with the
           other as the island's ranks do): no waiting and no communication
* ideal-apart: the same two runs one after the other (each with the machine to itself: on
           one CPU faster than the island's ranks can be, which compete for memory bandwidth)
* pipeline-*: the same two ranks as a 2-stage pipeline (4 micro-batches): layers 3+3, and
           the layers `archipelago plan --parallelism.pipeline_stages 2` chose, under 1F1B and
           GPipe; and interleaved 1F1B with 2 stages per rank (layers 2,1,2,1: rank 0 holds
           stages 0 and 2, 4 layers, rank 1 stages 1 and 3, 2 layers)

Throughput is the median tokens/s of the step records after the first (warm-up) one; the
idle share of each rank is the median of the step records' `rank_idle` (measured: 1 - the
rank's CPU time plus emulated waits over the step's time), beside the pipeline bubble the
schedule's formula predicts.
Every rank runs one OpenMP thread (2 ranks share the machine's 2 cores); the 1-rank ideal
runs too, so a rank is the same speed alone as in the island. Table: ratio to ideal first,
then ratio to even.

    python bench/island.py [--steps 16] [--batch-size 24] [--repeats 3] [--settings even hand planned] [--out FILE]
    python bench/island.py --data-parallel ddp ...   # ranks that meet only at the step's end (default: fsdp)

About 10 minutes on a 2-core machine at --batch-size 48.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import num, ratio, read_jsonl, run_job, run_jobs, run_main, work_root, write_json  # noqa: E402

from archipelago.island.plan import bubble_fraction  # noqa: E402

SETTINGS = ("even", "hand", "planned", "replanned", "rebalanced", "rebalanced-even", "ideal", "ideal-apart",
            "pipeline-even-1f1b", "pipeline-planned-1f1b", "pipeline-planned-gpipe", "pipeline-interleaved")
HAND_COUNTS = 3  # SynerFuse's README example, 6 x 3 and 2 x 3 of 24: a 3:1 guess, scaled to the batch
SLOWDOWN = "1,2"


def _common(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return ["--config", "configs/llama3/debug.toml", "--training.steps", str(args.steps),
            "--training.batch_size", str(args.batch_size), "--training.val_every", "0", "--checkpoint.no_enable",
            "--metrics.no_tensorboard", "--metrics.log_every", "2", "--metrics.progress", "plain",
            "--lr_scheduler.warmup_steps", "2", "--parallelism.data_parallel", args.data_parallel,
            "--job.run_dir", str(run_dir)]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "archipelago.launch.cli", *args]


def tokens_per_s(run_dir: Path, after_step: int = 0) -> float:
    """The median over the step records after the first (its window holds the warm-up), and
    after `after_step` (a re-plan's step)."""
    rates = [r["tokens_per_s"] for r in read_jsonl(run_dir / "metrics.jsonl")
             if "tokens_per_s" in r and r["step"] > after_step]
    if len(rates) < 2:
        raise RuntimeError(f"{run_dir}: fewer than two step records")
    return statistics.median(rates[1:])


def rank_idle(run_dir: Path) -> list[float] | None:
    """Each rank's median idle share of a step (warm-up record left out)."""
    shares = [r["rank_idle"] for r in read_jsonl(run_dir / "metrics.jsonl") if "rank_idle" in r][1:]
    return [statistics.median(column) for column in zip(*shares)] if shares else None


def measured(run_dir: Path) -> tuple[float, list[float] | None]:
    return tokens_per_s(run_dir), rank_idle(run_dir)


def _succeeded(exit_code: int, log: Path) -> Path:
    """The run directory beside `log` (its name without .log), or an error naming the log."""
    if exit_code != 0:
        raise RuntimeError(f"{log.stem}: exit code {exit_code}; see {log}")
    return log.with_suffix("")


def _run(args: argparse.Namespace, root: Path, name: str, cmd: list[str]) -> Path:
    log = root / f"{name}.log"
    return _succeeded(run_job(cmd, log, args.timeout).exit_code, log)


def planned_split(args: argparse.Namespace, root: Path) -> tuple[str, str]:
    out = root / "plan.toml"
    _run(args, root, "plan", _cli("plan", "--nproc", "2", *_common(args, root / "plan-run"),
                                  "--island.rank_slowdown", SLOWDOWN, "--out", str(out)))
    fragment = tomllib.loads(out.read_text())["parallelism"]
    return fragment["micro_batch_size_per_rank"], fragment["num_micro_batches_per_rank"]


def _split_flags(split: tuple[str, str]) -> list[str]:
    return ["--parallelism.micro_batch_size_per_rank", split[0], "--parallelism.num_micro_batches_per_rank", split[1]]


def replanned_split(args: argparse.Namespace, root: Path, planned: tuple[str, str]) -> tuple[str, str]:
    """Train the planned split once, then re-plan from that run's step records."""
    ran = _run(args, root, "replan-run", _cli("train", "--nproc", "2", *_common(args, root / "replan-run"),
                                              "--island.rank_slowdown", SLOWDOWN, *_split_flags(planned)))
    out = root / "replan.toml"
    _run(args, root, "replan", _cli("plan", *_common(args, root / "replan-unused"), *_split_flags(planned),
                                    "--from-run", str(ran), "--out", str(out)))
    fragment = tomllib.loads(out.read_text())["parallelism"]
    return fragment["micro_batch_size_per_rank"], fragment["num_micro_batches_per_rank"]


REBALANCE_AFTER = 4  # steps: two records of 2 steps, the first the warm-up's


def rebalanced_run(args: argparse.Namespace, root: Path, name: str, *start: str) -> tuple[float, list[float] | None]:
    """rebalance_after from the split `start` gives (auto's, or the even default): measured after its re-plan."""
    run_dir = _run(args, root, name, _cli("train", "--nproc", "2", *_common(args, root / name),
                                          "--island.rank_slowdown", SLOWDOWN, *start,
                                          "--parallelism.rebalance_after", str(REBALANCE_AFTER)))
    return tokens_per_s(run_dir, after_step=REBALANCE_AFTER), rank_idle(run_dir)


def island_run(args: argparse.Namespace, root: Path, name: str,
               split: tuple[str, str] | None) -> tuple[float, list[float] | None]:
    extra = [] if split is None else _split_flags(split)
    run_dir = _run(args, root, name, _cli("train", "--nproc", "2", *_common(args, root / name),
                                          "--island.rank_slowdown", SLOWDOWN, *extra))
    return measured(run_dir)


def _alone(args: argparse.Namespace, root: Path, name: str, factor: str) -> tuple[list[str], Path]:
    return (_cli("train", *_common(args, root / name), "--training.batch_size", str(args.batch_size // 2),
                 "--island.rank_slowdown", factor), root / f"{name}.log")


def ideal(args: argparse.Namespace, root: Path, together: bool = True) -> tuple[float, None]:
    """Each rank alone at its own speed, on the same per-rank batch as the even split: the
    sum of their tokens/s. `together`: both 1-rank runs at once, each sharing the machine
    with the other as the island's ranks do (on one CPU the ranks compete for memory
    bandwidth and caches, which unlike devices of a real island would not); apart: one
    after the other, the other core idle."""
    jobs = [_alone(args, root, f"alone-{k}{'' if together else '-apart'}", factor)
            for k, factor in enumerate(SLOWDOWN.split(","))]
    results = run_jobs(jobs, args.timeout) if together else [run_job(*job, args.timeout) for job in jobs]
    return sum(tokens_per_s(_succeeded(result.exit_code, log)) for result, (_, log) in zip(results, jobs)), None


def planned_stages(args: argparse.Namespace, root: Path) -> str:
    out = root / "plan-pipeline.toml"
    _run(args, root, "plan-pipeline", _cli("plan", "--nproc", "2", *_common(args, root / "plan-pipeline-run"),
                                           "--parallelism.pipeline_stages", "2", "--island.rank_slowdown", SLOWDOWN,
                                           "--out", str(out)))
    return tomllib.loads(out.read_text())["parallelism"]["stage_layers"]


def pipeline_run(args: argparse.Namespace, root: Path, name: str, layers: str, schedule: str,
                 stages_per_rank: int = 1) -> tuple[float, list[float] | None]:
    run_dir = _run(args, root, name, _cli("train", "--nproc", "2", *_common(args, root / name),
                                          "--island.rank_slowdown", SLOWDOWN, "--parallelism.pipeline_stages", "2",
                                          "--parallelism.stage_layers", layers,
                                          "--parallelism.pipeline_schedule", schedule,
                                          "--parallelism.stages_per_rank", str(stages_per_rank)))
    return measured(run_dir)


def median_run(runs: list[tuple[float, list[float] | None]]) -> tuple[float, list[float] | None]:
    """The run of median throughput (the lower middle of an even count), with its idle shares."""
    return sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]


def hand_split(batch: int) -> tuple[str, str]:
    if batch % (4 * HAND_COUNTS):
        raise SystemExit(f"--batch-size must be a multiple of {4 * HAND_COUNTS} (the hand split is 3:1 in "
                         f"{HAND_COUNTS} micro-batches)")
    unit = batch // (4 * HAND_COUNTS)
    return f"{3 * unit},{unit}", f"{HAND_COUNTS},{HAND_COUNTS}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--data-parallel", choices=("fsdp", "ddp"), default="fsdp",
                        help="how the island's ranks share the model (fsdp: they meet at every block of the first "
                             "forward and the last backward; ddp: at the step's end)")
    parser.add_argument("--root", type=Path, default=None, help="folder for the run directories")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every setting this many times (interleaved) and report the median")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="which settings to run (even and ideal always run: the ratios need them)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank, alone or in the island
    hand = hand_split(args.batch_size)
    root = work_root(args.root, "bench-island-")
    wanted = set(args.settings) | {"even", "ideal"}  # the ratios' references always run
    plan = planned_split(args, root) if wanted & {"planned", "replanned"} else ("", "")
    replan = replanned_split(args, root, plan) if "replanned" in wanted else ("", "")
    stages = planned_stages(args, root) if wanted & {"pipeline-planned-1f1b", "pipeline-planned-gpipe"} else ""
    settings: dict[str, Callable[[Path], tuple[float, list[float] | None]]] = {
        "even": lambda at: island_run(args, at, "even", None), "hand": lambda at: island_run(args, at, "hand", hand),
        "planned": lambda at: island_run(args, at, "planned", plan),
        "replanned": lambda at: island_run(args, at, "replanned", replan),
        "rebalanced": lambda at: rebalanced_run(args, at, "rebalanced", "--parallelism.auto"),
        "rebalanced-even": lambda at: rebalanced_run(args, at, "rebalanced-even"), "ideal": lambda at: ideal(args, at),
        "ideal-apart": lambda at: ideal(args, at, together=False),
        "pipeline-even-1f1b": lambda at: pipeline_run(args, at, "pipeline-even-1f1b", "3,3", "1f1b"),
        "pipeline-planned-1f1b": lambda at: pipeline_run(args, at, "pipeline-planned-1f1b", stages, "1f1b"),
        "pipeline-planned-gpipe": lambda at: pipeline_run(args, at, "pipeline-planned-gpipe", stages, "gpipe"),
        "pipeline-interleaved": lambda at: pipeline_run(args, at, "pipeline-interleaved", "2,1,2,1",
                                                        "interleaved_1f1b", stages_per_rank=2)}
    # Repeats interleave the settings, so a slow spell of the machine falls on all of them.
    repeats: dict[str, list[tuple[float, list[float] | None]]] = {name: [] for name in settings if name in wanted}
    for k in range(args.repeats):
        for name, measured_runs in repeats.items():
            measured_runs.append(settings[name](root / f"repeat-{k}" if args.repeats > 1 else root))
    runs = {name: median_run(measured_runs) for name, measured_runs in repeats.items()}
    splits = {"even": f"{args.batch_size // 2} x 1 each", "hand": f"{hand[0]} x {hand[1]}",
              "planned": f"{plan[0]} x {plan[1]}", "replanned": f"{replan[0]} x {replan[1]}",
              "rebalanced": f"auto, then re-planned after step {REBALANCE_AFTER} (rebalanced.log)",
              "rebalanced-even": f"even, then re-planned after step {REBALANCE_AFTER} (rebalanced-even.log)",
              "ideal": "each rank alone, both at once",
              "ideal-apart": "each rank alone, one after the other",
              "pipeline-even-1f1b": "layers 3,3", "pipeline-planned-1f1b": f"layers {stages}",
              "pipeline-planned-gpipe": f"layers {stages}", "pipeline-interleaved": "layers 2,1,2,1"}
    # The schedule's formula: (S-1)/(M+S-1) for gpipe and 1f1b (2 stages, 4 micro-batches),
    # (R-1)/(V*M+R-1) interleaved with V = 2 stages per rank.
    modelled = {"pipeline-even-1f1b": bubble_fraction(2, 4), "pipeline-planned-1f1b": bubble_fraction(2, 4),
                "pipeline-planned-gpipe": bubble_fraction(2, 4), "pipeline-interleaved": bubble_fraction(2, 8)}
    speeds = {name: speed for name, (speed, _) in runs.items()}
    results: list[dict[str, Any]] = [
        {"setting": name, "tokens_per_s": speed, "ratio_to_ideal": ratio(speed, speeds["ideal"]),
         "ratio_to_even": ratio(speed, speeds["even"]), "split": splits[name], "rank_idle": idle,
         "modelled_bubble": modelled.get(name), "data_parallel": args.data_parallel}
        for name, (speed, idle) in runs.items()]
    print(f"\n2-rank island ({args.data_parallel}), rank 1 emulated 2x slower, llama3 debug, batch {args.batch_size}, "
          f"{args.steps} steps, median of {args.repeats} run(s)")
    print(f"{'setting':<22} {'vs ideal':>8} {'vs even':>8} {'tok/s':>8} {'idle r0/r1':>11} {'model':>6}  "
          "split (sizes x counts)")
    for r in results:
        idle = "/".join(f"{x:.2f}" for x in r["rank_idle"]) if r["rank_idle"] else "-"
        print(f"{r['setting']:<22} {num(r['ratio_to_ideal'], '.3f'):>8} {num(r['ratio_to_even'], '.3f'):>8} "
              f"{r['tokens_per_s']:>8.0f} {idle:>11} {num(r['modelled_bubble'], '.2f'):>6}  {r['split']}")
    print("idle r0/r1: each rank's measured idle share of a step; model: the schedule's bubble formula")
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    run_main(main)
