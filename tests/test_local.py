"""`archipelago local` with fake islands (tests/fake_island.py): no training, seconds per run.

The launcher runs as a subprocess with a test token in its environment, so every process
it starts (islands, their session-leader "ranks") is found and killed by PID at the end,
whatever happens; a run that leaves any behind fails.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, Finished, finish_started, run_cli_here

from archipelago.config.faults import Fault
from archipelago.launch import local, local_display
from archipelago.launch.processes import pids_with_env
from archipelago.metrics import write_report
from archipelago.metrics.islands import load_federation

FAKE_ISLAND = ROOT / "tests" / "fake_island.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def launcher_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_ISLAND")}
    env.update(PYTHONUNBUFFERED="1", ARCHIPELAGO_TEST_TOKEN=uuid.uuid4().hex,
               **{local.ISLAND_CMD_ENV: f"{sys.executable} {FAKE_ISLAND}"}, **extra)
    return env


def start_local(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "archipelago.launch.local", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], env: dict[str, str], timeout: float) -> Finished:
    """Wait for the launcher; at the end kill (and report) anything of ours still alive."""
    return finish_started(proc, env["ARCHIPELAGO_TEST_TOKEN"], "archipelago local", timeout)


def run_local(args: list[str], timeout: float = 40, **extra_env: str) -> Finished:
    env = launcher_env(**extra_env)
    return finish(start_local(args, env), env, timeout)


def starts(island_dir: Path) -> list[dict]:
    """What the fake island saw at each start: its argv, pid and environment."""
    return [json.loads(line) for line in (island_dir / "starts.jsonl").read_text().splitlines()]


def pids_with_island_token(token: str) -> list[int]:
    return pids_with_env(local.TOKEN_ENV, token)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Finished]:
    """islands 1,2 (island 1 has a session-leader 'rank'); island 1 killed at its step 3, back
    1 s later. At a step, not a second: a kill at 2 s could land before a loaded machine had
    started the island's rank, and find one process."""
    run_dir = tmp_path_factory.mktemp("local") / "fed"
    result = run_local(["--islands", "1,2", "--kill", "1@step3", "--restart-after", "1", "--training.steps", "20",
                        "--job.run_dir", str(run_dir)], timeout=60)
    return run_dir, result


# ------------------------------------------------------------------ runs


@pytest.mark.timeout(60)
def test_two_islands_write_a_federation_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "fed"
    result = run_local(["--islands", "2,1", "--training.steps", "10", "--model.flavor", "debug",
                        "--job.run_dir", str(run_dir)])
    assert result.returncode == 0, result.output[-3000:]
    fed = json.loads((run_dir / "federation.json").read_text())
    assert fed["run_dir"] == str(run_dir) and fed["lighthouse"].startswith("http://127.0.0.1:")
    assert [(i["id"], i["ranks"], i["exit_code"], i["restarts"]) for i in fed["islands"]] == [
        (0, 2, 0, 0), (1, 1, 0, 0)]
    assert all(i["final_step"] == 10 and i["outer_steps_committed"] == 2 for i in fed["islands"])
    assert all(i["final_loss"] == pytest.approx(2.5) and i["final_val_loss"] == pytest.approx(2.75)
               for i in fed["islands"])
    assert fed["outer_steps"] == [
        {"outer_step": 1, "participants": 2, "islands": [0, 1], "healed": [], "hash_agree": True},
        {"outer_step": 2, "participants": 2, "islands": [0, 1], "healed": [], "hash_agree": True}]
    assert fed["global_hash_agree"] is True and fed["global_hash_outer_step"] == 2
    assert fed["islands"][0]["global_hash"] == fed["islands"][1]["global_hash"]
    assert [e["time"] for e in fed["events"]] == sorted(e["time"] for e in fed["events"])
    assert {(e["event"], e["island"]) for e in fed["events"]} >= {("join", 0), ("join", 1), ("exit", 0), ("exit", 1)}
    assert fed["wall_s"] > 0
    # Each island got its own command: rank count, passthrough, federation settings.
    for k, ranks in enumerate((2, 1)):
        (seen,) = starts(run_dir / f"island-{k}")
        argv = seen["argv"]
        assert argv[:2] == ["--nproc", str(ranks)]
        assert argv[2:6] == ["--training.steps", "10", "--model.flavor", "debug"]
        assert argv[argv.index("--job.run_dir") + 1] == f"{run_dir}/island-{k}"
        assert f"--fault_tolerance.replica_id={k}" in argv and "--fault_tolerance.group_size=2" in argv
        assert "--fault_tolerance.enable" in argv
        assert argv[argv.index("--fault_tolerance.lighthouse") + 1] == fed["lighthouse"]
        assert seen["env"]["TORCHFT_LIGHTHOUSE"] == fed["lighthouse"]
        assert seen["env"]["ARCHIPELAGO_ISLAND_TOKEN"].endswith(f"-island-{k}")
        assert int(seen["env"]["OMP_NUM_THREADS"]) >= 1
        log = (run_dir / f"island-{k}" / "console.log").read_text()
        assert "step 10 loss 2.500" in log
        assert f"[island-{k}] step 10 loss 2.500" in result.output
    assert "global weights agree across the members at outer step 2, the last all members committed: yes" \
        in result.output


@pytest.mark.timeout(90)
def test_kill_and_restart_are_recorded_and_leave_nothing_behind(killed_run: tuple[Path, Finished]) -> None:
    run_dir, result = killed_run
    assert result.returncode == 0, result.output[-3000:]
    fed = json.loads((run_dir / "federation.json").read_text())
    island1 = fed["islands"][1]
    assert island1["restarts"] == 1 and island1["exit_code"] == 0 and island1["final_step"] == 20
    assert fed["islands"][0]["restarts"] == 0
    launcher = [e for e in fed["events"] if e.get("source") == "launcher" and e["island"] == 1]
    assert [e["event"] for e in launcher] == ["kill", "exit", "restart", "exit"]
    kill, killed_exit, restart, _ = launcher
    assert kill["processes"] >= 2  # the island and its session-leader "rank"
    assert killed_exit["exit_code"] == 128 + signal.SIGKILL and killed_exit["killed"] is True
    assert restart["time"] - kill["time"] >= 1.0
    assert any(e["event"] == "resume" and e["island"] == 1 for e in fed["events"])
    assert fed["global_hash_agree"] is True
    assert [s["outer_step"] for s in fed["outer_steps"]] == [1, 2, 3, 4]
    # Both runs of island 1 (the killed one included) are gone, found by their token.
    first, second = starts(run_dir / "island-1")
    assert first["env"]["ARCHIPELAGO_ISLAND_TOKEN"] == second["env"]["ARCHIPELAGO_ISLAND_TOKEN"]
    assert pids_with_island_token(first["env"]["ARCHIPELAGO_ISLAND_TOKEN"]) == []
    assert "island-1: SIGKILL to" in result.output and "island-1: restart 1" in result.output


@pytest.mark.timeout(60)
def test_a_kill_at_a_step_lands_once_the_island_reached_it(tmp_path: Path) -> None:
    # Island 1's steps are 0.2 s apart, so a kill at a fixed second lands at a step that depends
    # on how long the islands took to start; `@step7` waits for the step itself.
    run_dir = tmp_path / "fed"
    result = run_local(["--islands", "1,1", "--kill", "1@step7", "--restart-after", "1", "--training.steps", "20",
                        "--job.run_dir", str(run_dir)])
    assert result.returncode == 0, result.output[-3000:]
    fed = json.loads((run_dir / "federation.json").read_text())
    (kill,) = [e for e in fed["events"] if e["event"] == "kill"]
    assert kill["island"] == 1 and kill["at_step"] == 7
    records = [json.loads(line) for line in (run_dir / "island-1" / "metrics.jsonl").read_text().splitlines()]
    before = [r["step"] for r in records if "event" not in r and "loss" in r and r["time"] < kill["time"]]
    assert 7 <= max(before) < 20  # it reached the step and was killed long before its end
    assert fed["islands"][1]["restarts"] == 1 and fed["islands"][1]["final_step"] == 20
    assert "island-1: SIGKILL to" in result.output and "(--kill 1@step7)" in result.output
    assert fed["islands"][0]["restarts"] == 0  # the other island's steps never trigger it


@pytest.mark.timeout(60)
def test_a_kill_whose_island_ends_first_is_reported_not_passed_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "fed"
    result = run_local(["--islands", "1,1", "--kill", "1@step50", "--training.steps", "6",
                        "--job.run_dir", str(run_dir)])
    assert result.returncode == 0, result.output[-3000:]  # the islands' work is whole
    fed = json.loads((run_dir / "federation.json").read_text())
    assert not [e for e in fed["events"] if e["event"] == "kill"]
    (missed,) = [e for e in fed["events"] if e["event"] == "kill_not_fired"]
    assert missed["island"] == 1 and missed["at"] == 50 and missed["last_step"] == 6
    assert "warning: --kill 1@step50 never fired: island-1 ended first (its last step was 6)" in result.output


@pytest.mark.timeout(60)
def test_failing_island_sets_exit_code_and_repeats_its_message(tmp_path: Path) -> None:
    run_dir = tmp_path / "fed"
    result = run_local(["--islands", "1,1", "--training.steps", "10", "--job.run_dir", str(run_dir)],
                       FAKE_ISLAND_FAIL="1:2@3")
    assert result.returncode == 2, result.output[-3000:]
    assert "island-1 failed (exit code 2): error: fake failure at step 3" in result.output
    fed = json.loads((run_dir / "federation.json").read_text())
    assert [i["exit_code"] for i in fed["islands"]] == [0, 2]
    assert fed["islands"][1]["final_step"] == 2


@pytest.mark.timeout(60)
def test_sigint_stops_every_island_and_exits_130(tmp_path: Path) -> None:
    run_dir = tmp_path / "fed"
    env = launcher_env()
    proc = start_local(["--islands", "2,1", "--training.steps", "500", "--job.run_dir", str(run_dir)], env)
    try:
        deadline = time.monotonic() + 30
        while not all((run_dir / f"island-{k}" / "metrics.jsonl").is_file() for k in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "islands never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
    finally:
        result = finish(proc, env, timeout=30)
    assert result.returncode == 130, result.output[-3000:]
    fed = json.loads((run_dir / "federation.json").read_text())
    assert fed["interrupted"] is True
    assert {i["state"] for i in fed["islands"]} == {"stopped"}


@pytest.mark.timeout(30)
def test_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert local.main(["--islands", "2,0"]) == 2
    assert local.main(["--islands", "2,1", "--kill", "2@5"]) == 2
    assert local.main(["--islands", "1", "--kill", "zero@5"]) == 2
    assert local.main(["--islands", "1", "--kill", "0@step1.5"]) == 2  # a step is whole
    assert local.main(["--islands", "2,1", "--kill", "2@step5"]) == 2
    assert "ISLAND@SECONDS or ISLAND@stepN" in capsys.readouterr().err
    assert local.main(["--islands", "2,1", "--slowdown", "1"]) == 2  # one factor per island
    assert "one factor per island" in capsys.readouterr().err
    assert local.main(["--islands", "2,1", "--slowdown", "0.5,1"]) == 2
    assert local.main(["--islands", "2,1", "--inject", "2:nan@3"]) == 2
    assert local.main(["--islands", "2,1", "--inject", "1:zero@3"]) == 2
    assert "expected [ISLAND:]KIND@AT" in capsys.readouterr().err
    assert local.main(["--islands", "2,1", "--inject", "1:kill@3"]) == 2  # kills go through --kill
    assert local.main(["--islands", "2,1", "--inject", "nan@3"]) == 2  # which island?
    assert local.main(["--help"]) == 0
    assert "--restart-after" in capsys.readouterr().out
    # Island options that cannot parse stop the launcher before anything starts.
    assert local.main(["--islands", "1", "--run-dir", "x"]) == 2  # --job.run_dir is meant
    assert local.main(["--islands", "1", "--training.steps", "many"]) == 2
    assert local.main(["--islands", "1", "--config", "no/such/config.toml"]) == 2
    out = capsys.readouterr()
    assert "lighthouse at" not in out.out + out.err
    assert "--run-dir" in out.out + out.err and "no/such/config.toml" in out.err


def test_a_keyless_lighthouse_beyond_loopback_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # 192.0.2.1 (TEST-NET-1) is not this machine's: the refusal comes before anything binds.
    monkeypatch.delenv("ARCHIPELAGO_FEDERATION_KEY_FILE", raising=False)
    args = ["--islands", "1", "--lighthouse-bind", "192.0.2.1:0", "--job.run_dir", str(tmp_path / "run")]
    assert local.main(args) == 2
    err = capsys.readouterr().err
    assert "--lighthouse-bind 192.0.2.1:0 without a federation key" in err
    assert "--federation_security.insecure" in err and "islands" not in err.split("error:")[0]


def test_slowdown_and_inject_reach_only_their_island(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = local.parse_args(["--islands", "2,1", "--slowdown", "1,3", "--inject", "1:nan@2",
                             "--inject", "1:scale1000@4", "--inject", "0:crash@7"])
    assert opts.slowdowns == [1.0, 3.0]
    # Repeated --inject for one island keeps every entry, in the island's environment value.
    assert {k: local.fault_env_value(v) for k, v in opts.injections.items()} == {1: "nan@2,scale1000@4",
                                                                               0: "crash@7"}
    monkeypatch.setenv("ARCHIPELAGO_FAULT", "nan@1")  # the launcher's own environment never leaks
    assert "ARCHIPELAGO_FAULT" not in local.island_env("t", "http://h:1", 3)


@pytest.mark.timeout(60)
def test_an_exception_in_the_launcher_still_kills_every_island(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "fed"
    started = [run_dir / f"island-{k}" / "starts.jsonl" for k in (0, 1)]

    def broken_display(self: local.LocalFederation) -> None:
        if all(path.is_file() for path in started) and self._elapsed() > 1.0:
            raise RuntimeError("display broke")

    monkeypatch.setenv(local.ISLAND_CMD_ENV, f"{sys.executable} {FAKE_ISLAND}")
    monkeypatch.setattr(local.LocalFederation, "_show", broken_display)
    tokens: list[str] = []
    try:
        with pytest.raises(RuntimeError, match="display broke"):
            local.main(["--islands", "2,1", "--training.steps", "500", "--job.run_dir", str(run_dir)])
        tokens = [starts(path.parent)[0]["env"]["ARCHIPELAGO_ISLAND_TOKEN"] for path in started]
        assert [pids_with_island_token(t) for t in tokens] == [[], []]
    finally:  # never leak the fake islands into the rest of the session
        for token in tokens:
            local.kill_island(token)


# ----------------------------------------------------------------- units


def test_parse_args_passes_unknown_options_through_in_order() -> None:
    opts = local.parse_args(["--config", "c.toml", "--islands", "2,1", "--optimizer.lr", "-1e-3",
                             "--job.run_dir=runs/x", "--kill", "1@2.5", "--kill", "0@1", "--no-table",
                             "--kill", "1@step16", "--training.steps=5"])
    assert opts.islands == [2, 1]
    assert opts.kills == [Fault("kill", 2.5, 1), Fault("kill", 1.0, 0), Fault("kill_at_step", 16, 1)]
    assert opts.run_dir == Path("runs/x") and opts.table is False
    assert opts.passthrough == ["--config", "c.toml", "--optimizer.lr", "-1e-3", "--training.steps=5"]
    assert local.parse_args(["--islands", "1"]).run_dir.name.startswith("local-")


def test_island_command_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = local.island_command(1, 2, 3, ["--config", "c.toml"], Path("runs/x"), "http://h:1", program=["prog"])
    assert cmd == ["prog", "--nproc", "2", "--config", "c.toml", "--job.run_dir", "runs/x/island-1",
                   "--fault_tolerance.enable", "--fault_tolerance.replica_id=1",
                   "--fault_tolerance.group_size=3", "--fault_tolerance.lighthouse", "http://h:1",
                   "--metrics.progress", "plain"]
    monkeypatch.delenv(local.ISLAND_CMD_ENV, raising=False)
    assert local.island_program() == [sys.executable, "-m", "archipelago.launch.cli", "train"]
    monkeypatch.setenv(local.ISLAND_CMD_ENV, "/usr/bin/env 'fake island'")
    assert local.island_program() == ["/usr/bin/env", "fake island"]
    env = local.island_env("tok", "http://h:1", total_ranks=3, base={"PATH": "/bin"})
    assert env["ARCHIPELAGO_ISLAND_TOKEN"] == "tok" and env["TORCHFT_LIGHTHOUSE"] == "http://h:1"
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 3))
    assert local.island_env("t", "u", 3, base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


def test_reachable_url_prefers_the_bound_address() -> None:
    assert local.reachable_url("http://vm:1234", "127.0.0.1:0") == "http://127.0.0.1:1234"
    assert local.reachable_url("http://vm:1234", "[::]:0") == "http://vm:1234"
    assert local.reachable_url("http://vm:1234", "0.0.0.0:1234") == "http://vm:1234"


def test_metrics_tail_waits_for_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = local.MetricsTail(path)
    tail.poll()  # no file yet: nothing, no error
    path.write_text('{"step": 1, "loss": 4.0, "tokens_per_s": 10.0, "time": 1}\n{"step": 2, "lo')
    tail.poll()
    assert tail.latest == {"step": 1, "loss": 4.0, "tokens_per_s": 10.0}
    with open(path, "a") as f:
        f.write('ss": 3.5, "tokens_per_s": 12.0}\n{"event": "outer_step", "outer_step": 1, "participants": 2}\n'
                '{"step": 0, "val_loss": 3.0, "tokens": 0}\n')
    tail.poll()
    assert tail.latest == {"step": 2, "loss": 3.5, "tokens_per_s": 12.0, "outer_step": 1, "participants": 2}


def test_live_table_renders() -> None:
    from rich.console import Console

    out = io.StringIO()
    row = ["0", "2", "running", "5", "1", "3.5000", "1.2k", "2"]
    Console(file=out, width=100).print(local_display.rich_table(local_display.LIVE_HEADERS, [row]))
    text = out.getvalue()
    assert "participants" in text and "running" in text and "1.2k" in text
    assert local_display.plain_table(["a", "bb"], [["1", "2"]]) == "a  bb\n1  2"


def test_hashes_are_compared_at_the_last_outer_step_every_island_committed(tmp_path: Path) -> None:
    def outer(n: int, digest: str, committed: bool = True) -> dict:
        return {"event": "outer_step", "time": float(n), "step": 5 * n, "outer_step": n, "committed": committed,
                "participants": 2, "healed": False, "global_hash": digest, "codec": f"auto:{digest}"}

    logs = {0: [outer(1, "a"), outer(2, "b")],
            1: [outer(1, "a"), outer(2, "b"), outer(3, "c")]}  # island 1 synced once more, alone
    for k, records in logs.items():
        (tmp_path / f"island-{k}").mkdir()
        (tmp_path / f"island-{k}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fed = load_federation(tmp_path)
    assert [i["global_hash"] for i in fed["islands"]] == ["b", "c"]
    assert fed["global_hash_agree"] is True and fed["global_hash_outer_step"] == 2
    assert [e["islands"] for e in fed["outer_steps"]] == [[0, 1], [0, 1], [1]]
    assert [e["codec"] for e in fed["outer_steps"]] == ["auto:a", "auto:b", "auto:c"]  # what crossed in each
    with open(tmp_path / "island-1" / "metrics.jsonl", "a") as f:  # island 1 re-logs step 2 differently
        f.write(json.dumps(outer(2, "x")) + "\n")
    fed = load_federation(tmp_path)
    assert fed["outer_steps"][1]["hash_agree"] is False and fed["global_hash_agree"] is False


# ---------------------------------------------------------------- report


@pytest.mark.timeout(90)
def test_report_on_a_federation_run_dir(killed_run: tuple[Path, Finished], tmp_path: Path) -> None:
    run_dir, _ = killed_run
    png, md = write_report(run_dir)
    assert png == run_dir / "report" / "loss.png" and png.read_bytes().startswith(PNG_MAGIC)
    text = md.read_text()
    assert text.startswith("# Federation report: fed")
    assert "| 1 | 2 | 1 | 4 | 20 | 1.6667 | 1.8333 |" in text  # island 1: ranks, restarts, outer steps ...
    assert "| 2 | 2 | 0, 1 |" in text  # outer step 2: 2 participants, committed by both
    assert "| kill | launcher |" in text and "| restart | launcher |" in text
    assert "final global weights agree: yes" in text
    # Without federation.json (launcher died): rebuilt from the islands' metrics alone.
    bare = tmp_path / "bare"
    for k in (0, 1):
        (bare / f"island-{k}").mkdir(parents=True)
        (bare / f"island-{k}" / "metrics.jsonl").write_bytes((run_dir / f"island-{k}" / "metrics.jsonl").read_bytes())
    assert load_federation(bare)["islands"][1]["outer_steps_committed"] == 4
    png, md = write_report(bare)
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "| 1 | n/a | n/a | 4 | 20 |" in md.read_text()


@pytest.mark.timeout(60)
def test_cli_has_local_and_report_commands(killed_run: tuple[Path, Finished]) -> None:
    from archipelago.launch.cli import COMMANDS

    run_dir, _ = killed_run
    result = run_cli_here(["report", str(run_dir)])
    assert result.returncode == 0 and "# Federation report" in result.output
    assert "local" in COMMANDS
    result = run_cli_here(["local", "--help"])
    assert result.returncode == 0 and "--restart-after" in result.output


def test_round_totals_measure_utilisation_from_the_end_of_the_join_round():
    from archipelago.metrics.islands import round_totals

    records = [{"time": 100.0, "inner_steps": 0, "tokens": 0, "compute_s": 0.0, "sync_s": 5.0},  # join
               {"time": 110.0, "inner_steps": 3, "tokens": 300, "compute_s": 9.0, "sync_s": 1.0},
               {"time": 120.0, "inner_steps": 4, "tokens": 400, "compute_s": 7.0, "sync_s": 3.0}]
    totals = round_totals(records)
    assert totals == {"inner_steps": 7, "tokens": 700, "compute_s": 16.0, "wait_s": 4.0, "untimed_s": 0.0,
                      "window_s": 20.0, "utilisation": 0.8}
    assert round_totals(records[:1])["utilisation"] is None
    records[2]["untimed_s"] = 4.0  # an evaluation in the second round: neither compute nor waiting
    assert round_totals(records)["utilisation"] == 16.0 / 16.0


@pytest.mark.timeout(30)
def test_processes_are_found_by_exact_or_prefix_token_and_zombies_are_left_out() -> None:
    name, token = "ARCHIPELAGO_TEST_PROBE", uuid.uuid4().hex
    live = subprocess.Popen(["sleep", "30"], env={**os.environ, name: token + "-live"})
    zombie = subprocess.Popen(["true"], env={**os.environ, name: token + "-done"})  # never waited for yet
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and zombie.pid in pids_with_env(name, token + "-done"):
            time.sleep(0.05)  # `true` exits at once; until it is reaped it is a zombie
        assert pids_with_env(name, token + "-live") == [live.pid]
        assert pids_with_env(name, token) == []  # exact match: a prefix alone is not the value
        assert pids_with_env(name, token, prefix=True) == [live.pid]  # the zombie is not signalled again
    finally:
        live.kill()
        live.wait(timeout=10)
        zombie.wait(timeout=10)


def test_with_a_federation_key_the_local_lighthouse_admits_members_only(tmp_path: Path) -> None:
    from archipelago.federation.trust import new_secret

    key_file = tmp_path / "fed.key"
    key_file.write_text(new_secret())
    key_file.chmod(0o600)
    keyed = run_local(["--islands", "1", "--training.steps", "4", "--model.flavor", "debug",
                       "--federation_security.key_file", str(key_file), "--job.run_dir", str(tmp_path / "keyed")])
    plain = run_local(["--islands", "1", "--training.steps", "4", "--model.flavor", "debug",
                       "--job.run_dir", str(tmp_path / "plain")], ARCHIPELAGO_FEDERATION_KEY_FILE="")
    assert keyed.returncode == 0 and plain.returncode == 0, keyed.output[-2000:] + plain.output[-2000:]
    assert "(members only: the islands' federation key)" in keyed.output
    assert "lighthouse at http://127.0.0.1:" in plain.output and "members only" not in plain.output


def test_island_options_reach_only_their_island_after_the_shared_ones(capsys: pytest.CaptureFixture[str]) -> None:
    opts = local.parse_args(["--islands", "2,1", "--island-options", "0:--parallelism.pipeline_stages 2",
                             "--island-options", "0:--parallelism.stage_layers 4,2", "--training.steps", "5"])
    assert opts.island_options == {0: ["--parallelism.pipeline_stages", "2", "--parallelism.stage_layers", "4,2"]}
    assert local.main(["--islands", "2,1", "--island-options", "2:--training.steps 3"]) == 2
    assert local.main(["--islands", "2,1", "--island-options", "--training.steps 3"]) == 2
    assert local.main(["--islands", "2,1", "--island-options", "1:--training.stepz 3"]) == 2  # checked early
    out = capsys.readouterr()
    assert "there are only islands 0..1" in out.err and "ISLAND:OPTIONS" in out.err and "stepz" in out.out + out.err
    assert "lighthouse at" not in out.out + out.err
