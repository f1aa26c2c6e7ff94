"""usage: archipelago local --islands N[,N...] [options] [--config FILE] [--section.key VALUE ...]

Run a whole federation on this machine: an in-process torchft lighthouse and one
`archipelago train` island per entry of --islands (`--islands 2,1`: island 0 with 2 CPU
ranks, island 1 with 1), joined through the lighthouse by DiLoCo-style outer syncs.

Every option this command does not know (the --config file, --section.key overrides) is
passed to each island's `archipelago train`. Island K writes to RUN_DIR/island-K
(metrics.jsonl, checkpoints, console.log); RUN_DIR is --job.run_dir, by default
runs/local-<timestamp>. Island output is shown prefixed with [island-K], under a live
status table on a terminal (a status line every 10 s elsewhere).

Fault drills: `--kill 1@30` SIGKILLs every process of island 1 thirty seconds after the
start (`--kill 1@step16`: once its metrics show inner step 16); with `--restart-after 10`
the island is started again ten seconds later with the same command, resumes from its own
checkpoint and catches up from a live peer.

Islands set up differently: `--island-options "0:--parallelism.pipeline_stages 2"` adds
options to island 0's command only (repeatable; after the shared options, so they win).

Experiments (emulations, not real conditions): `--slowdown 1,3` makes island 1's inner
steps take 3x their compute time (--island.slowdown); `--inject 1:nan@3` makes island 1
send a poisoned pseudo-gradient (NaN, or `scale1000`: 1000x) in outer step 3, which the
guards must refuse (`forge_tokens`, `forge_weight` and `unsigned` make it lie about its
pseudo-gradient instead, which every receiver must refuse; with a federation key,
`equivocate` sends each peer another signed row and `censor` calls the others' segments
unsigned as a summer, which the members' receipts must catch), `--inject 1:die_in_exchange@3` makes it
SIGKILL itself with its exchange of outer step 3 in flight (the others re-form the quorum
and run the exchange again without it), and `--inject 1:crash@7` (or `error`,
`nan-loss`) fails its trainer at inner step 7. Faults share one grammar, ISLAND:KIND@AT (docs/development.md).
The lighthouse's own log is quiet (warnings only) unless RUST_LOG says otherwise.

At the end RUN_DIR/federation.json holds per-island results, the outer steps with their
participants, and every join/leave/heal/kill/restart event; `archipelago report
RUN_DIR` plots it. The exit code is 0 when every island's last run exited 0, else the
first failing island's code (130 after Ctrl-C).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from archipelago.config.errors import ConfigError
from archipelago.config.faults import LAUNCHER_KINDS, OUTER_KINDS, TRAINER_KINDS, Fault, parse_fault
from archipelago.launch.args import pop_option  # one parser of --name VALUE for both commands


@dataclass
class Options:
    islands: list[int]
    kills: list[Fault]  # kill (AT in seconds) or kill_at_step (AT an inner step), each with its island
    restart_after: float | None
    lighthouse_bind: str
    min_replicas: int
    join_timeout_ms: int
    quorum_tick_ms: int
    heartbeat_timeout_ms: int
    table: bool
    run_dir: Path
    passthrough: list[str]
    slowdowns: list[float] = field(default_factory=list)
    injections: dict[int, list[Fault]] = field(default_factory=dict)  # island -> its --inject faults
    island_options: dict[int, list[str]] = field(default_factory=dict)  # island -> its own extra options
    dashboard: str | None = None  # HOST:PORT of the federation dashboard served during the run


def _number_list(text: str, kind: type, least: float, expected: str) -> list:
    """A comma-separated list of `kind` numbers, each at least `least` (argparse type)."""
    try:
        values = [kind(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
    return values


def _islands_arg(text: str) -> list[int]:
    return _number_list(text, int, 1, "rank counts like 2,1 (each at least 1)")


_STEP = "step"  # --kill ISLAND@stepN: AT is an inner step (kill_at_step), not seconds (kill)


def _kill_arg(text: str) -> Fault:
    """`ISLAND@SECONDS` (the fault ISLAND:kill@SECONDS) or `ISLAND@stepN` (ISLAND:kill_at_step@N)."""
    island, _, at = text.partition("@")
    kind = "kill_at_step" if at.startswith(_STEP) else "kill"
    try:
        return parse_fault(f"{island}:{kind}@{at.removeprefix(_STEP)}", where="--kill", kinds=LAUNCHER_KINDS,
                           island=True)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ISLAND@SECONDS or ISLAND@stepN, "
                                         "e.g. 1@30 or 1@step16") from None


def kill_text(kill: Fault) -> str:
    """The `--kill` value that parses to `kill` (for the launcher's messages)."""
    return f"--kill {kill.island}@{_STEP if kill.kind == 'kill_at_step' else ''}{kill.at:g}"


def _slowdown_arg(text: str) -> list[float]:
    return _number_list(text, float, 1, "one factor >= 1 per island, e.g. 1,3")


def _island_options_arg(text: str) -> tuple[int, list[str]]:
    """`ISLAND:OPTIONS`, e.g. `0:--parallelism.pipeline_stages 2`: options for that island only."""
    island, sep, options = text.partition(":")
    if not sep or not island.strip().isdigit() or not options.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected ISLAND:OPTIONS, e.g. "
                                         "\"0:--parallelism.pipeline_stages 2\"")
    return int(island), shlex.split(options)


def inject_arg(text: str) -> Fault:
    """`ISLAND:KIND@AT` with a trainer or outer-loop kind (config/faults.py); an argparse
    type (also bench/wan.py's)."""
    try:
        return parse_fault(text, where="--inject", kinds=TRAINER_KINDS + OUTER_KINDS, island=True)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a passed-through `--job.x` must never be taken for one of ours.
    p = argparse.ArgumentParser(prog="archipelago local", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter, usage=argparse.SUPPRESS)
    p.add_argument("--islands", required=True, type=_islands_arg, metavar="N[,N...]",
                   help="rank count of each island: 2,1 = island 0 with 2 ranks, island 1 with 1")
    p.add_argument("--kill", action="append", default=[], type=_kill_arg, metavar="ISLAND@SECONDS|ISLAND@stepN",
                   help="SIGKILL every process of ISLAND this many seconds after the start, or (stepN) once its "
                        "metrics show inner step N or a later one: a drill that lands at the same point of the run "
                        "on a fast machine and a slow one (steps are seen as metrics.log_every writes them); "
                        "a kill whose island ends first is reported, as a warning and a kill_not_fired event "
                        "(repeatable)")
    p.add_argument("--restart-after", type=float, metavar="SECONDS",
                   help="start a killed island again this many seconds after the kill")
    p.add_argument("--slowdown", type=_slowdown_arg, metavar="F[,F...]",
                   help="emulated slowdown of each island (>= 1; 1,3: island 1's steps take 3x as long); "
                        "an experiment setting, passed as --island.slowdown")
    p.add_argument("--inject", action="append", default=[], type=inject_arg, metavar="ISLAND:KIND@AT",
                   help="for tests and demos: ISLAND sends a poisoned pseudo-gradient in outer step AT (KIND nan or "
                        "scale1000) or lies about it (forge_tokens, forge_weight, unsigned, equivocate, censor), "
                        "or dies with "
                        "its exchange of outer step AT in flight (die_in_exchange), or its trainer "
                        "fails at inner step AT (crash, error, nan-loss); "
                        "repeatable, every entry is kept")
    p.add_argument("--island-options", action="append", default=[], type=_island_options_arg,
                   metavar="ISLAND:OPTIONS",
                   help="options for one island only, after the shared ones (repeatable): "
                        "\"0:--parallelism.pipeline_stages 2\" pipelines island 0 alone")
    p.add_argument("--lighthouse-bind", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="address of the in-process lighthouse (port 0: any free port); beyond loopback "
                        "it needs the islands' federation key, or --federation_security.insecure")
    p.add_argument("--min-replicas", type=int, default=1, help="islands needed for a quorum")
    p.add_argument("--join-timeout-ms", type=int, default=60000,
                   help="how long the lighthouse waits for islands that are alive (heartbeating) but "
                        "not yet at the outer step before forming a quorum without them; a killed "
                        "island stops heartbeating and is dropped after --heartbeat-timeout-ms")
    p.add_argument("--quorum-tick-ms", type=int, default=100, help="lighthouse quorum check period")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                   help="an island silent this long is dropped from the quorum: about how long the others "
                        "stall when an island dies mid-exchange (500 keeps it under a second here; shorter "
                        "also drops live islands whose heartbeats, every 100 ms, come late)")
    p.add_argument("--no-table", action="store_true", help="no live status table / status lines")
    p.add_argument("--dashboard", metavar="[HOST]:PORT", help="serve the live federation dashboard (a web page and "
                   "/metrics) here during the run, e.g. 127.0.0.1:8080 (`:8080`: on 127.0.0.1); the islands push their "
                   "records to it")
    return p


def parse_args(argv: list[str]) -> Options:
    """Options of `archipelago local`; raises SystemExit (argparse) on --help or bad usage."""
    parser = _parser()
    args, passthrough = parser.parse_known_args(argv)
    for kill in args.kill:
        if (island := int(kill.island or 0)) >= len(args.islands):
            parser.error(f"--kill {island}@...: there are only islands 0..{len(args.islands) - 1}")
    if args.restart_after is not None and args.restart_after < 0:
        parser.error("--restart-after: expected a number of seconds >= 0")
    if args.slowdown is not None and len(args.slowdown) != len(args.islands):
        parser.error(f"--slowdown: give one factor per island ({len(args.islands)}), e.g. "
                     f"{','.join(['1'] * len(args.islands))}")
    injections: dict[int, list[Fault]] = {}
    for fault in args.inject:
        island = int(fault.island or 0)
        if island >= len(args.islands):
            parser.error(f"--inject {island}:...: there are only islands 0..{len(args.islands) - 1}")
        injections.setdefault(island, []).append(fault)
    island_options: dict[int, list[str]] = {}
    for island, options in args.island_options:
        if island >= len(args.islands):
            parser.error(f"--island-options {island}:...: there are only islands 0..{len(args.islands) - 1}")
        island_options.setdefault(island, []).extend(options)
    run_dir, passthrough = pop_option(passthrough, "--job.run_dir")
    return Options(
        islands=args.islands, kills=args.kill,
        restart_after=args.restart_after, lighthouse_bind=args.lighthouse_bind,
        min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        table=not args.no_table, passthrough=passthrough, slowdowns=args.slowdown or [],
        injections=injections, island_options=island_options, dashboard=args.dashboard,
        run_dir=Path(run_dir or f"runs/local-{datetime.now():%Y%m%d-%H%M%S}"))
