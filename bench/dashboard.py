"""What pushing records to the federation dashboard costs an island: step time with and without.

One-rank `archipelago train` runs of llama3 debug, a record every step (`--metrics.log_every 1`,
the most pushing a run can do), alternating without and with `--metrics.dashboard` pointing at
a dashboard this process serves, `--repeats` times each; pushes are tagged with a federation
key (HMAC, as a keyed federation sends them) and the dashboard checks every tag. The step
time is the median over the step records (after the first) of 1 / steps per second from
`tokens_per_s`. Runs of the same setting differ by several percent on a shared machine,
more than the 1% the target allows, so the table also gives the direct measurement: the
sending thread's CPU time over the run's wall time (`dashboard_push_cpu_s` in the run's
summary.json): the work pushing adds on the island's cores (not counted: the training
thread waiting for the interpreter lock while the sender holds it). Table,
ratio first: with / without (target <= 1.01). bench/federation.py runs this too.

The island trains on `--island-threads` threads (1 by default) and the dashboard serves from
this process on what is left: in a deployment the dashboard runs on the lighthouse's host,
not the island's, so its own serving must not be counted against the island. With every
core given to the island, the measurement adds the server's work on the same cores.

    python bench/dashboard.py [--steps 30] [--repeats 3] [--island-threads 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, ratio, read_jsonl, run_job, run_main, seq_len_of, work_root, write_json  # noqa: E402

from archipelago.federation.trust import KEY_FILE_ENV, dashboard_verifier, load_key, new_secret  # noqa: E402
from archipelago.metrics.dashboard import Dashboard  # noqa: E402


def step_s(run_dir: Path, tokens_per_step: int) -> float:
    rates = [r["tokens_per_s"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("tokens_per_s")]
    if len(rates) < 3:
        raise RuntimeError(f"{run_dir}: too few step records")
    return statistics.median(tokens_per_step / r for r in rates[1:])


def one_run(args: argparse.Namespace, root: Path, name: str, dashboard: str | None,
            key_file: Path | None = None) -> tuple[float, float | None]:
    """The run's median step time, and with a dashboard the pushing thread's CPU share of its wall time."""
    run_dir = root / name
    cmd = [sys.executable, "-m", "archipelago.launch.cli", "train", "--config", str(args.config),
           "--training.steps", str(args.steps), "--training.batch_size", str(args.batch_size),
           "--training.val_every", "0", "--checkpoint.no_enable", "--metrics.no_tensorboard",
           "--metrics.log_every", "1", "--metrics.progress", "plain", "--lr_scheduler.warmup_steps", "2",
           "--job.run_dir", str(run_dir), *(["--metrics.dashboard", dashboard] if dashboard else [])]
    env = {"OMP_NUM_THREADS": str(args.island_threads), **({KEY_FILE_ENV: str(key_file)} if key_file else {})}
    result = run_job(cmd, root / f"{name}.log", args.timeout, env=env)
    if result.exit_code != 0:
        raise RuntimeError(f"{name}: exit code {result.exit_code}; see {root / f'{name}.log'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    share = summary["dashboard_push_cpu_s"] / summary["wall_s"] if "dashboard_push_cpu_s" in summary else None
    return step_s(run_dir, args.batch_size * seq_len_of(run_dir)), share


def measure_dashboard(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Interleaved runs without and with pushing; the medians and their ratio."""
    key_file = root / "federation.key"
    key_file.write_text(new_secret() + "\n")
    key_file.chmod(0o600)
    key = load_key(str(key_file))
    assert key is not None
    dashboard = Dashboard("127.0.0.1", 0, dashboard_verifier(key))
    plain, pushed, shares = [], [], []
    try:
        for k in range(args.repeats):
            plain.append(one_run(args, root, f"dashboard-off-{k}", None)[0])
            seconds, share = one_run(args, root, f"dashboard-on-{k}", dashboard.address, key_file)
            pushed.append(seconds)
            shares.append(share)
        received = dashboard.state.snapshot()["islands"]
    finally:
        dashboard.shutdown()
    records = sum(len(i["curve"]) for i in received)
    if records < args.repeats * args.steps:  # pushing must have worked for its cost to mean anything
        raise RuntimeError(f"the dashboard took {records} of the {args.repeats * args.steps} records pushed: "
                           "were the tags refused? see the runs' logs")
    off, on = statistics.median(plain), statistics.median(pushed)
    return {"ratio": ratio(on, off), "push_cpu_share": statistics.median(shares), "step_s_with": on,
            "step_s_without": off, "runs_without": plain, "runs_with": pushed, "push_cpu_shares": shares,
            "records_received": records, "signed": True,
            "steps": args.steps, "repeats": args.repeats, "island_threads": args.island_threads}


def print_table(result: dict[str, Any]) -> None:
    print(f"\ndashboard cost: one-rank island ({result['island_threads']} thread(s)), llama3 debug, "
          "a record pushed every step")
    print(f"{'with / without':>15} {'push CPU / wall':>16} {'step s with':>12} {'step s without':>15} "
          f"{'records received':>17}")
    print(f"{result['ratio']:>15.4f} {result['push_cpu_share']:>16.5f} {result['step_s_with']:>12.4f} "
          f"{result['step_s_without']:>15.4f} {result['records_received']:>17}")
    print("push CPU / wall: the pushing thread's CPU time (JSON, HMAC tag, HTTP) over the run's wall time")


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
