"""Cross-island traffic of a DiLoCo federation vs DDP all-reduce, and the stall after a kill.

Six runs on this machine, one after the other, all llama3 debug on Shakespeare:

1. federation: `archipelago local --islands 1,1` (two 1-rank islands, so the only traffic
   between processes that trains anything is the cross-island outer sync);
2. baseline: `archipelago train --nproc 2 --parallelism.data_parallel ddp`, each rank with
   one island's batch, all-reducing gradients every step;
3. kill drill: run 1 again with `--kill 1@T`, T mid-round after a couple of outer steps
   (taken from run 1's timing); island 0's metrics give the survivor's stall.
4. signing (unless --no-signing): run 1 with a federation key (every row a signed frame,
   every receiver checking the tag and its sender's signature, and the members' receipts:
   federation/receipts.py), then top-k without and with a key; each compared with
   the same codec without a key: bytes per token, round time, and the encode + open/check/
   sum seconds per round against the round (the target: signing under 5% of a round).
   With --signing-only, only these runs and run 1 on torchft's gloo group (the transport:
   ours, `tcp`, the default, against gloo), at any --flavor.
5. dashboard (unless --no-dashboard): bench/dashboard.py, one-rank runs with and without
   pushing every step record to a federation dashboard (the target: step time ratio <= 1.01).

Bytes are measured, not computed: the kernel's per-socket TCP counters (`ss -tinHea`,
tcp_info bytes_sent, retransmissions included) of every process we started, polled every
--poll-s seconds keeping per-socket maxima, plus `ss -tinHE`, which reports each socket's
final counters as it closes, so the bytes after the last poll are not lost. Every
--attribute-s seconds each socket of our processes (inode in /proc/PID/fd) is tied to its
endpoints (a sock_diag netlink dump, as ss does), so even a connection that lives a few
tens of milliseconds is attributed; a process gets its role from its environment (island
token / torchrun RANK). Only bytes between two different islands (two ranks for DDP)
count: lighthouse heartbeats/quorums and torchrun's store are left out (`control`).
Without `ss`, the loopback interface's tx counter (/proc/net/dev) is used, which includes
everything on the machine; the JSON says which method was used.

Reported (table, ratio first, and JSON): bytes per token and per committed outer step over
the whole run, and `steady_*` over rounds 2..n only (round 1 also carries the joining
island's copy of the global state), next to the payload the trainer reports (outer_step
`bytes_sent`, summed over islands); DDP likewise (steady: between its first and last step
record). The stall: island 0's time from its last outer step before the kill to the next
one, next to run 1's median round and the time the survivor spent blocked in that sync.

    python bench/federation.py [--steps 40] [--sync-steps 10] [--ddp-steps 20] [--out FILE]
    python bench/federation.py --signing-only --flavor small --steps 15 --sync-steps 5 --batch-size 2
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dashboard import measure_dashboard  # noqa: E402
from dashboard import print_table as print_dashboard  # noqa: E402
from harness import (  # noqa: E402
    REPO,
    Monitor,
    RunResult,
    num,
    outer_steps,
    ratio,
    read_jsonl,
    run_job,
    run_main,
    seq_len_of,
    tokens_trained,
    where_measured,
    write_json,
)
from meter import TrafficMonitor, make_monitor  # noqa: E402

# The same switches for every run: no checkpoints, validation or TensorBoard traffic/IO.
COMMON_OVERRIDES = ["--checkpoint.no_enable", "--training.val_every", "0", "--metrics.no_tensorboard"]


# ------------------------------------------------------------- run results


def round_intervals(records: list[dict[str, Any]]) -> list[float]:
    times = [r["time"] for r in records]
    return [b - a for a, b in zip(times, times[1:])]


def steady_federation_bytes(monitor: Any, islands: list[Path]) -> float | None:
    """Measured bytes per outer step over rounds 2..n. The first round also carries one-off
    traffic (a joining island's copy of the global state, connection set-up). A round's
    bytes are all sent before its outer_step records (the sync ends the round) and the next
    round's only seconds later, so counters read just after the first and the last
    committed round's records bracket the rounds in between."""
    if not isinstance(monitor, TrafficMonitor):
        return None
    ends: dict[int, float] = {}
    for island in islands:
        for record in outer_steps(island):
            if record.get("committed"):
                ends[record["outer_step"]] = max(ends.get(record["outer_step"], 0.0), record["time"])
    times = [ends[k] for k in sorted(ends)]
    if len(times) < 2:
        return None
    return (monitor.peer_bytes_after(times[-1]) - monitor.peer_bytes_after(times[0])) / (len(times) - 1)


def steady_ddp_bytes(monitor: Any, run_dir: Path) -> tuple[float, int] | None:
    """Measured (bytes, steps) between the first and the last step record: leaves out the
    start (DDP's initial broadcast of the weights, connection set-up). A record is written
    after its step's all-reduce and the next step's starts only in its backward pass, so
    counters read just after the records bracket whole steps (up to a fraction of a step
    when a poll comes late, at both ends alike)."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r and "time" in r]
    if not isinstance(monitor, TrafficMonitor) or len(records) < 2:
        return None
    first, last = records[0], records[-1]
    sent = monitor.peer_bytes_after(last["time"]) - monitor.peer_bytes_after(first["time"])
    return sent, last["step"] - first["step"]


def metering(args: argparse.Namespace) -> Callable[[str, float], Monitor]:
    """The traffic meter of one run (meter.py), at the periods given."""
    return lambda token, max_s: make_monitor(token, args.poll_s, args.attribute_s, max_s)


def train_args(args: argparse.Namespace, steps: int) -> list[str]:
    # Warmup must stay below the step count (a short DDP run would otherwise be refused).
    flavor = ["--model.flavor", args.flavor] if args.flavor else []
    return ["--config", str(args.config), *flavor, "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", str(min(20, steps // 2)), *COMMON_OVERRIDES]


def federation_cmd(args: argparse.Namespace, run_dir: Path, kill_at: float | None = None,
                   extra: tuple[str, ...] = ()) -> list[str]:
    kill = ["--kill", f"1@{kill_at:.1f}"] if kill_at is not None else []
    return [sys.executable, "-m", "archipelago.launch.cli", "local", "--islands", "1,1", "--no-table", *kill,
            *train_args(args, args.steps), "--fault_tolerance.sync_steps", str(args.sync_steps),
            "--training.batch_size", str(args.batch_size), "--job.run_dir", str(run_dir), *extra]


def ddp_cmd(args: argparse.Namespace, run_dir: Path) -> list[str]:
    # batch_size is the job's global batch: 2 ranks x one island's batch each.
    return [sys.executable, "-m", "archipelago.launch.cli", "train", "--nproc", "2",
            *train_args(args, args.ddp_steps), "--parallelism.data_parallel", "ddp",
            "--training.batch_size", str(2 * args.batch_size), "--job.run_dir", str(run_dir)]


def run_checked(cmd: list[str], root: Path, name: str, args: argparse.Namespace) -> RunResult:
    """run_job with its log in ROOT/NAME.log; a failed run raises, naming the log."""
    run = run_job(cmd, root / f"{name}.log", args.timeout, metering(args))
    if run.exit_code != 0:
        raise RuntimeError(f"{name} run failed (exit code {run.exit_code}); see {root / f'{name}.log'}")
    return run


def measure_federation(args: argparse.Namespace, root: Path, name: str = "federation",
                       extra: tuple[str, ...] = ()) -> dict[str, Any]:
    run_dir = root / name
    run = run_checked(federation_cmd(args, run_dir, extra=extra), root, name, args)
    fed = json.loads((run_dir / "federation.json").read_text())
    committed = sum(1 for entry in fed["outer_steps"] if entry["islands"])
    islands = [run_dir / f"island-{i['id']}" for i in fed["islands"]]
    tokens = sum(tokens_trained(d) for d in islands)
    # What the trainer says it handed to the cross-island all-reduce, summed over islands.
    payload = sum(r.get("bytes_sent", 0) for d in islands for r in outer_steps(d))
    records0 = outer_steps(islands[0])
    traffic = run.traffic
    sent = traffic["peer_bytes"]
    steady = steady_federation_bytes(run.monitor, islands)
    # Tokens one round adds: every island's batch x sync_steps inner steps.
    round_tokens = len(islands) * args.batch_size * args.sync_steps * seq_len_of(run_dir / "island-0")
    return {"cmd": run.cmd, "exit_code": run.exit_code, "wall_s": run.wall_s, "run_dir": str(run_dir),
            "outer_steps": committed, "tokens": tokens, "bytes_sent": sent,
            "bytes_per_outer_step": sent / committed if committed else None,
            "bytes_per_token": sent / tokens if tokens else None,
            "steady_bytes_per_outer_step": steady,
            "steady_bytes_per_token": steady / round_tokens if steady is not None else None,
            "payload_bytes_per_outer_step": payload / committed if committed else None,
            "round_intervals_s": round_intervals(records0),
            "median_sync_s": statistics.median(r["sync_s"] for r in records0) if records0 else None,
            # Encoding, signing, opening, checking and summing rows: what signing adds to.
            "median_codec_s": (statistics.median(r.get("encode_s", 0) + r.get("decode_s", 0) for r in records0[1:])
                               if len(records0) > 1 else None),
            "outer_step_offsets_s": [r["time"] - fed["start_time"] for r in records0],
            "traffic": traffic}


def measure_ddp(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_dir = root / "ddp"
    run = run_checked(ddp_cmd(args, run_dir), root, "ddp", args)
    summary = json.loads((run_dir / "summary.json").read_text())
    traffic = run.traffic
    sent, tokens, steps = traffic["peer_bytes"], int(summary["tokens"]), int(summary["steps"])
    steady = steady_ddp_bytes(run.monitor, run_dir)
    steady_per_step = steady[0] / steady[1] if steady and steady[1] else None
    return {"cmd": run.cmd, "exit_code": run.exit_code, "wall_s": run.wall_s, "run_dir": str(run_dir),
            "steps": steps, "tokens": tokens, "bytes_sent": sent,
            "bytes_per_step": sent / steps if steps else None,
            "bytes_per_token": sent / tokens if tokens else None,
            "steady_bytes_per_step": steady_per_step,
            "steady_bytes_per_token": steady_per_step / (tokens / steps) if steady_per_step and steps else None,
            "gradient_bytes_per_rank": int(summary["params"]) * 4,  # fp32 gradients, for reference
            "traffic": traffic}


# The signed exchange against the plain one, per codec (fp32 plain is the main run).
SIGNING = (("fp32", True), ("topk", False), ("topk", True))


def measure_signing(args: argparse.Namespace, root: Path, fp32_plain: dict[str, Any]) -> list[dict[str, Any]]:
    """The federation again with a federation key (signed rows) and with top-k, each
    against the same codec without a key: bytes per token, round time, codec seconds."""
    key_file = root / "fed.key"
    key_file.write_text(secrets.token_hex(32) + "\n")  # what `archipelago secret new` writes
    key_file.chmod(0o600)
    runs = {("fp32", False): fp32_plain}
    for codec, signed in SIGNING:
        keyed = ("--federation_security.key_file", str(key_file)) if signed else ()
        extra = ("--fault_tolerance.codec", codec, *keyed)
        runs[(codec, signed)] = measure_federation(args, root, f"{codec}-{'signed' if signed else 'plain'}", extra)
    rows = []
    for codec in ("fp32", "topk"):
        plain, signed = runs[(codec, False)], runs[(codec, True)]
        plain_round = statistics.median(plain["round_intervals_s"]) if plain["round_intervals_s"] else None
        signed_round = statistics.median(signed["round_intervals_s"]) if signed["round_intervals_s"] else None
        added = (signed["median_codec_s"] - plain["median_codec_s"]
                 if signed["median_codec_s"] is not None and plain["median_codec_s"] is not None else None)
        rows.append({"codec": codec, "bytes_ratio": ratio(signed["steady_bytes_per_token"],
                                                          plain["steady_bytes_per_token"]),
                     "round_ratio": ratio(signed_round, plain_round),
                     "signing_share": ratio(added, signed_round),
                     "signed_bytes_per_token": signed["steady_bytes_per_token"],
                     "plain_bytes_per_token": plain["steady_bytes_per_token"],
                     "signed_round_s": signed_round, "plain_round_s": plain_round,
                     "signed_codec_s": signed["median_codec_s"], "plain_codec_s": plain["median_codec_s"]})
    return rows


def measure_transport(args: argparse.Namespace, root: Path, tcp_plain: dict[str, Any]) -> dict[str, Any]:
    """The plain fp32 federation on torchft's gloo group against the same on ours (`tcp`,
    the default: no peer can abort this process): round time and codec seconds."""
    gloo = measure_federation(args, root, "fp32-gloo", ("--fault_tolerance.process_group", "gloo"))
    tcp_round = statistics.median(tcp_plain["round_intervals_s"]) if tcp_plain["round_intervals_s"] else None
    gloo_round = statistics.median(gloo["round_intervals_s"]) if gloo["round_intervals_s"] else None
    return {"round_ratio": ratio(tcp_round, gloo_round), "tcp_round_s": tcp_round, "gloo_round_s": gloo_round,
            "tcp_sync_s": tcp_plain["median_sync_s"], "gloo_sync_s": gloo["median_sync_s"],
            "tcp_bytes_per_token": tcp_plain["steady_bytes_per_token"],
            "gloo_bytes_per_token": gloo["steady_bytes_per_token"]}


def default_kill_at(federation: dict[str, Any], after_outer: int) -> float:
    """Seconds after the launcher's start: half a round after outer step `after_outer`
    of the first run, so the kill lands mid-round with a couple of rounds behind it."""
    offsets, intervals = federation["outer_step_offsets_s"], federation["round_intervals_s"]
    if len(offsets) < after_outer or not intervals:
        raise RuntimeError("the federation run committed too few outer steps to place the kill: "
                           "raise --steps or lower --sync-steps, or give --kill-at")
    return offsets[after_outer - 1] + 0.5 * statistics.median(intervals)


def measure_stall(args: argparse.Namespace, root: Path, kill_at: float, attempt: int) -> dict[str, Any]:
    run_dir = root / f"kill-{attempt}"
    # No traffic monitor: only island 0's clock matters here. Exit code is nonzero by
    # design (island 1 was killed and not restarted); island 0's own code must be 0.
    run = run_job(federation_cmd(args, run_dir, kill_at), root / f"kill-{attempt}.log", args.timeout, None)
    fed = json.loads((run_dir / "federation.json").read_text())
    kills = [e for e in fed["events"] if e.get("event") == "kill"]
    survivor = next(i for i in fed["islands"] if i["id"] == 0)
    result: dict[str, Any] = {"cmd": run.cmd, "exit_code": run.exit_code, "wall_s": run.wall_s,
                              "run_dir": str(run_dir), "kill_at_s": kill_at,
                              "survivor_exit_code": survivor["exit_code"], "stall_s": None}
    if not kills:
        result["note"] = "the kill did not fire (island 1 had already exited)"
        return result
    kill_time = kills[0]["time"]
    records = outer_steps(run_dir / "island-0")
    before = [r for r in records if r["time"] <= kill_time]
    after = [r for r in records if r["time"] > kill_time]
    result.update(kill_time=kill_time, round_intervals_s=round_intervals(records))
    if not before or not after:
        result["note"] = "no outer step of island 0 on both sides of the kill: adjust --kill-at / --steps"
        return result
    last, nxt = before[-1], after[0]
    result.update(stall_s=nxt["time"] - last["time"], last_outer_step_before_kill=last["outer_step"],
                  kill_into_round_s=kill_time - last["time"], next_outer_step=nxt["outer_step"],
                  next_committed=nxt["committed"], next_participants=nxt["participants"],
                  next_sync_s=nxt["sync_s"])
    if survivor["exit_code"] != 0:
        result["note"] = f"island 0 did not survive the kill (exit code {survivor['exit_code']})"
    return result


def kill_drill(args: argparse.Namespace, root: Path, federation: dict[str, Any],
               median_round: float | None) -> dict[str, Any]:
    """The kill run, aimed mid-round. Startup time varies between runs (seconds on a busy
    machine), so when the kill landed outside the middle 60% of a round it is run again
    (--kill-retries times) with the kill time corrected by the error seen."""
    kill_at = args.kill_at if args.kill_at is not None else default_kill_at(federation, args.kill_after_outer)
    retries = args.kill_retries if args.kill_at is None and median_round else 0
    attempts: list[dict[str, Any]] = []
    for attempt in range(1 + retries):
        result = measure_stall(args, root, kill_at, attempt)
        attempts.append({k: result.get(k) for k in ("kill_at_s", "kill_into_round_s", "stall_s", "cmd")})
        into = result.get("kill_into_round_s")
        if into is None or median_round is None or 0.2 <= into / median_round <= 0.8:
            break
        kill_at = max(1.0, kill_at + 0.5 * median_round - into)
    result["attempts"] = attempts
    return result


# ------------------------------------------------------------------- report


def print_signing(result: dict[str, Any]) -> None:
    if result.get("signing"):
        print("\nsigned rows (a federation key) against plain rows, same codec; codec s = encode + open, "
              "check (receipts included), sum per round (medians, island 0)\n")
        print("| ratio (signed / plain bytes per token) | round time ratio | signing share of the round "
              "| codec | signed bytes/token | plain bytes/token | signed round s | plain round s "
              "| signed codec s | plain codec s |")
        print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        for r in result["signing"]:
            print(f"| {num(r['bytes_ratio'], '.4f')} | {num(r['round_ratio'], '.3f')} "
                  f"| {num(r['signing_share'], '.3%')} | {r['codec']} "
                  f"| {num(r['signed_bytes_per_token'], ',.1f')} | {num(r['plain_bytes_per_token'], ',.1f')} "
                  f"| {num(r['signed_round_s'], '.2f')} | {num(r['plain_round_s'], '.2f')} "
                  f"| {num(r['signed_codec_s'], '.3f')} | {num(r['plain_codec_s'], '.3f')} |")
    transport = result.get("transport")
    if transport:
        print("\nthe cross-island group: ours (tcp, the default) against torchft's gloo, fp32, no key\n")
        print("| ratio (tcp / gloo round s) | tcp round s | gloo round s | tcp sync s | gloo sync s "
              "| tcp bytes/token | gloo bytes/token |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        t = transport
        print(f"| {num(t['round_ratio'], '.3f')} | {num(t['tcp_round_s'], '.2f')} | {num(t['gloo_round_s'], '.2f')} "
              f"| {num(t['tcp_sync_s'], '.2f')} | {num(t['gloo_sync_s'], '.2f')} "
              f"| {num(t['tcp_bytes_per_token'], ',.1f')} | {num(t['gloo_bytes_per_token'], ',.1f')} |")


def print_tables(result: dict[str, Any]) -> None:
    fed, ddp, kill = result["federation"], result["ddp"], result["kill"]
    print(f"\nllama3 debug, {result['batch_size']} x {result['seq_len']} tokens per island (DDP rank) "
          f"per step; federation: 2 islands x 1 rank, {result['steps']} steps, sync every "
          f"{result['sync_steps']}; DDP: 2 ranks, {ddp['steps']} steps; bytes: {fed['traffic']['method']}\n")
    print("| ratio (DDP / DiLoCo bytes per token) | steady-state ratio | DiLoCo bytes/token "
          "| DDP bytes/token | DiLoCo bytes/outer step | steady bytes/outer step "
          "| trainer payload/outer step | outer steps |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {num(result['ratio'], '.2f')} | {num(result['steady_ratio'], '.2f')} "
          f"| {num(result['bytes_per_token'], ',.0f')} | {num(result['ddp_bytes_per_token'], ',.0f')} "
          f"| {num(fed['bytes_per_outer_step'], ',.0f')} | {num(fed['steady_bytes_per_outer_step'], ',.0f')} "
          f"| {num(fed['payload_bytes_per_outer_step'], ',.0f')} | {fed['outer_steps']} |")
    print(f"\nsurvivor (island 0) after `--kill 1@{kill['kill_at_s']:.1f}` (no restart)\n")
    print("| ratio (stall / median round) | stall s | median round s (no kill) | next sync s "
          "| median sync s (no kill) | kill into round s | islands after |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {num(result['stall_ratio'], '.2f')} | {num(result['stall_s'], '.1f')} "
          f"| {num(result['median_round_s'], '.1f')} | {num(kill.get('next_sync_s'), '.2f')} "
          f"| {num(fed['median_sync_s'], '.2f')} | {num(kill.get('kill_into_round_s'), '.1f')} "
          f"| {kill.get('next_participants', '-')} |")
    if len(kill["attempts"]) > 1:
        misses = ", ".join(f"{a['kill_into_round_s']:.1f}" for a in kill["attempts"][:-1])
        print(f"\n(earlier attempts landed {misses} s into a round, off its middle; kill time corrected)")
    if kill.get("note"):
        print(f"\nnote: {kill['note']}")
    print_signing(result)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/debug.toml")
    p.add_argument("--steps", type=int, default=40, help="inner steps of each federation run")
    p.add_argument("--sync-steps", type=int, default=10, help="inner steps between outer steps")
    p.add_argument("--ddp-steps", type=int, default=20, help="steps of the DDP baseline")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per island (per DDP rank) per step")
    p.add_argument("--kill-after-outer", type=int, default=2,
                   help="place the kill half a round after this outer step (timed by the first run)")
    p.add_argument("--kill-at", type=float, default=None, help="kill island 1 at this many seconds instead")
    p.add_argument("--kill-retries", type=int, default=1,
                   help="rerun the kill drill this many times when the kill missed the middle of a round")
    p.add_argument("--poll-s", type=float, default=0.2, help="socket counter polling period (ss)")
    p.add_argument("--attribute-s", type=float, default=0.05,
                   help="period of mapping sockets to processes (/proc/PID/fd + sock_diag, cheap)")
    p.add_argument("--timeout", type=float, default=600, help="hard limit per run, seconds")
    p.add_argument("--no-dashboard", action="store_true",
                   help="skip the dashboard's cost (bench/dashboard.py: step time with and without pushing)")
    p.add_argument("--no-signing", action="store_true",
                   help="skip the three runs that measure signed rows (a federation key) and top-k")
    p.add_argument("--flavor", default="", help="model flavor (default: the config's; e.g. small, 124M)")
    p.add_argument("--signing-only", action="store_true",
                   help="only the signing runs (plain and signed, fp32 and top-k) and the transport comparison "
                        "(tcp against gloo): what signing, checking and the receipts cost at a model size")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="run directories (default: a new /tmp/bench-fed-* folder)")
    p.add_argument("--out", type=Path, default=REPO / "runs/bench/federation.json",
                   help="write the results as JSON here")
    args = p.parse_args()
    if args.steps // args.sync_steps < args.kill_after_outer + 1:
        p.error("--steps must allow at least --kill-after-outer + 1 outer steps")
    return args


def main() -> None:
    args = parse_args()
    root = args.work_dir or Path(f"/tmp/bench-fed-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
    root.mkdir(parents=True, exist_ok=True)
    fed = measure_federation(args, root)
    if args.signing_only:
        result = {"signing": measure_signing(args, root, fed), "transport": measure_transport(args, root, fed),
                  "flavor": args.flavor or "the config's", "config": str(args.config), "steps": args.steps,
                  "sync_steps": args.sync_steps, "batch_size": args.batch_size, "work_dir": str(root),
                  "federation": fed, **where_measured()}
        print(f"\n{args.config.name} {args.flavor}: 2 islands x 1 rank, {args.steps} steps, sync every "
              f"{args.sync_steps}, batch {args.batch_size}")
        print_signing(result)
        write_json(args.out, result)
        return
    ddp = measure_ddp(args, root)
    median_round = statistics.median(fed["round_intervals_s"]) if fed["round_intervals_s"] else None
    kill = kill_drill(args, root, fed, median_round)
    signing = [] if args.no_signing else measure_signing(args, root, fed)
    dashboard = None if args.no_dashboard else measure_dashboard(
        argparse.Namespace(config=args.config, steps=30, batch_size=args.batch_size, repeats=3, island_threads=1,
                           timeout=args.timeout),
        root)
    seq_len = seq_len_of(Path(fed["run_dir"]) / "island-0")
    result = {
        "ratio": ratio(ddp["bytes_per_token"], fed["bytes_per_token"]),
        "steady_ratio": ratio(ddp["steady_bytes_per_token"], fed["steady_bytes_per_token"]),
        "bytes_per_token": fed["bytes_per_token"], "ddp_bytes_per_token": ddp["bytes_per_token"],
        "bytes_per_outer_step": fed["bytes_per_outer_step"],
        "steady_bytes_per_outer_step": fed["steady_bytes_per_outer_step"],
        "payload_bytes_per_outer_step": fed["payload_bytes_per_outer_step"],
        "outer_steps": fed["outer_steps"], "tokens": fed["tokens"], "ddp_tokens": ddp["tokens"],
        "stall_s": kill["stall_s"], "median_round_s": median_round,
        "stall_ratio": ratio(kill["stall_s"], median_round),
        "steps": args.steps, "sync_steps": args.sync_steps, "ddp_steps": args.ddp_steps,
        "batch_size": args.batch_size, "seq_len": seq_len, "config": str(args.config),
        "measurement": fed["traffic"]["method"], "work_dir": str(root),
        "commands": [fed["cmd"], ddp["cmd"], *(a["cmd"] for a in kill["attempts"])],
        "federation": fed, "ddp": ddp, "kill": kill, "signing": signing, "dashboard": dashboard,
        **where_measured(),
    }
    print_tables(result)
    if dashboard is not None:
        print_dashboard(dashboard)
    write_json(args.out, result)


if __name__ == "__main__":
    run_main(main)
