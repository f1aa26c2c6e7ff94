"""Training across a shaped WAN: DDP all-reduce vs DiLoCo (fp32, int8, top-k, streaming).

Builds its own test hosts on this machine: one network namespace per island
(`arch-wan-i0`, `arch-wan-i1`) and one for the lighthouse (`arch-wan-lh`), each joined by
a veth pair to a Linux bridge that lives in a namespace of its own (`arch-wan-net`), so
nothing is added to the host's own network. Each island's link is shaped in both
directions with `tc ... tbf` (island-side egress = upload, bridge-side egress = download)
to --rate-mbit (default 100 Mbit/s); the lighthouse link is not shaped. Only addresses of a
private /24 (--subnet, default 10.77.0.0/24, checked to be unused on the host) are used.

The same training (llama3 debug, 2 islands of 1 CPU rank, batch 8 x 128 tokens per island)
runs for the same wall-clock budget (--budget, `training.time_budget_s`) in each setting:

  a  DDP: one 2-rank job, one rank per island namespace (torchrun --nnodes 2, static
     rendezvous), gradients all-reduced over the WAN every step, global batch 2 x 8
  b  DiLoCo fp32          c  DiLoCo int8
  d  DiLoCo top-k (5 % of every 256 values, 1 bit each; outer SGD without momentum)
  e  streaming DiLoCo, int8, 4 fragments, fragment_sync_delay 2 (exchange overlaps steps)
  f  DiLoCo with codec = "auto"
  g  streaming DiLoCo with codec = "auto", 4 fragments, fragment_sync_delay 2 (each
     fragment's exchange may take half its 2 overlapped steps' seconds)
     (f and g are not in the default set: --settings a,b,c,d,e,f,g, or --codec auto for f,g)
  h  decoupled rounds, int8 (docs/rounds.md): once a member measured an exchange above 5% of
     its round, each exchange overlaps the next round (not in the default set)
  i  DiLoCo int8 with `exchange_repair = "segment"`: a member that dies in the exchange
     costs the survivors only what they lack (docs/rounds.md; c restarts the exchange whole);
     with --inject, c and i compare the two repairs over the shaped links (not in the default set)
  r  h with each overlapped exchange applied --arrival-steps inner steps into the next round
     (`arrival_steps`): the islands move to its outer step plus their progress since, so no
     row enters stale; an exchange not in by then is waited for there (not in the default set)
  t  h with the island on the slowest link thin (docs/rounds.md): carried by island 0, it joins
     no quorum, uploads its int8 row every --carry-rounds rounds and downloads the global
     weights in bf16; its "rows entered" are the rows island 0's committed rows carried in,
     its utilisation 1 - its carries' seconds / its run's (not in the default set)

`--island-rates 100,100,5` shapes each island's link to its own rate; their count is the
number of islands (three here: a thin-link island beside two fast ones). The table then
also gives each island's rows that entered the global weights (committed rounds in which
its own row was accepted with a weight) and its steady utilisation (without the first
round and the end of the run). `--island-slowdowns 1,3` also slows island 1's inner steps
3x (`island.slowdown`, an emulation): islands of unlike speeds over the shaped links.
`--inject 3:die_in_exchange@3` makes island 3 SIGKILL itself with its row of outer step 3's
exchange in flight (the fault grammar of `archipelago local --inject`); the survivors
retry, and the table then also gives each survivor's retries, the seconds from the failed
exchange to the end of the one that finished the round (`retry_s`), that round's whole
wait (`sync_s`) and the bytes it sent in it, and whether the survivors' global weights
agree at the end. `--heartbeat-timeout-ms` sets the lighthouse's (how soon a dead island
leaves the quorum).

Reported per setting (markdown table on stdout, ratio column first; JSON with --out):
- bytes across the WAN per token trained: measured on the links, not taken from logs. The
  bridge ports' counters (`ip -s -j link`) are read before and after each run and sampled
  every --sample-s seconds during it. WAN bytes = what the islands sent into the bridge
  minus what the bridge delivered to the lighthouse (its own veth), so each byte between
  islands counts once, at its sender; lighthouse bytes are reported apart. The whole run is
  counted (start-up and the join round: DiLoCo islands start from the same seeded weights
  with `init_sync = false`, DDP broadcasts rank 0's); `steady_bytes_per_token` is the
  same over the rounds after the join round (DDP: between its first and second-to-last
  step record).
- utilisation of each island: `archipelago.metrics.islands.round_totals` (compute seconds /
  wall seconds from the end of the join round to the end of the last round). DDP logs no
  compute time, so there it is estimated: steps x the no-network step time / wall seconds
  between its first and second-to-last step record (the last one also holds the final
  evaluation; DDP logs every step here); the no-network step time is the median
  compute_s per inner step of the DiLoCo islands of this run (same per-rank batch, same two
  processes on the cores), or, when no DiLoCo setting runs, of two standalone islands
  trained for a few steps (calibration).
- tokens trained (summary.json of each island / of the DDP job) and the validation loss of
  the final step (`training.val_every` larger than any run: the final step evaluates).

Everything created (namespaces with their veths, bridge and qdiscs, processes) is removed
at the end, also after Ctrl-C, SIGTERM, SIGHUP or an exception; leftovers of a crashed
earlier run (namespaces named arch-wan-*, processes carrying an arch-wan-* token) are
removed at the start; /run/arch-wan.lock keeps two runs apart. Run directories and logs
stay in --work-dir. Needs root; as another user it prints why and exits 0.

Every island gets LOCAL_ADDR (its namespace's address): islands advertise it to each
other for the torchft manager and for recovery, since the host's name resolves to
127.0.0.1 inside every namespace.

Reproduce (measured on a 2-core CPU machine: about 7 minutes at the defaults, about 10 at
20 Mbit/s; a run with --budget 25 took 4 minutes):

    sudo .venv/bin/python bench/wan.py [--out runs/bench/wan.json]
    sudo .venv/bin/python bench/wan.py --rate-mbit 20 --settings a,b,e
    sudo .venv/bin/python bench/wan.py --budget 25 --settings b,d      # a quick look
    sudo .venv/bin/python bench/wan.py --settings c,i --island-rates 10,10,10,10 \
        --inject 3:die_in_exchange@3 --heartbeat-timeout-ms 1000 --budget 150   # the two repairs
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    REPO,
    Proc,
    base_env,
    interrupt,
    log_tail,
    num,
    python_bin,
    ratio,
    read_jsonl,
    read_summary,
    set_signals,
    start,
    stop_all,
    wait_for_line,
    where_measured,
    write_json,
)
from netns import (  # noqa: E402
    LH_NS,
    LOCK_FILE,
    PREFIX,
    WAN_IF,
    Sampler,
    Wan,
    hold_lock,
    in_namespace,
    link_check,
    preflight,
    setup,
    teardown,
    wan_bytes,
)

from archipelago.launch.local_options import inject_arg  # noqa: E402

LH_PORT = 29510
DDP_PORT = 29600
STATUS_EVERY_S = 20.0


@dataclass(frozen=True)
class Setting:
    key: str
    name: str
    ddp: bool = False
    args: tuple[str, ...] = ()


STREAM_FRAGMENTS, STREAM_DELAY = 4, 2
DEFAULT_SETTINGS = "a,b,c,d,e"
SETTINGS = {s.key: s for s in (
    Setting("a", "DDP all-reduce per step", ddp=True),
    Setting("b", "DiLoCo fp32", args=("--fault_tolerance.codec", "fp32")),
    Setting("c", "DiLoCo int8", args=("--fault_tolerance.codec", "int8")),
    # top-k at 5 % of every 256 values, 1 bit each (the defaults when docs/codecs.md's WAN figures
    # were measured; now 10 %, 2 bits), with the plain outer SGD that suits error feedback.
    Setting("d", "DiLoCo top-k", args=("--fault_tolerance.codec", "topk", "--fault_tolerance.topk_fraction", "0.05",
                                       "--fault_tolerance.topk_bits", "1", "--fault_tolerance.outer_momentum", "0",
                                       "--fault_tolerance.outer_lr", "1.0", "--fault_tolerance.no_outer_nesterov")),
    Setting("e", "streaming DiLoCo int8, overlap", args=(
        "--fault_tolerance.codec", "int8", "--fault_tolerance.num_fragments", str(STREAM_FRAGMENTS),
        "--fault_tolerance.fragment_sync_delay", str(STREAM_DELAY))),
    # codec = "auto": each round the densest codec whose exchange fits 5% of the round.
    Setting("f", "DiLoCo auto codec", args=("--fault_tolerance.codec", "auto")),
    # ... with streaming's overlap: an exchange may take half the steps it overlaps.
    Setting("g", "streaming DiLoCo auto codec, overlap", args=(
        "--fault_tolerance.codec", "auto", "--fault_tolerance.num_fragments", str(STREAM_FRAGMENTS),
        "--fault_tolerance.fragment_sync_delay", str(STREAM_DELAY))),
    # Decoupled rounds (docs/rounds.md): the exchange overlaps the next round once a member
    # measured it above overlap_threshold (5%) of its round; its rows enter one outer step late.
    Setting("h", "decoupled DiLoCo int8", args=("--fault_tolerance.codec", "int8",
                                                "--fault_tolerance.round_mode", "decoupled")),
    # ... with each exchange applied --arrival-steps into the next round (arrival_steps): the
    # islands move to its outer step plus their progress since, so no row is stale.
    Setting("r", "decoupled DiLoCo int8, applied on arrival", args=("--fault_tolerance.codec", "int8",
                                                                    "--fault_tolerance.round_mode", "decoupled")),
    # A member dead in the exchange: the survivors send each other only what they lack.
    Setting("i", "DiLoCo int8, segment repair", args=("--fault_tolerance.codec", "int8",
                                                      "--fault_tolerance.exchange_repair", "segment")),
    # The island on the slowest link is thin: carried by island 0 (docs/rounds.md), it uploads
    # its row every --carry-rounds rounds and downloads the global weights; the members run h.
    Setting("t", "decoupled DiLoCo int8, slowest island carried", args=(
        "--fault_tolerance.codec", "int8", "--fault_tolerance.round_mode", "decoupled",
        "--fault_tolerance.thin_islands", "1")),
)}
CARRY_PORT = 29520




def train_args(args: argparse.Namespace, run_dir: Path, batch: int, steps: int | None = None) -> list[str]:
    """What every setting shares: the same model, data, per-island batch and time budget.
    Without `steps` the step count is out of reach, so the budget ends the run; the
    islands evaluate at the start, at --equal-steps (equal tokens in every DiLoCo setting)
    and at their final step."""
    if steps is not None:  # calibration: a fixed short run, no evaluation
        limits = ["--training.steps", str(steps), "--training.val_every", "0", "--lr_scheduler.warmup_steps", "2"]
    else:
        limits = ["--training.steps", "1000000", "--training.time_budget_s", f"{args.budget:g}",
                  "--training.val_every", str(args.equal_steps)]
    return ["--config", str(args.config), "--job.run_dir", str(run_dir), *limits,
            "--training.batch_size", str(batch), "--checkpoint.no_enable", "--metrics.no_tensorboard",
            "--metrics.progress", "plain"]


def exchange_timeout_ms(args: argparse.Namespace) -> int:
    """A collective must outlast an fp32 exchange at the link rate (29 MB each way takes 12 s
    at 20 Mbit/s; the default 10 s would fail every round): 4x that, plus slack."""
    fp32_s = 2 * 4 * args.params * 8 / (min(args.rates) * 1e6)
    return int(1000 * (4 * fp32_s + 30))


def run_federation(setting: Setting, args: argparse.Namespace, wan: Wan, run_dir: Path,
                   token: str) -> tuple[list[Proc], list[Proc]]:
    """Start the lighthouse, then both islands; returns (islands, helpers)."""
    env = base_env(token, args.threads)
    # The lighthouse and the islands on non-loopback addresses need a federation key (what
    # `archipelago secret new` writes).
    key_file = run_dir / "fed.key"
    run_dir.mkdir(parents=True, exist_ok=True)
    key_file.write_text(secrets.token_hex(32) + "\n")
    key_file.chmod(0o600)
    lighthouse = start("lighthouse", in_namespace(LH_NS, wan.lh_addr, [
        python_bin(), "-m", "archipelago.launch.cli", "lighthouse", "--bind", f"{wan.lh_addr}:{LH_PORT}",
        "--min-replicas", "1", "--join-timeout-ms", "60000", "--key-file", str(key_file),
        *(["--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms)] if args.heartbeat_timeout_ms else [])]), env,
        run_dir / "lighthouse.log")
    wait_for_line(lighthouse, "lighthouse listening", 60)
    url = f"http://{wan.lh_addr}:{LH_PORT}"
    islands = []
    for k in range(wan.islands):
        addr = wan.island_addr(k)
        island_env = {**env, "LOCAL_ADDR": addr, "GLOO_SOCKET_IFNAME": WAN_IF, "TORCHFT_LIGHTHOUSE": url,
                      "ARCHIPELAGO_FEDERATION_KEY_FILE": str(key_file), **fault_env(args, k)}
        cmd = [python_bin(), "-m", "archipelago.launch.cli", "train", "--nproc", "1",
               *train_args(args, run_dir / f"island-{k}", args.batch_size),
               "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(k),
               "--fault_tolerance.group_size", str(wan.islands), "--fault_tolerance.lighthouse", url,
               "--fault_tolerance.sync_steps", str(args.sync_steps),
               "--fault_tolerance.process_group_timeout_ms", str(exchange_timeout_ms(args)),
               "--fault_tolerance.connect_timeout_ms", "60000",
               # Both islands initialise the same weights from the seed (checked at the join), so
               # none downloads them at the start, as DDP ranks need not either (DDP broadcasts them).
               "--fault_tolerance.no_init_sync", *setting.args, *slowdown_args(args, k),
               *carry_args(setting, args, wan, k), *arrival_args(setting, args), *args.extra]
        islands.append(start(f"island-{k}", in_namespace(wan.island_ns(k), addr, cmd), island_env,
                             run_dir / f"island-{k}.log"))
    return islands, [lighthouse]


def thin_island(args: argparse.Namespace) -> int:
    """The island setting t makes thin: the one on the slowest link (never island 0, its carrier)."""
    return max(range(1, len(args.rates)), key=lambda k: (-args.rates[k], k))


def arrival_args(setting: Setting, args: argparse.Namespace) -> list[str]:
    """Setting r: each overlapped exchange is applied --arrival-steps inner steps into the next round."""
    return ["--fault_tolerance.arrival_steps", str(args.arrival_steps)] if setting.key == "r" else []


def carry_args(setting: Setting, args: argparse.Namespace, wan: Wan, island: int) -> list[str]:
    """Setting t: island 0 carries the thin island, which sends its row to island 0's carry server."""
    if setting.key != "t":
        return []
    thin = thin_island(args)
    if island == 0:
        carried = args.batch_size * args.seq_len * carry_steps(args) * args.carry_rounds
        return ["--fault_tolerance.carries", str(thin), "--fault_tolerance.carried_tokens", str(carried),
                "--fault_tolerance.carry_port", str(CARRY_PORT)]
    if island == thin:
        return ["--fault_tolerance.carrier", f"http://{wan.island_addr(0)}:{CARRY_PORT}",
                "--fault_tolerance.carrier_island", "0", "--fault_tolerance.carry_rounds", str(args.carry_rounds),
                "--fault_tolerance.quorum_timeout_ms", str(exchange_timeout_ms(args))]
    return []


def carry_steps(args: argparse.Namespace) -> int:
    """The most inner steps of the thin island in one of its rounds: --sync-steps, or, time-paced
    (the resolved config's round_pacing, e.g. `--extra --fault_tolerance.round_pacing time`), its
    max_inner_steps (its steps follow its speed). Needs `resolve_facts(args)` first."""
    return args.max_inner_steps if args.round_pacing == "time" else args.sync_steps


def fault_env(args: argparse.Namespace, island: int) -> dict[str, str]:
    """The injected faults of --inject for this island, as `archipelago local` hands them over."""
    from archipelago.config.faults import ENV, env_value

    mine = [f for f in args.inject if f.island == island]
    return {ENV: env_value(mine)} if mine else {}


def dying(args: argparse.Namespace) -> set[int]:
    """Islands that kill themselves by design (--inject die_in_exchange)."""
    return {f.island for f in args.inject if f.kind == "die_in_exchange" and f.island is not None}


def slowdown_args(args: argparse.Namespace, island: int) -> list[str]:
    """`--island.slowdown F` for an island that --island-slowdowns slows (an emulation of a
    slower device: each inner step waits out F - 1 times its compute)."""
    factor = args.slowdowns[island] if args.slowdowns else 1.0
    return ["--island.slowdown", f"{factor:g}"] if factor != 1.0 else []


def run_ddp(args: argparse.Namespace, wan: Wan, run_dir: Path, token: str,
            steps: int | None = None) -> list[Proc]:
    """One torchrun per island namespace, static rendezvous on island 0; with `steps`, two
    standalone islands instead (the no-network calibration)."""
    env = {**base_env(token, args.threads), "GLOO_SOCKET_IFNAME": WAN_IF}
    procs = []
    for k in range(wan.islands):
        addr = wan.island_addr(k)
        if steps is None:
            cmd = [python_bin(), "-m", "torch.distributed.run", "--nnodes", str(wan.islands), "--node-rank", str(k),
                   "--nproc-per-node", "1", "--master-addr", wan.island_addr(0), "--master-port", str(DDP_PORT),
                   "--local-addr", addr, "-m", "archipelago.launch.cli", "train",
                   *train_args(args, run_dir, wan.islands * args.batch_size),
                   "--parallelism.data_parallel", "ddp", "--metrics.log_every", "1", *args.extra]
        else:
            folder = run_dir / f"island-{k}"
            cmd = [python_bin(), "-m", "archipelago.launch.cli", "train", "--nproc", "1",
                   *train_args(args, folder, args.batch_size, steps), "--metrics.log_every", "1", *args.extra]
        procs.append(start(f"rank-{k}" if steps is None else f"island-{k}",
                           in_namespace(wan.island_ns(k), addr, cmd), {**env, "LOCAL_ADDR": addr},
                           run_dir / (f"rank-{k}.log" if steps is None else f"island-{k}.log")))
    return procs


def last_step(folder: Path) -> Any:
    steps = [r.get("step") for r in read_jsonl(folder / "metrics.jsonl") if "event" not in r]
    return steps[-1] if steps else "-"


def supervise(label: str, workers: list[Proc], timeout_s: float, sampler: Sampler,
              folders: list[Path], dying: frozenset[str] = frozenset()) -> None:
    """Wait for the workers with a hard timeout; one failing stops the rest (they would wait
    for it at the next exchange until their own timeouts), except those named in `dying`
    (killed by design: --inject)."""
    t0 = time.monotonic()
    next_status = t0 + STATUS_EVERY_S
    first = sampler.samples[0]
    while any(p.code is None for p in workers):
        failed = [p for p in workers if p.code not in (None, 0) and p.name not in dying]
        if failed:
            raise RuntimeError(f"{failed[0].name} failed (exit code {failed[0].code}); log {failed[0].log}:\n"
                               f"{log_tail(failed[0].log)}")
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise RuntimeError(f"hard timeout: still running after {timeout_s:.0f} s (raise --timeout)")
        if now >= next_status:
            next_status = now + STATUS_EVERY_S
            moved = wan_bytes(sampler.samples[-1].ports) - wan_bytes(first.ports)
            steps = " ".join(f"{f.name} step {last_step(f)}" for f in folders)
            print(f"  [{label}] {now - t0:4.0f} s: WAN {moved / 1e6:.1f} MB; {steps}", flush=True)
        time.sleep(0.5)
    failed = [p for p in workers if p.code != 0 and p.name not in dying]
    if failed:
        raise RuntimeError(f"{failed[0].name} failed (exit code {failed[0].code}); log {failed[0].log}:\n"
                           f"{log_tail(failed[0].log)}")


def run_setting(setting: Setting, args: argparse.Namespace, wan: Wan, root: Path, run_id: str,
                step_time_s: float | None) -> dict[str, Any]:
    run_dir = root / setting.key
    token = f"{PREFIX}{run_id}-{setting.key}"
    label = f"{setting.key} {setting.name}"
    print(f"[{label}] starting ({args.budget:g} s budget); logs in {run_dir}", flush=True)
    procs: list[Proc] = []
    t0 = time.monotonic()
    sampler = Sampler(wan, args.sample_s)
    try:
        with sampler:
            if setting.ddp:
                workers = run_ddp(args, wan, run_dir, token)
                procs, folders = list(workers), [run_dir]
            else:
                workers, helpers = run_federation(setting, args, wan, run_dir, token)
                procs, folders = [*helpers, *workers], [run_dir / f"island-{k}" for k in range(wan.islands)]
            supervise(setting.key, workers, args.timeout, sampler, folders,
                      frozenset(f"island-{k}" for k in dying(args)))
    finally:
        stop_all(procs, token)
    traffic = sampler.totals()
    wall = time.monotonic() - t0
    result = (ddp_result(run_dir, sampler, step_time_s, wan.islands) if setting.ddp
              else federation_result(run_dir, sampler, args.equal_steps, wan.islands, dying(args)))
    tokens = result["tokens"]
    result.update(setting=setting.key, name=setting.name, ok=True, wall_s=wall, run_dir=str(run_dir),
                  bytes_per_token=traffic["wan_bytes"] / tokens if tokens else None, **traffic)
    print(f"[{label}] done in {wall:.0f} s: {tokens:,} tokens, WAN {traffic['wan_bytes'] / 1e6:.1f} MB "
          f"({num(result['bytes_per_token'], ',.0f')} B/token), utilisation "
          f"{' / '.join(num(u, '.2f') for u in result['utilisation'])}, val loss {num(result['val_loss'], '.4f')}",
          flush=True)
    return result


# ------------------------------------------------------------------ results


def final_val(folder: Path, summary: dict[str, Any]) -> tuple[float | None, bool]:
    """The validation loss and whether it is the final step's (the trainer keeps the last one
    it computed; one from step 0 would say nothing about training)."""
    vals = [r for r in read_jsonl(folder / "metrics.jsonl") if "event" not in r and r.get("val_loss") is not None]
    at_final = bool(vals) and vals[-1].get("step") == summary.get("steps")
    return summary.get("val_loss"), at_final


def val_at(folder: Path, step: int) -> float | None:
    """The validation loss logged at `step`, if the run evaluated there."""
    for r in read_jsonl(folder / "metrics.jsonl"):
        if "event" not in r and r.get("step") == step and r.get("val_loss") is not None:
            return float(r["val_loss"])
    return None


def federation_result(run_dir: Path, sampler: Sampler, equal_steps: int, count: int,
                      dead: set[int] | None = None) -> dict[str, Any]:
    """The run's figures over the islands that lived to its end (`dead`: killed by design)."""
    from archipelago.metrics.islands import island_records, outer_records, round_totals

    islands = []
    for k in (k for k in range(count) if k not in (dead or set())):
        folder = run_dir / f"island-{k}"
        summary = read_summary(folder, required=True)
        records = island_records(folder)
        outer = outer_records(records)
        totals = round_totals(outer)
        val, at_final = final_val(folder, summary)
        # A thin island (setting t) has no rounds: its time not training is its carries' seconds.
        carries = [r for r in records if r.get("event") == "carry"]
        carry_s = sum(float(r.get("carry_s") or 0) for r in carries)
        if carries:
            wall = float(summary.get("wall_s") or 0)
            totals["utilisation"] = 1 - carry_s / wall if wall > 0 else None
        islands.append({"summary": summary, "outer": outer, "totals": totals, "val": val, "val_final": at_final,
                        "val_equal": val_at(folder, equal_steps), "thin": bool(carries), "carry_s": carry_s})
    members = [i for i in islands if not i["thin"]]
    carried = sum(int(r.get("carried") or 0) for r in members[0]["outer"] if r.get("committed")) if members else 0
    steady = steady_window(sampler, [i["outer"] for i in members])
    window_tokens = sum(i["totals"]["tokens"] for i in islands)
    vals = [i["val"] for i in islands if i["val"] is not None]
    per_step = [i["totals"]["compute_s"] / i["totals"]["inner_steps"] for i in islands if i["totals"]["inner_steps"]]
    return {
        "tokens": sum(int(i["summary"]["tokens"]) for i in islands),
        "tokens_per_island": [int(i["summary"]["tokens"]) for i in islands],
        "val_loss": statistics.fmean(vals) if vals else None,
        "val_loss_per_island": [i["val"] for i in islands],
        "val_loss_at_final_step": all(i["val_final"] for i in islands),
        "val_loss_equal_tokens": (statistics.fmean(i["val_equal"] for i in islands)
                                  if all(i["val_equal"] is not None for i in islands) else None),
        "equal_tokens": sum(equal_steps * int(i["summary"]["tokens"]) // max(int(i["summary"]["steps"]), 1)
                            for i in islands),
        "utilisation": [i["totals"]["utilisation"] for i in islands],
        "utilisation_steady": [i["totals"]["utilisation"] if i["thin"] else steady_utilisation(i["outer"])
                               for i in islands],
        "rounds": max(len(i["outer"]) for i in islands) - 1,  # after the join round
        "inner_steps": [int(i["summary"]["steps"]) for i in islands],
        "compute_s_per_step": per_step,
        "wait_s": [i["totals"]["wait_s"] for i in islands],
        "overlap_s": [sum(float(r.get("overlap_s") or 0) for r in i["outer"]) for i in islands],
        "exposed_s": [sum(float(r.get("exposed_s") or 0) for r in i["outer"]) for i in islands],
        "payload_bytes_sent": [sum(int(r.get("bytes_sent") or 0) for r in i["outer"]) for i in islands],
        # Rounds in which the island's own pseudo-gradient entered the global weights (its row
        # accepted with a weight and the round committed), out of its rounds after the join.
        # A thin island's: its rows its carrier's committed rows carried in (one carrier: island 0).
        "entered": [carried if i["thin"] else
                    sum(1 for r in i["outer"][1:] if r.get("committed") and (r.get("weight") or 0) > 0
                        and not r.get("own_refused")) for i in islands],
        "thin_carry_s": [i["carry_s"] if i["thin"] else None for i in islands],
        "codec": islands[0]["outer"][-1].get("codec") if islands[0]["outer"] else None,
        "steady_bytes": steady,
        "steady_tokens": window_tokens,
        "steady_bytes_per_token": steady / window_tokens if steady is not None and window_tokens else None,
        **(repair_result([i["outer"] for i in islands], sorted(dead)) if dead else {}),
    }


def repair_result(outers: list[list[dict[str, Any]]], dead: list[int]) -> dict[str, Any]:
    """After an island died in an exchange: each survivor's round that retried (its retries,
    how many the segment repair finished, the seconds from the failed exchange to the end of
    the last, the round's whole wait and the bytes it sent), and whether the survivors'
    global weights agree at the end."""
    retried = [next((r for r in outer if r.get("retries")), {}) for outer in outers]
    hashes = {outer[-1].get("global_hash") for outer in outers if outer}
    return {"dead": dead, "retried_outer_step": [r.get("outer_step") for r in retried],
            "retries": [r.get("retries") for r in retried], "repaired": [r.get("repaired") for r in retried],
            "retry_s": [r.get("retry_s") for r in retried], "retry_round_sync_s": [r.get("sync_s") for r in retried],
            "retry_round_bytes_sent": [r.get("bytes_sent") for r in retried],
            "survivors_agree": len(hashes) == 1 and None not in hashes}


def steady_utilisation(outer: list[dict[str, Any]]) -> float | None:
    """Compute seconds / wall seconds between the end of the first round after the join
    and the end of the last round that trained: without the first exchange (a decoupled
    round waits for it, to measure it) and the run's end (a decoupled island waits there for
    the exchange still in flight); the rounds a long run is made of. Seconds spent evaluating
    and checkpointing (`untimed_s`) are left out, as round_totals leaves them out."""
    rounds = [r for r in outer[1:] if r.get("inner_steps")]
    if len(rounds) < 3:
        return None
    wall = float(rounds[-1]["time"] - rounds[0]["time"]) - sum(float(r.get("untimed_s") or 0.0) for r in rounds[1:])
    compute = sum(float(r["compute_s"]) for r in rounds[1:])
    return compute / wall if wall > 0 else None


def steady_window(sampler: Sampler, outers: list[list[dict[str, Any]]]) -> float | None:
    """WAN bytes from the end of the join round (the later island's) to the end of the last
    round: the rounds whose tokens round_totals counts."""
    if not all(len(o) >= 2 for o in outers):
        return None
    start_at = max(o[0]["time"] for o in outers)
    end_at = max(o[-1]["time"] for o in outers)
    a, b = sampler.wan_at(start_at), sampler.wan_at(end_at)
    return b - a if a is not None and b is not None else None


def ddp_result(run_dir: Path, sampler: Sampler, step_time_s: float | None, count: int) -> dict[str, Any]:
    summary = read_summary(run_dir, required=True)
    val, at_final = final_val(run_dir, summary)
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r and "time" in r]
    tokens_per_step = int(summary["tokens"]) // max(int(summary["steps"]), 1)
    # Window: first to second-to-last step record (the last one also carries the final
    # evaluation); every step in it is one compute phase plus one all-reduce.
    window = steps[:-1]
    utilisation = steady = steady_tokens = step_wall = None
    if len(window) >= 2:
        seconds = window[-1]["time"] - window[0]["time"]
        n = window[-1]["step"] - window[0]["step"]
        step_wall = seconds / n if n else None
        if step_time_s and seconds > 0:
            utilisation = min(1.0, n * step_time_s / seconds)
        a, b = sampler.wan_at(window[0]["time"]), sampler.wan_at(window[-1]["time"])
        if a is not None and b is not None:
            steady, steady_tokens = b - a, n * tokens_per_step
    return {
        "tokens": int(summary["tokens"]), "tokens_per_island": [int(summary["tokens"]) // count] * count,
        "val_loss": val, "val_loss_per_island": [val] * count, "val_loss_at_final_step": at_final,
        "utilisation": [utilisation] * count,
        "utilisation_method": "estimate: steps x no-network step time / wall seconds between the first "
                              "and the second-to-last step record",
        "no_network_step_s": step_time_s, "step_wall_s": step_wall,
        "rounds": int(summary["steps"]), "inner_steps": [int(summary["steps"])] * count,
        "steady_bytes": steady, "steady_tokens": steady_tokens,
        "steady_bytes_per_token": steady / steady_tokens if steady is not None and steady_tokens else None,
    }


def calibrate(args: argparse.Namespace, wan: Wan, root: Path, run_id: str) -> float:
    """No-network step time: two standalone islands side by side (as DDP's two ranks run)."""
    run_dir, token = root / "calibration", f"{PREFIX}{run_id}-calibration"
    print(f"[calibration] {args.calibration_steps} steps of two standalone islands (DDP's no-network "
          f"step time); logs in {run_dir}", flush=True)
    procs: list[Proc] = []
    try:
        procs = run_ddp(args, wan, run_dir, token, steps=args.calibration_steps)
        with Sampler(wan, args.sample_s) as sampler:
            supervise("calibration", procs, args.timeout, sampler,
                      [run_dir / f"island-{k}" for k in range(wan.islands)])
    finally:
        stop_all(procs, token)
    per_step = []
    for k in range(wan.islands):
        times = [r["time"] for r in read_jsonl(run_dir / f"island-{k}" / "metrics.jsonl")
                 if "event" not in r and "time" in r][2:]  # the first steps warm up
        per_step += [b - a for a, b in zip(times, times[1:])]
    if not per_step:
        raise RuntimeError("calibration logged too few steps (raise --calibration-steps)")
    step_s = statistics.median(per_step)
    print(f"[calibration] {step_s:.3f} s per step", flush=True)
    return step_s
# ------------------------------------------------------------------ report


def print_table(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    ddp = results.get("a", {})
    delay = f", +{meta['delay_ms']:g} ms delay" if meta["delay_ms"] else ""
    rates = ", ".join(f"{r:g}" for r in meta["rates"])
    print(f"\n{meta['model']}, {meta['islands']} islands x 1 CPU rank, batch {meta['batch_size']} x {meta['seq_len']} "
          f"tokens per island (DDP: global batch {meta['islands'] * meta['batch_size']}); {meta['budget_s']:g} s "
          f"budget per setting; links shaped to {rates} Mbit/s each way (island 0 -> 1 measured "
          f"{num(meta['link_mbit'], '.1f')} Mbit/s){delay}; "
          f"DiLoCo sync every {meta['sync_steps']} inner steps (streaming: {STREAM_FRAGMENTS} fragments, "
          f"delay {STREAM_DELAY})\n")
    fp32 = results.get("b", {}).get("val_loss_equal_tokens") if results.get("b", {}).get("ok") else None
    equal = next((r["equal_tokens"] for r in results.values() if r.get("equal_tokens")), None)
    print("| DDP bytes/token / this bytes/token | setting | WAN bytes/token | steady ratio | steady bytes/token "
          "| WAN MB | utilisation per island | steady | own rows entered per island | tokens | val loss (final) "
          f"| val loss at {num(equal, ',.0f')} tokens "
          "| vs fp32 | rounds (DDP: steps) | lighthouse KB |")
    print("|---:|---|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
    for key in sorted(results):
        r = results[key]
        label = f"{key} {r.get('name', SETTINGS[key].name)}"
        if not r.get("ok"):
            print(f"| - | {label} | failed: {r.get('error', '?').splitlines()[0]} | | | | | | | | | | | | |")
            continue
        val = num(r["val_loss"], ".4f") + ("" if r["val_loss_at_final_step"] else " (not final)")
        print(f"| {num(ratio(ddp.get('bytes_per_token'), r['bytes_per_token']), '.1f')} | {label} "
              f"| {num(r['bytes_per_token'], ',.0f')} "
              f"| {num(ratio(ddp.get('steady_bytes_per_token'), r['steady_bytes_per_token']), '.1f')} "
              f"| {num(r['steady_bytes_per_token'], ',.0f')} | {r['wan_bytes'] / 1e6:,.1f} "
              f"| {' / '.join(num(u, '.2f') for u in r['utilisation'])} "
              f"| {' / '.join(num(u, '.2f') for u in r.get('utilisation_steady', [])) or '-'} "
              f"| {' / '.join(str(n) for n in r.get('entered', [])) or '-'} | {r['tokens']:,} | {val} "
              f"| {num(r.get('val_loss_equal_tokens'), '.4f')} | {relative(r.get('val_loss_equal_tokens'), fp32)} "
              f"| {r['rounds']} | {r['lighthouse_bytes'] / 1e3:,.0f} |")
    print_repairs(results)
    if "a" in results and results["a"].get("ok"):
        print(f"\nDDP utilisation is an estimate: steps x {num(results['a']['no_network_step_s'], '.3f')} s "
              f"(no-network step time) / wall time; one DDP step took {num(results['a']['step_wall_s'], '.2f')} s.")
    print("WAN bytes: counted on the bridge ports, each byte between islands once (at its sender), start-up "
          "included; steady: rounds after the join round only. Utilisation: compute s / (wall s after joining - "
          "evaluation s); steady: from the end of the first round to the end of the last that trained. "
          "Equal tokens: every island's evaluation at the same step (--equal-steps); vs fp32: "
          "that loss relative to DiLoCo fp32's.")


def print_repairs(results: dict[str, dict[str, Any]]) -> None:
    """With an island killed in an exchange: how each setting's survivors finished that round."""
    rows = {k: r for k, r in results.items() if r.get("ok") and r.get("dead")}
    if not rows:
        return
    print("\n| retry seconds (mean over survivors) | setting | dead island | outer step | retries / repaired "
          "| retry s per survivor | that round's sync s | bytes it sent per survivor (MB) | survivors agree |")
    print("|---:|---|---|---|---|---|---|---|---|")
    for key in sorted(rows):
        r = rows[key]
        seconds = [x for x in r["retry_s"] if x is not None]
        mb = " / ".join("-" if b is None else f"{b / 1e6:.2f}" for b in r["retry_round_bytes_sent"])
        print(f"| {num(statistics.fmean(seconds) if seconds else None, '.2f')} | {key} {r['name']} "
              f"| {', '.join(map(str, r['dead']))} | {' / '.join(map(str, r['retried_outer_step']))} "
              f"| {' / '.join(f'{a}/{b}' for a, b in zip(r['retries'], r['repaired']))} "
              f"| {' / '.join(num(x, '.2f') for x in r['retry_s'])} "
              f"| {' / '.join(num(x, '.2f') for x in r['retry_round_sync_s'])} | {mb} | {r['survivors_agree']} |")


def relative(value: float | None, reference: float | None) -> str:
    """`value` against `reference` in percent, signed ('-' when either is missing)."""
    if value is None or not reference:
        return "-"
    return f"{100 * (value / reference - 1):+.1f}%"


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help="comma-separated subset of a (DDP), b (fp32), c (int8), d (top-k), e (streaming int8), "
                        "f (codec auto), g (streaming, codec auto), h (decoupled int8), r (h applied on arrival), "
                        "i (segment repair), t (h with a thin island carried)")
    p.add_argument("--budget", type=float, default=90.0, help="wall-clock seconds of training per setting")
    p.add_argument("--equal-steps", type=int, default=120,
                   help="inner steps at which every setting evaluates, to compare validation loss at equal "
                        "tokens (DiLoCo settings reach it within the default budget)")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="each island link's rate, both directions")
    p.add_argument("--island-rates", default=None,
                   help="one rate per island instead (Mbit/s, comma-separated; their count is the number of "
                        "islands), e.g. 100,100,5: a thin-link island beside two fast ones")
    p.add_argument("--island-slowdowns", default=None,
                   help="one emulated slowdown per island (comma-separated, >= 1; `island.slowdown`), e.g. 1,3: "
                        "island 1 steps 3x slower. Not for DDP (a)")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="also add this one-way delay per shaped direction with netem (default off; needs netem)")
    p.add_argument("--sync-steps", type=int, default=20, help="DiLoCo inner steps per round")
    p.add_argument("--arrival-steps", type=int, default=5,
                   help="setting r: inner steps into the next round at which each overlapped exchange is "
                        "applied (fault_tolerance.arrival_steps; default 5)")
    p.add_argument("--carry-rounds", type=int, default=4,
                   help="setting t: rounds between two uploads of the thin island (default 4)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per island per step")
    p.add_argument("--config", type=Path, default=REPO / "configs/llama3/debug.toml")
    p.add_argument("--subnet", default="10.77.0.0/24", help="private /24 used inside the namespaces only")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP threads per island process (default: cores / islands)")
    p.add_argument("--sample-s", type=float, default=0.5, help="link counter sampling period")
    p.add_argument("--calibration-steps", type=int, default=12,
                   help="steps of the no-network calibration (only when DDP runs without any DiLoCo setting)")
    p.add_argument("--timeout", type=float, default=None,
                   help="hard limit per setting in seconds (default: 2 x budget + 300)")
    p.add_argument("--work-dir", type=Path, default=None, help="run directories (default: /tmp/bench-wan-*)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="anything after --extra goes to every `archipelago train` (e.g. --model.flavor ...)")
    p.add_argument("--inject", action="append", default=[], type=inject_arg, metavar="ISLAND:KIND@AT",
                   help="an injected fault for one island, as `archipelago local --inject` takes it (repeatable; "
                        "e.g. 3:die_in_exchange@3: island 3 dies with its row of outer step 3 in flight)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=None,
                   help="the lighthouse's heartbeat timeout: how soon a dead island leaves the quorum "
                        "(default: `archipelago lighthouse`'s)")
    p.add_argument("--codec", choices=["auto"], default=None,
                   help='auto: codec = "auto" without and with streaming\'s overlap (the same as --settings f,g)')
    args = p.parse_args(argv)
    if args.codec == "auto":
        if args.settings != DEFAULT_SETTINGS:
            p.error("--codec auto runs settings f and g: give --codec or --settings, not both")
        args.settings = "f,g"
    keys = [k.strip() for k in args.settings.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SETTINGS]
    if unknown or not keys:
        p.error(f"--settings {args.settings}: expected letters among {','.join(SETTINGS)}")
    args.keys = sorted(set(keys))
    try:
        args.subnet = ipaddress.ip_network(args.subnet)
    except ValueError as exc:
        p.error(f"--subnet: {exc}")
    if args.subnet.version != 4 or args.subnet.prefixlen > 24 or not args.subnet.is_private:
        p.error("--subnet: expected a private IPv4 network of at least /24, e.g. 10.77.0.0/24")
    if args.budget <= 0 or args.rate_mbit <= 0 or args.sync_steps < 1 or args.equal_steps < 1:
        p.error("--budget, --rate-mbit, --sync-steps and --equal-steps must be positive")
    per_fragment = args.sync_steps // STREAM_FRAGMENTS
    if {"e", "g"} & set(args.keys) and (args.sync_steps % STREAM_FRAGMENTS or STREAM_DELAY >= per_fragment):
        p.error(f"--sync-steps {args.sync_steps}: streaming (e, g) needs a multiple of {STREAM_FRAGMENTS} above "
                f"{STREAM_FRAGMENTS * STREAM_DELAY} (e.g. 20)")
    if "r" in args.keys and not 1 <= args.arrival_steps < args.sync_steps:  # refused before any namespace is set up
        p.error(f"--arrival-steps {args.arrival_steps}: setting r applies each exchange 1 to --sync-steps - 1 "
                f"({args.sync_steps - 1}) inner steps into the next round")
    try:
        args.rates = ([float(r) for r in args.island_rates.split(",")] if args.island_rates
                      else [args.rate_mbit] * 2)
    except ValueError:
        p.error(f"--island-rates {args.island_rates}: expected numbers, e.g. 100,100,5")
    if len(args.rates) < 2 or min(args.rates) <= 0:
        p.error("--island-rates: at least two positive rates")
    try:
        args.slowdowns = [float(f) for f in args.island_slowdowns.split(",")] if args.island_slowdowns else []
    except ValueError:
        p.error(f"--island-slowdowns {args.island_slowdowns}: expected numbers, e.g. 1,3")
    if args.slowdowns and (len(args.slowdowns) != len(args.rates) or min(args.slowdowns) < 1):
        p.error(f"--island-slowdowns: one factor >= 1 per island ({len(args.rates)} islands from the rates)")
    if args.slowdowns and "a" in args.keys:
        p.error("--island-slowdowns: DDP (a) has no per-island slowdown; leave it out of --settings")
    for fault in args.inject:
        if not 0 <= fault.island < len(args.rates):
            p.error(f"--inject {fault}: there are only islands 0..{len(args.rates) - 1} (from the rates)")
    if args.inject and "a" in args.keys:
        p.error("--inject: DDP (a) has no islands to inject into; leave it out of --settings")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // len(args.rates))
    if args.timeout is None:
        args.timeout = 2 * args.budget + 300
    return args


def model_facts(config: Path, extra: list[str]) -> dict[str, Any]:
    """Parameter count, model name and seq_len from the resolved config (no training)."""
    from archipelago.config import load_config
    from archipelago.models import get_model_args

    cfg = load_config(["--config", str(config), *extra], prog="bench/wan.py")
    model = get_model_args(cfg.model.name, cfg.model.flavor, vocab_size=cfg.data.vocab_size)
    return {"params": model.num_params(), "model": f"{cfg.model.name} {cfg.model.flavor}",
            "seq_len": cfg.data.seq_len, "round_pacing": cfg.fault_tolerance.round_pacing,
            "max_inner_steps": cfg.fault_tolerance.max_inner_steps}


def resolve_facts(args: argparse.Namespace) -> dict[str, Any]:
    """The resolved config's facts (model_facts), and those the islands' arguments use kept on `args`."""
    facts = model_facts(args.config, args.extra)
    args.params, args.seq_len = facts["params"], facts["seq_len"]
    args.round_pacing, args.max_inner_steps = facts["round_pacing"], facts["max_inner_steps"]
    return facts


def benchmark(args: argparse.Namespace, wan: Wan, run_id: str) -> dict[str, Any]:
    facts = resolve_facts(args)
    root = args.work_dir or Path(f"/tmp/bench-wan-{time.strftime('%Y%m%d-%H%M%S')}-{run_id}")
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([python_bin(), "-m", "archipelago.launch.cli", "data", "prepare", "--config", str(args.config),
                    *args.extra], cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=600)
    setup(wan)
    link = link_check(wan, run_id, args.threads)
    print(f"link check: island 0 -> island 1 at {link:.1f} Mbit/s (shaped to {min(args.rates[:2]):g})",
          flush=True)
    results: dict[str, dict[str, Any]] = {}
    # DiLoCo first: DDP's utilisation estimate uses their measured no-network step time.
    order = [k for k in args.keys if k != "a"] + (["a"] if "a" in args.keys else [])
    step_time: float | None = None
    for key in order:
        if key == "a":
            per_step = [s for r in results.values() if r.get("ok") for s in r.get("compute_s_per_step", [])]
            step_time = statistics.median(per_step) if per_step else calibrate(args, wan, root, run_id)
        try:
            results[key] = run_setting(SETTINGS[key], args, wan, root, run_id, step_time)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: stop the whole benchmark
            raise
        except Exception as exc:  # noqa: BLE001 - one failed setting must not lose the others
            print(f"[{key} {SETTINGS[key].name}] FAILED: {exc}", flush=True)
            results[key] = {"setting": key, "name": SETTINGS[key].name, "ok": False, "error": str(exc)}
    meta = {**facts, "batch_size": args.batch_size, "budget_s": args.budget, "rate_mbit": args.rate_mbit,
            "islands": len(args.rates), "rates": args.rates, "slowdowns": args.slowdowns,
            "threads": args.threads, "extra": args.extra, "inject": [str(f) for f in args.inject],
            "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
            **where_measured(),
            "delay_ms": args.delay_ms, "sync_steps": args.sync_steps, "carry_rounds": args.carry_rounds,
            "arrival_steps": args.arrival_steps,
            "link_mbit": link, "work_dir": str(root),
            "subnet": str(args.subnet), "no_network_step_s": step_time}
    return {**meta, "settings": results}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = preflight()
    if reason:
        print(f"bench/wan.py: skipped: {reason}. Run it as root, e.g. `sudo .venv/bin/python bench/wan.py`.")
        return 0
    lock = hold_lock("bench/wan.py")
    if lock is None:
        return 1
    run_id = uuid.uuid4().hex[:8]
    wan = Wan(args.subnet, args.rate_mbit, args.delay_ms, tuple(args.rates))
    # Per setting: start-up, the join round and the final evaluation besides the budget;
    # measured on 2 cores.
    est = len(args.keys) * (args.budget + 40) + 20
    print(f"bench/wan.py: settings {','.join(args.keys)}, about {est / 60:.0f} minutes", flush=True)
    set_signals(interrupt)
    code = 0
    try:
        result = benchmark(args, wan, run_id)
        print_table(result["settings"], result)
        if args.out:
            write_json(args.out, result)
        code = 0 if all(r.get("ok") for r in result["settings"].values()) else 1
    except KeyboardInterrupt:
        print("\ninterrupted: removing every process and namespace this benchmark created", file=sys.stderr)
        code = 130
    except Exception as exc:  # noqa: BLE001 - cleanup below, then one line naming the cause
        print(f"bench/wan.py: error: {exc}", file=sys.stderr)
        code = 2
    finally:
        set_signals(signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        removed = teardown(PREFIX)
        print(f"cleaned up: {', '.join(removed) or 'nothing left'}", flush=True)
        LOCK_FILE.unlink(missing_ok=True)
        lock.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
