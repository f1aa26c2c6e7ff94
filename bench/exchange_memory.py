"""Peak memory of a bridge rank in a federation, against the model's size / sync_width.

A federation's bridge rank holds, beside what the island trains with, the global weights of
its chunk (a CPU copy), the outer optimizer's state, the pseudo-gradient buffer, the codec's
state (top-k's error feedback) and, during an exchange, every island's row. This measures
what that costs: the peak resident memory of island rank 0 (summary.json `peak_rss_bytes`)
in a federation, minus that of the same island training alone, in the same run of this
script, on the same machine:

1. islands of 1 rank: alone, then `archipelago local --islands 1,1` with each codec given
   (fp32, int8, topk by default);
2. islands of 2 ranks: alone (`--nproc 2`), then `--islands 2,2` with sync_width 1 and 2
   (fp32): with sync_width 2 each bridge rank holds half of the model's chunk;
3. with `--decoupled`, each codec of 1. again in decoupled rounds whose every exchange
   overlaps the next round (`fault_tolerance.round_mode`: the base weights and an
   exchange's sum apart from the pseudo-gradient are held beside the rest); with
   `--arrival-steps N` also applied N inner steps into the next round (`arrival_steps`: the
   island's weights are gathered and moved to the new global weights there).

Reported (table, ratio first, and JSON): extra bytes / (model bytes / sync_width), the
extra MB, the model's fp32 MB. Peak RSS is the kernel's high-water mark of the whole
process, so allocator caching and the data loader add noise of a few MB; the model's size
must dwarf that for the ratio to mean much (`--flavor`).

    python bench/exchange_memory.py [--flavor debug] [--steps 10] [--codecs fp32,int8,topk] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    num,
    ratio,
    read_summary,
    run_job,
    run_main,
    where_measured,
    work_root,
    write_json,
)

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "archipelago.launch.cli"]


def common(args: argparse.Namespace) -> list[str]:
    return ["--config", str(args.config), "--model.flavor", args.flavor, "--training.steps", str(args.steps),
            "--lr_scheduler.warmup_steps", str(args.steps // 2), "--training.batch_size", str(args.batch_size),
            "--checkpoint.no_enable", "--training.val_every", "0", "--metrics.no_tensorboard"]


def peak(run_dir: Path) -> int:
    """Rank 0's peak resident bytes of a run (an island's folder, or a job's)."""
    value = read_summary(run_dir, required=True).get("peak_rss_bytes")
    if not value:
        raise RuntimeError(f"{run_dir}/summary.json has no peak_rss_bytes (an older archipelago?)")
    return int(value)


def run(cmd: list[str], root: Path, name: str, timeout_s: float) -> None:
    done = run_job(cmd, root / f"{name}.log", timeout_s)
    if done.exit_code != 0:
        raise RuntimeError(f"{name} failed (exit code {done.exit_code}); see {root / f'{name}.log'}")


def alone(args: argparse.Namespace, root: Path, ranks: int) -> int:
    run_dir = root / f"alone-{ranks}"
    run([*CLI, "train", "--nproc", str(ranks), *common(args), "--job.run_dir", str(run_dir)], root, run_dir.name,
        args.timeout)
    return peak(run_dir)


DECOUPLED = ["--fault_tolerance.round_mode", "decoupled", "--fault_tolerance.overlap_threshold", "0"]


def federation(args: argparse.Namespace, root: Path, ranks: int, codec: str, width: int,
               decoupled: bool = False, arrival: int = 0) -> tuple[int, int]:
    """(peak bytes of island 0's rank 0, the model's parameter count)."""
    mode = (f"-decoupled-arrival{arrival}" if arrival else "-decoupled") if decoupled else ""
    run_dir = root / f"fed-{ranks}x2-{codec}-width{width}{mode}"
    arrive = ["--fault_tolerance.arrival_steps", str(arrival)] if arrival else []
    run([*CLI, "local", "--islands", f"{ranks},{ranks}", "--no-table", *common(args),
         "--fault_tolerance.sync_steps", str(args.sync_steps), "--fault_tolerance.codec", codec,
         "--fault_tolerance.sync_width", str(width), *(DECOUPLED + arrive if decoupled else []),
         "--job.run_dir", str(run_dir)], root, run_dir.name, args.timeout)
    summary = read_summary(run_dir / "island-0", required=True)
    return peak(run_dir / "island-0"), int(summary["params"])


def row(setting: str, ranks: int, codec: str, width: int, fed: int, base: int, params: int) -> dict[str, Any]:
    model = 4 * params
    extra = fed - base
    return {"setting": setting, "ranks": ranks, "codec": codec, "sync_width": width, "peak_bytes": fed,
            "alone_peak_bytes": base, "extra_bytes": extra, "model_bytes": model,
            "ratio": ratio(extra, model / width)}


def measure(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    rows = []
    base1 = alone(args, root, 1)
    for codec in args.codecs:
        fed, params = federation(args, root, 1, codec, 1)
        rows.append(row("islands of 1 rank", 1, codec, 1, fed, base1, params))
        if args.decoupled:
            fed, params = federation(args, root, 1, codec, 1, decoupled=True)
            rows.append(row("islands of 1 rank, decoupled", 1, codec, 1, fed, base1, params))
        if args.arrival_steps:  # only with --decoupled (parse_args)
            fed, params = federation(args, root, 1, codec, 1, decoupled=True, arrival=args.arrival_steps)
            rows.append(row(f"islands of 1 rank, decoupled, arrival_steps {args.arrival_steps}", 1, codec, 1,
                            fed, base1, params))
    if not args.no_two_ranks:
        base2 = alone(args, root, 2)
        for width in (1, 2):
            fed, params = federation(args, root, 2, "fp32", width)
            rows.append(row("islands of 2 ranks", 2, "fp32", width, fed, base2, params))
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nisland 0, rank 0: peak resident memory in a federation of two minus alone (same ranks)\n")
    print("| ratio (extra / (model / sync_width)) | extra MB | model MB (fp32) | sync_width | codec | islands "
          "| peak MB | alone MB |")
    print("|---:|---:|---:|---:|---|---|---:|---:|")
    mb = 1 << 20
    for r in rows:
        print(f"| {num(r['ratio'], '.2f')} | {r['extra_bytes'] / mb:,.1f} | {r['model_bytes'] / mb:,.1f} "
              f"| {r['sync_width']} | {r['codec']} | {r['setting']} | {r['peak_bytes'] / mb:,.1f} "
              f"| {r['alone_peak_bytes'] / mb:,.1f} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/debug.toml")
    p.add_argument("--flavor", default="debug", help="model flavor (a larger one dwarfs the allocator's noise)")
    p.add_argument("--steps", type=int, default=10, help="inner steps of every run")
    p.add_argument("--sync-steps", type=int, default=5, help="inner steps between outer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per island per step")
    p.add_argument("--codecs", type=lambda s: s.split(","), default=["fp32", "int8", "topk"],
                   help="codecs of the 1-rank federations, comma-separated")
    p.add_argument("--no-two-ranks", action="store_true", help="skip the 2-rank islands (sync_width 1 and 2)")
    p.add_argument("--decoupled", action="store_true",
                   help="also each codec's federation of 1-rank islands in decoupled rounds, every exchange "
                        "overlapping the next round (they hold one more model chunk: the base weights)")
    p.add_argument("--arrival-steps", type=int, default=0, metavar="N",
                   help="with --decoupled: also each codec's decoupled federation with every exchange applied N "
                        "inner steps into the next round (fault_tolerance.arrival_steps; below --sync-steps)")
    p.add_argument("--timeout", type=float, default=900, help="hard limit per run, seconds")
    p.add_argument("--work-dir", type=Path, default=None, help="run directories (default: a new /tmp folder)")
    p.add_argument("--out", type=Path, default=REPO / "runs/bench/exchange-memory.json", help="JSON results")
    args = p.parse_args()
    if args.arrival_steps and not (args.decoupled and 0 < args.arrival_steps < args.sync_steps):
        p.error(f"--arrival-steps {args.arrival_steps}: give it with --decoupled, from 1 to --sync-steps - 1 "
                f"({args.sync_steps - 1})")
    return args


def main() -> None:
    args = parse_args()
    root = work_root(args.work_dir, "bench-memory-")
    rows = measure(args, root)
    print_table(rows)
    write_json(args.out, {"rows": rows, "flavor": args.flavor, "steps": args.steps, "sync_steps": args.sync_steps,
                          "batch_size": args.batch_size, "arrival_steps": args.arrival_steps, "work_dir": str(root),
                          **where_measured()})


if __name__ == "__main__":
    run_main(main)
