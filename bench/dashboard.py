"""What pushing records to the federation dashboard costs an island: step time with and without.

One-rank `archipelago train` runs of llama3 debug, a record every step (`--metrics.log_every 1`,
the most pushing a run can do), alternating without and with `--metrics.dashboard` pointing at
a dashboard this process serves, `--repeats` times each. The step time is the median over
the step records (after the first) of 1 / steps per second from `tokens_per_s`. Table,
ratio first: with / without (target <= 1.01). bench/federation.py runs this too.

The island trains on `--island-threads` threads (1 by default) and the dashboard serves from
this process on what is left: in a deployment the dashboard runs on the lighthouse's host,
not the island's, so its own serving must not be counted against the island. With every
core given to the island, the measurement adds the server's work on the same cores.

    python bench/dashboard.py [--steps 30] [--repeats 3] [--island-threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, ratio, read_jsonl, run_job, run_main, seq_len_of, work_root, write_json  # noqa: E402

from archipelago.metrics.dashboard import Dashboard  # noqa: E402


def step_s(run_dir: Path, tokens_per_step: int) -> float:
    rates = [r["tokens_per_s"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("tokens_per_s")]
    if len(rates) < 3:
        raise RuntimeError(f"{run_dir}: too few step records")
    return statistics.median(tokens_per_step / r for r in rates[1:])


def one_run(args: argparse.Namespace, root: Path, name: str, dashboard: str | None) -> float:
    run_dir = root / name
    cmd = [sys.executable, "-m", "archipelago.launch.cli", "train", "--config", str(args.config),
           "--training.steps", str(args.steps), "--training.batch_size", str(args.batch_size),
           "--training.val_every", "0", "--checkpoint.no_enable", "--metrics.no_tensorboard",
           "--metrics.log_every", "1", "--metrics.progress", "plain", "--lr_scheduler.warmup_steps", "2",
           "--job.run_dir", str(run_dir), *(["--metrics.dashboard", dashboard] if dashboard else [])]
    result = run_job(cmd, root / f"{name}.log", args.timeout, env={"OMP_NUM_THREADS": str(args.island_threads)})
    if result.exit_code != 0:
        raise RuntimeError(f"{name}: exit code {result.exit_code}; see {root / f'{name}.log'}")
    return step_s(run_dir, args.batch_size * seq_len_of(run_dir))


def measure_dashboard(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Interleaved runs without and with pushing; the medians and their ratio."""
    dashboard = Dashboard("127.0.0.1", 0)
    plain, pushed = [], []
    try:
        for k in range(args.repeats):
            plain.append(one_run(args, root, f"dashboard-off-{k}", None))
            pushed.append(one_run(args, root, f"dashboard-on-{k}", dashboard.address))
        received = dashboard.state.snapshot()["islands"]
    finally:
        dashboard.shutdown()
    off, on = statistics.median(plain), statistics.median(pushed)
    return {"ratio": ratio(on, off), "step_s_with": on, "step_s_without": off, "runs_without": plain,
            "runs_with": pushed, "records_received": sum(len(i["curve"]) for i in received),
            "steps": args.steps, "repeats": args.repeats, "island_threads": args.island_threads}


def print_table(result: dict[str, Any]) -> None:
    print(f"\ndashboard cost: one-rank island ({result['island_threads']} thread(s)), llama3 debug, "
          "a record pushed every step")
    print(f"{'with / without':>15} {'step s with':>12} {'step s without':>15} {'records received':>17}")
    print(f"{result['ratio']:>15.4f} {result['step_s_with']:>12.4f} {result['step_s_without']:>15.4f} "
          f"{result['records_received']:>17}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/debug.toml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--island-threads", type=int, default=1,
                   help="OMP threads of the island (leave a core to the dashboard, as on separate hosts)")
    p.add_argument("--timeout", type=float, default=600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--root", type=Path, default=None, help="folder for the run directories")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args()
    result = measure_dashboard(args, work_root(args.root, "bench-dashboard-"))
    print_table(result)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    run_main(main)
