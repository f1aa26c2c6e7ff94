"""How long a member blocked behind a failed gloo collective waits, with and without the
failed work released before the process group is aborted (agreement.release_works).

Four ranks of torchft's ProcessGroupGloo (as the federation's bridge ranks use it) run a
ring all-gather; rank 2 is SIGKILLed just before it. Ranks 1 and 3 (the dead rank's
neighbours) fail at once; rank 0 waits on rank 3, which forwards nothing more. Ranks 1
and 3 then abort their process group (what OuterLoop does when an exchange failed),
either still holding the failed collective's work (`kept`, as before) or having dropped
it first (`released`), and stay alive for `--hold` seconds. Printed: the seconds until
rank 0's wait failed, per setting (median over `--repeats`), ratio first.

    python bench/gloo_abort.py [--repeats 5] [--hold 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import gloo_ranks, where_measured, write_json  # noqa: E402


def _rank(rank: int, port: int, keep: bool, hold_s: float, results: Any) -> None:
    import torch
    from torch.distributed.distributed_c10d import AllgatherOptions
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(f"127.0.0.1:{port}/ring", f"rank{rank}", rank, 4)
    row, rows = torch.ones(1000), [torch.zeros(1000) for _ in range(4)]
    pg.allgather([rows], [row], AllgatherOptions()).wait()  # every pair connected
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)  # rank 2 is gone
    began = time.perf_counter()
    work = pg.allgather([rows], [row], AllgatherOptions())
    try:
        work.wait()
        results.put((rank, None))
    except Exception:  # noqa: BLE001 - the failure is what is measured
        results.put((rank, time.perf_counter() - began))
        if not keep:
            del work
        pg.abort()
    time.sleep(hold_s)


def run_once(keep: bool, hold_s: float) -> float | None:
    """Seconds until rank 0's wait failed (None: it did not fail within the run)."""
    found = gloo_ranks(_rank, 4, (keep, hold_s), expected=3, result_timeout_s=hold_s + 60,
                       join_timeout_s=hold_s + 10)
    return found.get(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hold", type=float, default=5.0, help="seconds ranks 1 and 3 stay alive after aborting")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    settings = {"kept": True, "released": False}
    seconds = {name: [run_once(keep, args.hold) for _ in range(args.repeats)] for name, keep in settings.items()}
    median = {name: statistics.median(s for s in values if s is not None) for name, values in seconds.items()}
    print("| kept / released | rank 0 fails after (median) | setting | runs (s) |")
    print("|---:|---:|---|---|")
    for name in settings:
        ratio = median["kept"] / median[name] if median[name] else float("inf")
        runs = ", ".join("-" if s is None else f"{s:.3f}" for s in seconds[name])
        print(f"| {ratio:.0f} | {median[name]:.3f} s | {name} | {runs} |")
    if args.out:
        meta = where_measured(threads_per_rank=1, hold_s=args.hold,
                              command=f"python bench/gloo_abort.py --repeats {args.repeats} --hold {args.hold}")
        write_json(Path(args.out), {"meta": meta, "seconds": seconds, "median": median})


if __name__ == "__main__":
    main()
