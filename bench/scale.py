"""Received bytes per island as the federation grows: top-k's all-gather against its reduce-scatter.

For each island count G (default 2, 3, 4, 6, 8) and each exchange path
(`--fault_tolerance.topk_exchange all_gather` / `reduce_scatter`), one run of
`archipelago local --islands 1,...,1` (llama3 `debug`, Shakespeare, top-k at the config's
fraction and bits, no averaged moments, so the rows are the pseudo-gradient's alone) on
this machine's loopback; several islands share a core. Measured per run:

* what each island's trainer reports it received per outer step (`bytes_received`: the
  rows from the other islands, headers included), the median over islands and steady
  rounds (round 1 also carries the join);
* the bytes that crossed between islands on the sockets (bench/meter.py, the kernel's
  per-socket counters), per island and outer step;
* the global weights' hash after the last outer step: both paths must end with the same
  weights, bit for bit (the reduce-scatter sums exactly what the all-gather sums).

Table, ratio first: reduce-scatter / all-gather received bytes per island, for each G,
next to the all-gather's G - 1 payloads and the reduce-scatter's bound (a segment payload
and one summed segment, at most ~4.1 bytes per value, from each other island).

    python bench/scale.py [--islands 2 3 4 6 8] [--steps 6] [--sync-steps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, num, outer_steps, ratio, read_summary, run_job, run_main, work_root, write_json  # noqa: E402
from meter import make_monitor  # noqa: E402

PATHS = ("all_gather", "reduce_scatter")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--islands", type=int, nargs="+", default=[2, 3, 4, 6, 8], help="island counts (1 rank each)")
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/federation.toml")
    p.add_argument("--steps", type=int, default=6, help="inner steps per island")
    p.add_argument("--sync-steps", type=int, default=3, help="inner steps per round")
    p.add_argument("--batch-size", type=int, default=2, help="per island (small: islands share the cores)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--poll-s", type=float, default=0.5, help="socket counter poll period")
    p.add_argument("--attribute-s", type=float, default=0.2, help="socket attribution period")
    p.add_argument("--root", type=Path, default=None, help="run directories (default: a new /tmp folder)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--summarize", type=Path, default=None, help="run nothing: print the table of an earlier --out")
    return p.parse_args()


def command(args: argparse.Namespace, islands: int, path: str, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "archipelago.launch.cli", "local", "--islands", ",".join(["1"] * islands),
            "--no-table", "--config", str(args.config), "--training.steps", str(args.steps),
            "--training.batch_size", str(args.batch_size), "--lr_scheduler.warmup_steps", "1",
            "--fault_tolerance.sync_steps", str(args.sync_steps), "--fault_tolerance.codec", "topk",
            "--fault_tolerance.topk_exchange", path, "--fault_tolerance.no_average_optimizer_state",
            "--checkpoint.no_enable", "--training.val_every", "0", "--metrics.no_tensorboard",
            "--job.run_dir", str(run_dir)]


def measure(args: argparse.Namespace, root: Path, islands: int, path: str) -> dict[str, Any]:
    name = f"{islands}-islands-{path}"
    run_dir = root / name
    run = run_job(command(args, islands, path, run_dir), root / f"{name}.log", args.timeout,
                  lambda token, max_s: make_monitor(token, args.poll_s, args.attribute_s, max_s),
                  env={"OMP_NUM_THREADS": "1"})
    if run.exit_code != 0:
        raise RuntimeError(f"{name} failed (exit code {run.exit_code}); see {root / f'{name}.log'}")
    records = [outer_steps(run_dir / f"island-{k}") for k in range(islands)]
    committed = [r for island in records for r in island if r.get("committed")]
    steady = [r["bytes_received"] for r in committed if r["outer_step"] > 1] or [r["bytes_received"] for r in committed]
    outer = max((r["outer_step"] for r in committed), default=0)
    hashes = {island[-1].get("global_hash") for island in records if island}
    agree = len(hashes) == 1 and None not in hashes
    socket = run.traffic.get("peer_bytes", 0)
    params = int(read_summary(run_dir / "island-0", required=True)["params"])  # one bridge chunk: 1-rank islands
    return {"islands": islands, "path": path, "run_dir": str(run_dir), "wall_s": run.wall_s,
            "outer_steps": outer, "received_per_island_round": statistics.median(steady) if steady else None,
            "socket_bytes_per_island_round": socket / islands / outer if outer else None,
            "global_hash": next(iter(hashes)) if agree else None, "islands_agree": agree,
            "params": params, "traffic": run.traffic}


def bounds(config: Path, islands: int, numel: int) -> dict[str, int]:
    """The codec's own figures for the config's top-k on a bridge chunk of `numel` values:
    the all-gather's received bytes per island and round, and the reduce-scatter's bound."""
    from dataclasses import replace

    from archipelago.config.loading import load_toml
    from archipelago.federation.codecs import build_codec, sum_bytes_bound
    from archipelago.federation.exchange import Framing, round_received

    ft = replace(load_toml(config).fault_tolerance, codec="topk")
    codec = build_codec(ft, numel)
    pieces = [codec.for_length(end - start) for start, end in codec.segments(islands)]
    row = Framing().row_bytes
    segment = row(max(p.payload_bytes() for p in pieces))
    summed = row(max(sum_bytes_bound(p.numel, p.sum_nonzeros(islands)) for p in pieces))
    return {"all_gather": (islands - 1) * row(codec.payload_bytes()),
            "reduce_scatter_bound": (islands - 1) * (segment + summed + 8),
            "simulator": round_received(build_codec(replace(ft, topk_exchange="reduce_scatter"), numel), islands,
                                        Framing())}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| received / all-gather's | islands | path | received per island and round (trainer) | on the sockets "
          "| all-gather: G-1 payloads | reduce-scatter bound | simulator's estimate | same weights as all-gather |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|")
    by = {(r["islands"], r["path"]): r for r in rows}
    for r in rows:
        base = by.get((r["islands"], "all_gather"), {})
        same = "-" if r["path"] == "all_gather" else (
            "yes" if r["global_hash"] and r["global_hash"] == base.get("global_hash") else "NO")
        print(f"| {num(ratio(r['received_per_island_round'], base.get('received_per_island_round')), '.3f')} "
              f"| {r['islands']} | {r['path']} | {num(r['received_per_island_round'], ',.0f')} "
              f"| {num(r['socket_bytes_per_island_round'], ',.0f')} | {r['bound']['all_gather']:,} "
              f"| {r['bound']['reduce_scatter_bound']:,} | {estimate(r):,} | {same} |")


def estimate(r: dict[str, Any]) -> int:
    """The simulator's figure for this path (exchange.round_received)."""
    return r["bound"]["all_gather"] if r["path"] == "all_gather" else r["bound"]["simulator"]


def main() -> None:
    args = parse_args()
    if args.summarize:
        rows = json.loads(args.summarize.read_text())["runs"]
        for row in rows:  # recomputed: the figures of the code as it is now
            row["bound"] = bounds(args.config, row["islands"], row["params"])
        print_table(rows)
        return
    root = work_root(args.root, "archipelago-scale-")
    rows = []
    for islands in args.islands:
        for path in PATHS:
            row = measure(args, root, islands, path)
            row["bound"] = bounds(args.config, islands, row["params"])
            rows.append(row)
            print(f"{islands} islands, {path}: {num(row['received_per_island_round'], ',.0f')} bytes received "
                  f"per island and round ({row['wall_s']:.0f} s)", flush=True)
    print_table(rows)
    if args.out:
        write_json(args.out, {"settings": vars(args) | {"config": str(args.config), "root": str(root),
                                                         "out": str(args.out)}, "runs": rows})


if __name__ == "__main__":
    run_main(main)
