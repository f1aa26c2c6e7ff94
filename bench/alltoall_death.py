"""Which rows of a gloo all-to-all still arrive when a member dies inside it: the premise
of repairing a two-phase exchange from what the survivors already hold (docs/scale.md).

Four ranks of torchft's ProcessGroupGloo (as the federation's bridge ranks use it) start
an all-to-all of `size` bytes per pair; rank 2 SIGKILLs itself `--kill-ms` after its
start. Each survivor waits for its collective (which fails, or hangs until another
survivor closes the group), keeps the group open `--keep` seconds more while it watches
its receive buffer, then aborts the group (what OuterLoop does with a failed exchange).
Counted: the survivor-to-survivor rows (6 per run) that arrived whole. Printed per row
size, ratio first (arrived, against the smallest size's).

    python bench/alltoall_death.py [--sizes-mb 0.004 50] [--repeats 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import gloo_ranks, where_measured, write_json  # noqa: E402

RANKS, DEAD = 4, 2


def _rank(rank: int, port: int, size: int, kill_s: float, keep_s: float, results: Any) -> None:
    import torch
    from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(f"127.0.0.1:{port}/a2a", f"rank{rank}", rank, RANKS)
    pg.allgather([[torch.zeros(1) for _ in range(RANKS)]], [torch.ones(1)], AllgatherOptions()).wait()  # connected
    send = torch.full((RANKS * size,), rank + 1, dtype=torch.uint8)
    received = torch.zeros(RANKS * size, dtype=torch.uint8)
    work = pg.alltoall_base(received, send, [], [], AllToAllOptions())
    if rank == DEAD:
        time.sleep(kill_s)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        work.wait()
    except Exception:  # noqa: BLE001 - the failure is expected
        pass
    del work
    peers = [p for p in range(RANKS) if p not in (rank, DEAD)]
    deadline = time.monotonic() + keep_s
    arrived: set[int] = set()
    while time.monotonic() < deadline and len(arrived) < len(peers):
        arrived |= {p for p in peers if bool((received[p * size:(p + 1) * size] == p + 1).all())}
        time.sleep(0.02)
    pg.abort()
    results.put((rank, len(arrived)))


def run_once(size: int, kill_s: float, keep_s: float) -> int:
    """Survivor-to-survivor rows that arrived whole (of 6)."""
    found = gloo_ranks(_rank, RANKS, (size, kill_s, keep_s), expected=RANKS - 1, result_timeout_s=keep_s + 90)
    return sum(found.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.004, 50.0], help="bytes per pair, in MB")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--kill-ms", type=float, default=30.0, help="rank 2 dies this long after starting")
    parser.add_argument("--keep", type=float, default=5.0, help="seconds a survivor keeps the group open after")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    rows = (RANKS - 1) * (RANKS - 2)  # survivor-to-survivor rows per run: each survivor from the other two
    counts = {mb: [run_once(max(1, int(mb * 2**20)), args.kill_ms / 1e3, args.keep) for _ in range(args.repeats)]
              for mb in args.sizes_mb}
    share = {mb: sum(c) / (rows * len(c)) for mb, c in counts.items()}
    base = share[args.sizes_mb[0]]
    print(f"| arrived / {args.sizes_mb[0]} MB's | survivors' rows arrived | MB per pair | runs (of {rows}) |")
    print("|---:|---:|---:|---|")
    for mb, c in counts.items():
        ratio = share[mb] / base if base else float("nan")
        print(f"| {ratio:.2f} | {100 * share[mb]:.0f}% | {mb:g} | {', '.join(map(str, c))} |")
    if args.out:
        sizes = " ".join(f"{mb:g}" for mb in args.sizes_mb)
        meta = where_measured(threads_per_rank=1, kill_ms=args.kill_ms, keep_s=args.keep,
                              command=f"python bench/alltoall_death.py --sizes-mb {sizes} --repeats {args.repeats}")
        write_json(Path(args.out), {"meta": meta, "rows_per_run": rows, "arrived": counts, "share": share})


if __name__ == "__main__":
    main()
