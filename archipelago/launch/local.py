"""`archipelago local`: a whole federation on this machine (usage and options:
launch/local_options.py, whose docstring is the command's --help; the live display:
launch/local_display.py). An in-process torchft lighthouse and one `archipelago train`
island per entry of --islands; kills, restarts, injected faults, and RUN_DIR/federation.json
at the end."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from archipelago.config.errors import ConfigError
from archipelago.config.faults import ENV as FAULT_ENV
from archipelago.config.faults import RANK_ENV as FAULT_RANK_ENV
from archipelago.config.faults import Fault
from archipelago.config.faults import env_value as fault_env_value
from archipelago.launch.local_display import LIVE_HEADERS, STATUS_EVERY_S, MetricsTail, Output, format_cell, rich_table
from archipelago.launch.local_options import Options, kill_text, parse_args
from archipelago.launch.processes import kill_until_gone, pids_with_env, rank_threads, signal_pids
from archipelago.metrics.islands import FEDERATION_FILE, federation_summary
from archipelago.metrics.progress import format_count
from archipelago.metrics.summary import write_json_atomic

# Test hook (docs/development.md): a command line replacing `python -m archipelago.launch.cli
# train`, so launcher tests can run a fake island that needs no training.
ISLAND_CMD_ENV = "ARCHIPELAGO_LOCAL_ISLAND_CMD"
# Inherited by every process of an island, torchrun's ranks included: they are session
# leaders (outside our process group and, once torchrun dies, outside our process tree),
# so this marker in /proc/PID/environ is the one reliable way to find them all.
TOKEN_ENV = "ARCHIPELAGO_ISLAND_TOKEN"
FAILURE_FILE = "failure.json"  # written by `archipelago train` (launch/cli.py)
TICK_S = 0.2  # main-loop period: how late a kill/restart/exit is noticed at most
STOP_GRACE_S = 5.0  # after Ctrl-C: how long islands get to exit before SIGKILL




# ------------------------------------------------------------ island command


def island_program() -> list[str]:
    """The island program: `python -m archipelago.launch.cli train`, or the test hook's command."""
    override = os.environ.get(ISLAND_CMD_ENV)
    return shlex.split(override) if override else [sys.executable, "-m", "archipelago.launch.cli", "train"]


def island_command(island: int, ranks: int, group_size: int, passthrough: list[str], run_dir: Path,
                   lighthouse: str, program: list[str] | None = None) -> list[str]:
    """The command line of island `island`; ours come after the passthrough so they win."""
    return [*(program or island_program()), "--nproc", str(ranks), *passthrough,
            "--job.run_dir", f"{run_dir}/island-{island}", "--fault_tolerance.enable",
            f"--fault_tolerance.replica_id={island}", f"--fault_tolerance.group_size={group_size}",
            "--fault_tolerance.lighthouse", lighthouse, "--metrics.progress", "plain"]


def island_env(token: str, lighthouse: str, total_ranks: int,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """The island's environment: ours (or `base`) plus its token, the lighthouse and threads."""
    env = dict(os.environ if base is None else base)
    env.pop(FAULT_ENV, None)  # --inject sets it for one island only
    env.pop(FAULT_RANK_ENV, None)
    env.update({TOKEN_ENV: token, "TORCHFT_LIGHTHOUSE": lighthouse,
                "PYTHONUNBUFFERED": "1"})  # lines must reach us as they are written, not per 8 KiB
    env["OMP_NUM_THREADS"] = rank_threads(total_ranks, env)  # all islands share this machine's cores
    return env


# ---------------------------------------------------------- processes by token


def island_pids(token: str) -> list[int]:
    """Live processes whose environment carries this island token (never matched by name)."""
    return pids_with_env(TOKEN_ENV, token)


def signal_island(token: str, sig: int) -> int:
    """Send `sig` to every process of the island; returns how many were signalled."""
    return signal_pids(island_pids(token), sig)


def kill_island(token: str, timeout_s: float = 5.0) -> int:
    """SIGKILL the island's processes until none is left (a dying parent may still fork)."""
    return kill_until_gone(lambda: island_pids(token), timeout_s)


def _exit_status(returncode: int) -> int:
    """A shell-style exit code: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode




@dataclass
class Island:
    id: int
    ranks: int
    cmd: list[str]
    env: dict[str, str]
    dir: Path
    token: str
    tail: MetricsTail
    proc: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    state: str = "pending"  # running / killed / restarted / finished / failed / stopped (Ctrl-C)
    exit_code: int | None = None  # of the last run, once it has exited
    restarts: int = 0
    killed: bool = False  # the current run was killed by the launcher
    restart_at: float | None = None  # seconds since start, when a restart is due

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.exit_code is None


@dataclass
class LocalFederation:
    """One `archipelago local` run: lighthouse, islands, fault drills, summary."""

    opts: Options
    out: Output
    islands: list[Island] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    lighthouse: Any = None
    url: str | None = None
    t0: float = field(default_factory=time.monotonic)
    start_time: float = field(default_factory=time.time)
    _next_status: float = STATUS_EVERY_S
    stopping: bool = False  # Ctrl-C / SIGTERM: islands exiting now were stopped by us
    pending_kills: list[Fault] = field(default_factory=list)  # --kill faults not yet fired, timed ones by time

    def __post_init__(self) -> None:
        self.pending_kills = sorted(self.opts.kills, key=lambda kill: (kill.kind, kill.at))

    def run(self) -> int:
        interrupted = False
        try:
            self._start()
            self._loop()
        except KeyboardInterrupt:
            interrupted = True
            _ignore_signals()  # a second Ctrl-C must not cut the clean-up short
            self.out.note("interrupted: stopping every island")
            self._stop_gracefully()
        finally:
            self._cleanup()  # on every path, exceptions included: no process outlives us
        return self._finish(interrupted)

    # ------------------------------------------------------------- start

    def _start(self) -> None:
        self.opts.run_dir.mkdir(parents=True, exist_ok=True)
        self.lighthouse = start_lighthouse_server(self.opts)
        self.url = reachable_url(self.lighthouse.address(), self.opts.lighthouse_bind)
        gate = " (members only: the islands' federation key)" if hasattr(self.lighthouse, "dashboard") else ""
        self.out.note(f"lighthouse at {self.url}{gate}; run directory {self.opts.run_dir}")
        dashboard = self._start_dashboard()
        run_token = uuid.uuid4().hex
        total = sum(self.opts.islands)
        for k, ranks in enumerate(self.opts.islands):
            cmd = island_command(k, ranks, len(self.opts.islands), self.opts.passthrough,
                                 self.opts.run_dir, self.url)
            if self.opts.slowdowns:
                cmd += ["--island.slowdown", f"{self.opts.slowdowns[k]:g}"]
            cmd += self.opts.island_options.get(k, [])
            cmd += ["--metrics.dashboard", dashboard] if dashboard else []
            token = f"{run_token}-island-{k}"
            folder = self.opts.run_dir / f"island-{k}"
            env = island_env(token, self.url, total)
            if k in self.opts.injections:
                env[FAULT_ENV] = fault_env_value(self.opts.injections[k])
            self.islands.append(Island(k, ranks, cmd, env, folder, token, MetricsTail(folder / "metrics.jsonl")))
        for island in self.islands:
            self._launch(island)
            island.state = "running"
        if self.opts.table and self.out.tty:
            self.out.start_live(self._live_table())

    def _launch(self, island: Island) -> None:
        island.dir.mkdir(parents=True, exist_ok=True)
        # The launcher repeats failure.json's message; one left by an earlier run must not be.
        (island.dir / FAILURE_FILE).unlink(missing_ok=True)
        island.exit_code, island.killed = None, False
        # Own session: a terminal Ctrl-C reaches only us, and we stop islands in order.
        island.proc = subprocess.Popen(island.cmd, env=island.env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        island.reader = threading.Thread(target=self._pump, args=(island.id, island.proc.stdout,
                                         island.dir / "console.log"), daemon=True)
        island.reader.start()

    def _pump(self, island: int, stream: IO[bytes], log_path: Path) -> None:
        """Copy one island's output to the console and console.log until it closes.

        Must keep draining whatever fails: an undrained pipe blocks the island.
        """
        log: IO[bytes] | None = None
        try:
            log = open(log_path, "ab")  # append: a restarted island continues the same log
        except OSError as exc:
            self.out.note(f"island-{island}: cannot write {log_path} ({exc})")
        with stream:
            for raw in iter(stream.readline, b""):
                if log is not None:
                    try:
                        log.write(raw)
                        log.flush()
                    except OSError:
                        log = None
                self.out.island_line(island, raw.decode("utf-8", "replace").rstrip("\r\n"))
        if log is not None:
            log.close()

    # -------------------------------------------------------------- loop

    def _loop(self) -> None:
        while True:
            self._fire_due()
            self._reap()
            for island in self.islands:
                island.tail.poll()
            self._show()
            if all(i.exit_code is not None and i.restart_at is None for i in self.islands):
                return
            time.sleep(TICK_S)

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _fire_due(self) -> None:
        now = self._elapsed()
        for kill in [k for k in self.pending_kills if self._kill_is_due(k, now)]:
            self.pending_kills.remove(kill)
            self._kill(self.islands[int(kill.island or 0)], kill)
        for island in self.islands:
            if island.restart_at is not None and island.restart_at <= now:
                self._restart(island)

    def _kill_is_due(self, kill: Fault, now: float) -> bool:
        """A timed kill at its second; a kill_at_step once the island's metrics reached the step
        (the tail's latest record: the step as metrics.log_every writes it)."""
        if kill.kind == "kill":
            return kill.at <= now
        step = self.islands[int(kill.island or 0)].tail.latest.get("step")
        return isinstance(step, int) and step >= kill.at

    def _kill(self, island: Island, kill: Fault) -> None:
        spec = kill_text(kill)
        if not island.alive:
            self.out.note(f"island-{island.id} already exited; {spec} skipped")
            return
        island.killed, island.state = True, "killed"
        count = kill_island(island.token)
        at = {"at_s": kill.at} if kill.kind == "kill" else {"at_step": kill.at, "at_s": round(self._elapsed(), 3)}
        self._event("kill", island.id, processes=count, **at)
        self.out.note(f"island-{island.id}: SIGKILL to {count} processes ({spec})")
        if self.opts.restart_after is not None:
            island.restart_at = self._elapsed() + self.opts.restart_after

    def _restart(self, island: Island) -> None:
        if island.exit_code is None and island.proc is not None:  # killed but not reaped yet
            island.proc.wait(timeout=10)
            self._on_exit(island, island.proc.returncode)
        island.restart_at = None
        island.restarts += 1
        self._event("restart", island.id, restart=island.restarts)
        self.out.note(f"island-{island.id}: restart {island.restarts} with the same command")
        self._launch(island)
        island.state = "restarted"

    def _reap(self) -> None:
        for island in self.islands:
            if island.alive and island.proc is not None and island.proc.poll() is not None:
                self._on_exit(island, island.proc.returncode)

    def _on_exit(self, island: Island, returncode: int) -> None:
        kill_island(island.token)  # ranks that outlived their torchrun: no orphans, pipe closes
        if island.reader is not None:
            island.reader.join(timeout=5)
        island.exit_code = _exit_status(returncode)
        if self.stopping:
            island.state = "stopped"
        elif not island.killed:
            island.state = "finished" if returncode == 0 else "failed"
        self._event("exit", island.id, exit_code=island.exit_code, killed=island.killed)
        self.out.note(f"island-{island.id} {island.state} (exit code {island.exit_code})")

    def _event(self, kind: str, island: int, **fields: Any) -> None:
        now = time.time()
        self.events.append({"event": kind, "time": now, "island": island, "source": "launcher", **fields})
        if self.dashboard is not None:  # served here: the islands cannot push what happened to them
            self.dashboard.state.launcher_event(island, kind, now)

    # ----------------------------------------------------------- display

    def _rows(self) -> list[list[str]]:
        rows = []
        for island in self.islands:
            latest = island.tail.latest
            tps = latest.get("tokens_per_s")
            rows.append([str(island.id), str(island.ranks), island.state, format_cell(latest.get("step")),
                         format_cell(latest.get("outer_step")), format_cell(latest.get("loss")),
                         format_count(tps) if tps is not None else "-", format_cell(latest.get("participants"))])
        return rows

    def _live_table(self) -> Any:
        return rich_table(LIVE_HEADERS, self._rows())

    def _show(self) -> None:
        if not self.opts.table:
            return
        if self.out.tty:
            self.out.update_live(self._live_table())
        elif self._elapsed() >= self._next_status:
            self._next_status = self._elapsed() + STATUS_EVERY_S
            parts = [f"island-{r[0]} {r[2]} step {r[3]} outer {r[4]} loss {r[5]} {r[6]} tok/s {r[7]} participants"
                     for r in self._rows()]
            self.out.note(f"{self._elapsed():.0f}s | " + " | ".join(parts))

    # ----------------------------------------------------------- the end

    def _stop_gracefully(self) -> None:
        """SIGTERM every island process (torchrun forwards it too), then wait a while."""
        self.stopping = True
        for island in self.islands:
            signal_island(island.token, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(island_pids(i.token) for i in self.islands):
            time.sleep(0.1)

    def _cleanup(self) -> None:
        _ignore_signals()
        for island in self.islands:
            kill_island(island.token)
        for island in self.islands:
            if island.alive and island.proc is not None:
                try:
                    island.proc.wait(timeout=5)
                    self._on_exit(island, island.proc.returncode)
                except subprocess.TimeoutExpired:  # cannot happen after SIGKILL; never hang on it
                    pass
        self.out.stop_live()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None
        if self.dashboard is not None:
            self.dashboard.shutdown()
            self.dashboard = None

    dashboard: Any = None

    def _start_dashboard(self) -> str | None:
        """--dashboard: serve it in this process; returns the URL the islands push to."""
        if not self.opts.dashboard:
            return None
        from archipelago.launch.lighthouse import start_dashboard

        self.dashboard = start_dashboard(self.opts.dashboard, federation_key(self.opts.passthrough),
                                         "--federation_security.insecure" in self.opts.passthrough,
                                         ("--dashboard", "--federation_security.key_file",
                                          "--federation_security.insecure"))
        self.out.note(f"dashboard at {self.dashboard.address}")
        return self.dashboard.address

    def _report_unfired_kills(self) -> None:
        """A drill that never happened is said, not passed over: each --kill still pending when
        every island ended (its island finished first) becomes an event and a warning."""
        for kill in self.pending_kills:
            island = self.islands[int(kill.island or 0)]
            step = island.tail.latest.get("step")
            self._event("kill_not_fired", island.id, fault=kill.kind, at=kill.at, last_step=step)
            ended = f"its last step was {step}" if kill.kind == "kill_at_step" else \
                f"the federation ended after {self._elapsed():.0f}s"
            self.out.error(f"warning: {kill_text(kill)} never fired: island-{island.id} ended first ({ended})")

    def _finish(self, interrupted: bool) -> int:
        if not interrupted:
            self._report_unfired_kills()
        islands = [{"id": i.id, "ranks": i.ranks, "exit_code": i.exit_code, "restarts": i.restarts,
                    "state": i.state} for i in self.islands]
        summary = federation_summary(self.opts.run_dir, islands, self.events, lighthouse=self.url,
                                     start_time=self.start_time, wall_s=round(self._elapsed(), 3),
                                     interrupted=interrupted)
        write_json_atomic(self.opts.run_dir / FEDERATION_FILE, summary)
        self._print_summary(summary)
        return 130 if interrupted else self._exit_code()

    def _print_summary(self, summary: dict[str, Any]) -> None:
        headers = ["island", "ranks", "restarts", "outer steps", "final step", "loss", "val loss",
                   "global hash", "exit"]
        cell = format_cell
        rows = [[str(r["id"]), cell(r["ranks"]), cell(r["restarts"]),
                 f"thin: {r['uploads']} uploads" if r.get("carrier") else cell(r["outer_steps_committed"]),
                 cell(r["final_step"]), cell(r["final_loss"]), cell(r["final_val_loss"]),
                 (r["global_hash"] or "-")[:12], cell(r["exit_code"])] for r in summary["islands"]]
        self.out.note(f"federation finished in {summary['wall_s']:.1f}s; "
                      f"{len(summary['outer_steps'])} outer steps")
        self.out.table(headers, rows)
        agree = "yes" if summary["global_hash_agree"] else "NO"
        step = summary["global_hash_outer_step"]
        where = f"at outer step {step}, the last all members committed" if step is not None else \
            "(no outer step was committed by every member)"
        self.out.note(f"global weights agree across the members {where}: {agree}")
        self.out.note(f"wrote {self.opts.run_dir / FEDERATION_FILE}")

    def _exit_code(self) -> int:
        for island in self.islands:
            if island.exit_code != 0:
                code = island.exit_code if island.exit_code is not None else 1
                if island.state == "killed":
                    self.out.error(f"island-{island.id} was killed (--kill) and not restarted (exit code {code})")
                else:
                    self.out.error(f"island-{island.id} failed (exit code {code})" + _failure_message(island.dir))
                return code
        return 0


def _failure_message(island_dir: Path) -> str:
    """': <message>' from the island's failure.json (the failing rank's own reason), or ''."""
    try:
        record = json.loads((island_dir / FAILURE_FILE).read_text())
        return f": {record['message']}" if record.get("message") else ""
    except (OSError, ValueError, KeyError, AttributeError):
        return ""


# ---------------------------------------------------------------- lighthouse


def federation_key(passthrough: list[str]) -> Any:
    """The federation key the islands load (their config's [federation_security] key_file,
    else $ARCHIPELAGO_FEDERATION_KEY_FILE), or None: with one the lighthouse admits only
    the islands holding it. The config is read, not validated (each island names its own
    problems); one that cannot even be read falls back to the environment here."""
    from archipelago.config import load_config
    from archipelago.federation.trust import load_key

    try:
        key_file = load_config(passthrough, prog="archipelago local", validated=False).federation_security.key_file
    except (ConfigError, SystemExit):
        key_file = ""
    return load_key(key_file)


def start_lighthouse_server(opts: Options) -> Any:
    """The in-process lighthouse: behind the members-only gate when the islands hold a
    federation key (federation/gate.py)."""
    from archipelago.launch.lighthouse import quiet_torchft_log, refuse_open_without_key, start_lighthouse

    key = federation_key(opts.passthrough)
    # Beyond loopback without a key anyone could join: the islands' own opt-out accepts it.
    refuse_open_without_key(opts.lighthouse_bind, key, "--federation_security.insecure" in opts.passthrough,
                            ("--lighthouse-bind", "--federation_security.key_file", "--federation_security.insecure"))
    # The lighthouse logs every quorum request straight to fd 2, mid-line into the island
    # lines and through the live table, while the islands' join/leave/quorum records say
    # the same. torchft reads RUST_LOG once, when its first server starts, so quietening it
    # there changes nothing else (islands get the environment as it was). RUST_LOG=info
    # brings the log back.
    with quiet_torchft_log():
        return start_lighthouse(bind=opts.lighthouse_bind, min_replicas=opts.min_replicas,
                                join_timeout_ms=opts.join_timeout_ms, quorum_tick_ms=opts.quorum_tick_ms,
                                heartbeat_timeout_ms=opts.heartbeat_timeout_ms, key=key)


def reachable_url(address: str, bind: str) -> str:
    """The lighthouse URL islands should dial.

    torchft reports its host name; when bound to one address (127.0.0.1) that name may
    resolve elsewhere, so the bound address is used instead; a wildcard keeps the name.
    """
    host = bind.rsplit(":", 1)[0]
    port = urlsplit(address).port
    if host in ("", "0.0.0.0", "[::]", "::") or port is None:
        return address
    return f"http://{host}:{port}"


# ---------------------------------------------------------------- signals


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the federation exactly as Ctrl-C does


def _set_signals(handler: Any) -> dict[int, Any]:
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    return previous


def _ignore_signals() -> None:
    _set_signals(signal.SIG_IGN)


def _check_island_options(passthrough: list[str]) -> None:
    """The options every island gets must at least parse (known keys, values of the right
    type, a readable config file): a mistake stops here, before a lighthouse or an island
    starts, instead of in every island. Validation is the islands' own (each names its
    problems with its rank count)."""
    from archipelago.config import load_config

    load_config(passthrough, prog="archipelago local", validated=False)


def main(argv: list[str]) -> int:
    """`archipelago local ARGS`; returns the exit code."""
    try:
        opts = parse_args(argv)
        _check_island_options(opts.passthrough)
        for options in opts.island_options.values():
            _check_island_options([*opts.passthrough, *options])
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, message printed)
        return exc.code if isinstance(exc.code, int) else 2
    except ConfigError as exc:  # e.g. a config file that is not there
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):
        tty = False
    previous = _set_signals(_raise_interrupt)
    try:
        return LocalFederation(opts, Output(tty)).run()
    except ConfigError as exc:  # e.g. a lighthouse address it may not open without a key
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
