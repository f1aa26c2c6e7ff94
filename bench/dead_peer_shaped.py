"""A member dies in an all-to-all over shaped links: how long do the survivors wait?

Four ranks of torchft's ProcessGroupGloo (as the federation's bridge ranks use it), each in
its own network namespace behind a link shaped to --rate-mbit each way (bench/netns.py,
as bench/wan.py builds it), run one all-to-all of --segment-mb per pair (an int8
reduce-scatter's first phase: llama3 `debug`'s 7.2 MB row cut into four is 1.8 MB). Rank
3 SIGKILLs itself 50 ms after posting its part. Rank 2 posts `--late` seconds after the
others (negative: before them; a slower island reaches the exchange later). A rank whose
wait fails lets go of the work and aborts the group (what `agreement.abandon_group` does),
then stays alive for --hold seconds. Printed per setting: each survivor's seconds until its
wait failed, ratio to the group's timeout first.

Measured on loopback (tests/test_exchange_retry.py, docs/rounds.md) every survivor fails
within a second of the death. Over shaped links a survivor may instead wait for the whole
--timeout (gloo's "Timed out waiting ... for send operation to complete"), even once every
peer's connection to it is closed: its pending send is never failed by the transport.
(The federation no longer waits for it: the members that saw the failure say so in the
quorum's store, federation/give_up.py. This script measures gloo alone.)

    sudo .venv/bin/python bench/dead_peer_shaped.py [--lates -0.6 0 0.5] [--rate-mbit 10] [--out FILE]

Needs root (network namespaces); as another user it prints why and exits 0. About 2
minutes per setting at the default 60 s timeout.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import base_env, kill_token, python_bin, start, stop_all, where_measured, write_json  # noqa: E402
from netns import LOCK_FILE, PREFIX, Wan, hold_lock, in_namespace, preflight, setup, teardown  # noqa: E402

STORE_PORT = 29600
DIES, LATE_RANK, RANKS = 3, 2, 4


def rank_main(rank: int, store_addr: str, late: float, floats: int, timeout_s: float, hold_s: float,
              out: str) -> None:
    """One rank: meet the others, post the all-to-all (rank 2 `late` seconds apart), and record
    how long the wait took and how it ended."""
    import torch
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import AllToAllOptions
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    store = TCPStore(store_addr, STORE_PORT, is_master=True, wait_for_workers=False) if rank == 0 else None
    pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
    pg.configure(f"{store_addr}:{STORE_PORT}/dead_peer", f"rank{rank}", rank, RANKS)
    small = torch.zeros(4 * RANKS)
    pg.alltoall_base(torch.zeros_like(small), small, [], [], AllToAllOptions()).wait()  # every pair connected
    send = torch.ones(floats * RANKS)
    received = torch.zeros_like(send)
    if (rank == LATE_RANK) == (late > 0):
        time.sleep(abs(late))
    began = time.time()
    work = pg.alltoall_base(received, send, [], [], AllToAllOptions())
    if rank == DIES:
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        work.wait()
        ended = "completed"
    except Exception as exc:  # noqa: BLE001 - how it failed is what is measured
        ended = str(exc).split(". This is")[0][-160:]
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "seconds": time.time() - began, "ended": ended}) + "\n")
    del work
    pg.abort()
    time.sleep(hold_s)
    del store


def run_setting(wan: Wan, late: float, args: argparse.Namespace, token: str) -> list[dict[str, Any]]:
    """The survivors' records of one run (rank order)."""
    out = args.work_dir / f"late{late:g}.jsonl"
    out.write_text("")
    env = {**base_env(token, 1), "GLOO_SOCKET_IFNAME": "wan0"}
    floats = int(args.segment_mb * 1e6 / 4)
    procs = []
    try:
        for k in range(RANKS):
            cmd = [python_bin(), str(Path(__file__).resolve()), "--rank", str(k), "--store", wan.island_addr(0),
                   "--late", f"{late:g}", "--floats", str(floats), "--timeout", f"{args.timeout:g}",
                   "--hold", f"{args.hold:g}", "--record", str(out)]
            procs.append(start(f"rank-{k}", in_namespace(wan.island_ns(k), wan.island_addr(k), cmd), env,
                               args.work_dir / f"late{late:g}-rank{k}.log"))
        deadline = time.monotonic() + args.timeout + 120
        while time.monotonic() < deadline and len(out.read_text().splitlines()) < RANKS - 1:
            time.sleep(0.5)
    finally:
        stop_all(procs, token)
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lates", type=float, nargs="+", default=[-0.6, 0.0, 0.5],
                   help="seconds rank 2 posts after the others, one run each (default -0.6 0 0.5)")
    p.add_argument("--rate-mbit", type=float, default=10.0, help="every link's rate, each way (default 10)")
    p.add_argument("--segment-mb", type=float, default=1.8, help="MB each rank sends each other rank (default 1.8)")
    p.add_argument("--timeout", type=float, default=60.0, help="the group's timeout, seconds (default 60)")
    p.add_argument("--hold", type=float, default=30.0, help="seconds a failed rank stays alive after aborting")
    p.add_argument("--work-dir", type=Path, default=None, help="records and logs (default: a new /tmp folder)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # one rank of a run (internal)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    p.add_argument("--late", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--floats", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--record", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.store, args.late, args.floats, args.timeout, args.hold, args.record)
        return 0
    reason = preflight()
    if reason:
        print(f"bench/dead_peer_shaped.py: skipped: {reason}. Run it as root.")
        return 0
    lock = hold_lock("bench/dead_peer_shaped.py")
    if lock is None:
        return 1
    args.work_dir = args.work_dir or Path(f"/tmp/bench-dead-peer-{time.strftime('%Y%m%d-%H%M%S')}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    token = f"{PREFIX}dead-peer-{os.getpid()}"
    wan = Wan(ipaddress.ip_network("10.77.0.0/24"), args.rate_mbit, 0.0, (args.rate_mbit,) * RANKS)
    teardown(PREFIX)
    results = {}
    try:
        setup(wan)
        for late in args.lates:
            results[f"{late:g}"] = run_setting(wan, late, args, token)
    finally:
        kill_token(token, prefix=True)
        teardown(PREFIX)
        LOCK_FILE.unlink(missing_ok=True)
        lock.close()
    print(f"\n4 ranks, links {args.rate_mbit:g} Mbit/s each way, {args.segment_mb:g} MB per pair, rank 3 killed "
          f"50 ms after posting, group timeout {args.timeout:g} s\n")
    print("| wait / timeout | rank 2 posts (s after the others) | rank | wait (s) | how it ended |")
    print("|---:|---:|---:|---:|---|")
    for late, rows in results.items():
        for r in rows:
            print(f"| {r['seconds'] / args.timeout:.2f} | {late} | {r['rank']} | {r['seconds']:.2f} | {r['ended']} |")
    if args.out:
        write_json(args.out, {"meta": where_measured(rate_mbit=args.rate_mbit, segment_mb=args.segment_mb,
                                                     timeout_s=args.timeout), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
