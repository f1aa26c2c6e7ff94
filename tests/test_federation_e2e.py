"""Whole federations of real islands (torchrun jobs) on CPU, through the CLI.

Each test starts islands as subprocesses (via `archipelago local`, or one by one with
an in-process lighthouse), with hard timeouts, and kills every process it started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, kill_started_processes, pids_with_token, records, run_cli, run_cli_here
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROUND = ["--fault_tolerance.sync_steps", "4", "--training.val_every", "0", "--checkpoint.interval", "4",
         "--metrics.log_every", "4"]


def _federation(tmp: Path, name: str, islands: str, *extra: str) -> dict:
    run_dir = tmp / name
    done = run_cli(["local", "--islands", islands, "--no-table", *TINY, *ROUND, "--training.steps", "8",
                    "--job.run_dir", str(run_dir), *extra], timeout=300)
    assert done.returncode == 0, done.output[-4000:]
    return json.loads((run_dir / "federation.json").read_text())


def _final_weights(island_dir: Path, part: str = ".model.") -> dict[str, torch.Tensor]:
    """The last checkpoint's tensors whose key contains `part` (the model's weights, or
    the optimizer's moments with part=".exp_avg")."""
    ckpt = island_dir / "checkpoints" / (island_dir / "checkpoints" / "latest").read_text().strip()
    out = island_dir / "final.pt"
    if not out.exists():
        dcp_to_torch_save(ckpt, out)
    state = torch.load(out, weights_only=False)  # this test's own checkpoint
    return {k: v for k, v in _flatten(state).items() if part in f".{k}" and torch.is_tensor(v)}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


@pytest.mark.slow  # over 30 s on 2 cores: make test-slow (CI runs it)
@pytest.mark.timeout(600)
def test_islands_of_two_and_one_ranks_match_one_and_one(tmp_path):
    from archipelago.config import load_config
    from archipelago.quality_simulator import simulate

    # With the inner optimizer's moments averaged too: they cross the 2-rank island's FSDP
    # shards through the same flat layout as the weights.
    averaged = ["--fault_tolerance.average_optimizer_state"]
    mixed = _federation(tmp_path, "mixed", "2,1", *averaged)
    assert mixed["global_hash_agree"], mixed["islands"]
    # The joining round (everyone sends nothing, receives the start weights), then two rounds.
    assert [s["participants"] for s in mixed["outer_steps"]] == [2, 2, 2]
    assert all(i["outer_steps_committed"] == 3 for i in mixed["islands"])
    assert [i["ranks"] for i in mixed["islands"]] == [2, 1]
    a, c = _final_weights(tmp_path / "mixed" / "island-0"), _final_weights(tmp_path / "mixed" / "island-1")
    # Two 1-rank islands, in-process: the simulator trains the weights of `archipelago local
    # --islands 1,1` bit for bit (test_quality checks that against a real federation).
    cfg = load_config([*TINY, *ROUND, "--training.steps", "8", *averaged, "--fault_tolerance.enable"])
    even = simulate(cfg, islands=2, eval_windows=8).models[0].state_dict()
    assert len(a) > 10 and a.keys() == c.keys() and {n.split("model.", 1)[1] for n in a} == even.keys()
    for name in a:
        torch.testing.assert_close(a[name], c[name], rtol=0, atol=0, msg=name)  # one global model
        plain = name.split("model.", 1)[1]
        torch.testing.assert_close(a[name], even[plain], rtol=1e-4, atol=2e-4, msg=name)  # FSDP vs 1 rank
    # The run ends on an outer step: every island continues from the same averaged moments.
    ma, mc = (_final_weights(tmp_path / "mixed" / island, ".exp_avg") for island in ("island-0", "island-1"))
    assert ma.keys() == mc.keys() and len(ma) > 20
    for name in ma:
        torch.testing.assert_close(ma[name], mc[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow  # two federations, about 40 s on 2 cores: make test-slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("target_s,rides", [("60", True), ("1e-9", False)], ids=["link-carries", "link-too-thin"])
def test_auto_moments_follow_the_link_on_every_rank_of_a_two_rank_island(tmp_path, target_s, rides):
    # codec = "auto" decides each round whether the averaged moments ride; the 2-rank
    # island's second rank holds no bridge and must follow its bridge rank's decision, or
    # the island's gather of the moments would wait for a rank that skipped it.
    auto = ["--fault_tolerance.codec", "auto", "--fault_tolerance.average_optimizer_state",
            "--fault_tolerance.target_exchange_s", target_s]
    fed = _federation(tmp_path, "auto", "2,1", *auto)
    assert fed["global_hash_agree"], fed["islands"]
    labels = [[r["codec"] for r in records(tmp_path / "auto" / f"island-{k}")
               if r.get("event") == "outer_step" and r["committed"]] for k in range(2)]
    assert labels[0] == labels[1] and len(labels[0]) == 3, labels  # the join round, then two
    assert ("+moments" in labels[0][-1]) == rides, labels
    ma, mc = (_final_weights(tmp_path / "auto" / island, ".exp_avg") for island in ("island-0", "island-1"))
    assert ma.keys() == mc.keys() and len(ma) > 20
    same = all(torch.equal(ma[name], mc[name]) for name in ma)
    assert same == rides  # the last round's average on both, or each island's own moments


@pytest.mark.slow  # over 30 s on 2 cores: make test-slow (CI runs it)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arrival", [0, 1], ids=["at-the-round-end", "one-step-in"])
def test_decoupled_rounds_on_a_two_rank_island_train_the_simulators_weights(tmp_path, arrival):
    from archipelago.config import load_config
    from archipelago.quality_simulator import simulate

    # Decoupled rounds whose every exchange overlaps the next round, with an FSDP island of
    # two ranks beside a one-rank island: the rebase and the decisions cross the 2-rank
    # island's shards (also when the exchange is applied during the next round,
    # arrival_steps); the run ends with the last exchange let in, on the global weights.
    decoupled = ["--fault_tolerance.round_mode", "decoupled", "--fault_tolerance.overlap_threshold", "0",
                 "--fault_tolerance.arrival_steps", str(arrival)]
    mixed = _federation(tmp_path, "mixed", "2,1", *decoupled, "--training.steps", "12")
    assert mixed["global_hash_agree"], mixed["islands"]
    assert [i["ranks"] for i in mixed["islands"]] == [2, 1]
    a, c = _final_weights(tmp_path / "mixed" / "island-0"), _final_weights(tmp_path / "mixed" / "island-1")
    cfg = load_config([*TINY, *ROUND, "--training.steps", "12", *decoupled, "--fault_tolerance.enable"])
    sim = simulate(cfg, islands=2, eval_windows=8, handoff_delays=[1, 1])
    assert sim.staleness == ([0, 0, 1, 1, 1, 1] if not arrival else [0] * 6)
    even = sim.models[0].state_dict()
    assert len(a) > 10 and a.keys() == c.keys() and {n.split("model.", 1)[1] for n in a} == even.keys()
    for name in a:
        torch.testing.assert_close(a[name], c[name], rtol=0, atol=0, msg=name)  # one global model
        torch.testing.assert_close(a[name], even[name.split("model.", 1)[1]], rtol=1e-4, atol=2e-4, msg=name)


@pytest.mark.slow  # the arithmetic of each width is checked in-process: test_rounds, test_federation
@pytest.mark.timeout(900)
def test_sync_width_one_and_two_give_the_same_global_weights(tmp_path):
    narrow = _federation(tmp_path, "w1", "2,2", "--fault_tolerance.sync_width", "1",
                         "--training.batch_size", "4")
    wide = _federation(tmp_path, "w2", "2,2", "--fault_tolerance.sync_width", "2",
                       "--training.batch_size", "4")
    for fed in (narrow, wide):  # the hash covers the chunks of one width, so compare within one
        assert fed["global_hash_agree"], fed["islands"]
    a, b = _final_weights(tmp_path / "w1" / "island-1"), _final_weights(tmp_path / "w2" / "island-1")
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:  # the bridge changes who sends what, not the arithmetic
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_sync_width_above_an_islands_rank_count_is_refused():
    from archipelago.config import ConfigError, load_config, validate_for_island

    cfg = load_config(["--fault_tolerance.enable", "--fault_tolerance.sync_width", "2"])
    validate_for_island(cfg, 2)
    with pytest.raises(ConfigError, match="sync_width = 2 exceeds this island's 1 rank"):
        validate_for_island(cfg, 1)


# ---- islands started one by one ----------------------------------------------------


class Islands:
    """Island subprocesses sharing one token, so that every process can be killed."""

    def __init__(self, lighthouse: str) -> None:
        self.token, self.lighthouse = uuid.uuid4().hex, lighthouse
        self.procs: list[subprocess.Popen] = []

    def start(self, run_dir: Path, island: int, nproc: int, *args: str, fault: str | None = None,
              log: Path | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "ARCHIPELAGO_FAULT"}
        # One thread per rank, as `archipelago local` sets: islands share the machine's cores.
        env.update(PYTHONUNBUFFERED="1", ARCHIPELAGO_TEST_TOKEN=self.token, OMP_NUM_THREADS="1")
        if fault:
            env["ARCHIPELAGO_FAULT"] = fault
        cmd = [sys.executable, "-m", "archipelago.launch.cli", "train", "--nproc", str(nproc), *TINY,
               *ROUND, "--fault_tolerance.enable", f"--fault_tolerance.replica_id={island}",
               "--fault_tolerance.group_size=2", "--fault_tolerance.lighthouse", self.lighthouse,
               "--job.run_dir", str(run_dir / f"island-{island}"), *args]
        out = open(log or run_dir / f"island-{island}.log", "a")  # noqa: SIM115 - closed by the child's exit
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        kill_started_processes(self.token)
        for p in self.procs:
            p.wait(timeout=30)
        assert not pids_with_token(self.token)


@pytest.fixture
def islands():
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60000,
                                  heartbeat_timeout_ms=2000)
    group = Islands(lighthouse.address())
    try:
        yield group
    finally:
        group.close()
        lighthouse.shutdown()


def _records(island_dir: Path, event: str) -> list[dict]:
    return [r for r in records(island_dir) if r.get("event") == event]


def _alone(island_dir: Path) -> list[dict]:
    """The outer steps an island committed with no other island in the round."""
    if not (island_dir / "metrics.jsonl").exists():
        return []
    return [r for r in _records(island_dir, "outer_step") if r["committed"] and r["participants"] == 1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["synchronous", pytest.param("decoupled", marks=pytest.mark.slow),
                                  pytest.param("arrival", marks=pytest.mark.slow)])  # make test-slow
def test_killed_island_heals_from_a_live_peer_and_all_end_equal(islands, tmp_path, monkeypatch, mode):
    # With a federation key: the restarted island signs its request, the peer its answer.
    # Decoupled: every exchange overlaps the next round; the restarted island resumes from a
    # checkpoint written while an exchange was in flight, joins, heals, and sends nothing in
    # its first exchange, which it starts with the survivor's next one. Arrival: the same,
    # each exchange applied two steps into the next round (arrival_steps).
    key_file = tmp_path / "fed.key"
    key_file.write_text(run_cli_here(["secret", "new"]).output)
    key_file.chmod(0o600)  # a key others can read is refused
    monkeypatch.setenv("ARCHIPELAGO_FEDERATION_KEY_FILE", str(key_file))
    # Long enough that the survivor is still training when the victim is back (about 10 s
    # after the crash here, 20 s before the survivor's end); seq_len 128 makes the steps
    # slow enough for that.
    steps = ["--training.steps", "40", "--data.seq_len", "128"]
    if mode != "synchronous":
        steps += ["--fault_tolerance.round_mode", "decoupled", "--fault_tolerance.overlap_threshold", "0",
                  "--fault_tolerance.arrival_steps", "2" if mode == "arrival" else "0"]
    survivor = islands.start(tmp_path, 0, 2, *steps)
    victim = islands.start(tmp_path, 1, 1, *steps, fault="crash@14")  # mid-round (rounds end at 4k)
    assert victim.wait(timeout=300) != 0
    # Restart once the survivor has gone on alone: a restart racing the lighthouse's dropping
    # of the dead island can join the survivor's very next round (it did on a loaded machine).
    deadline = time.monotonic() + 300
    while not _alone(tmp_path / "island-0") and survivor.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    restarted = islands.start(tmp_path, 1, 1, *steps)
    assert restarted.wait(timeout=400) == 0, (tmp_path / "island-1.log").read_text()[-3000:]
    assert survivor.wait(timeout=400) == 0, (tmp_path / "island-0.log").read_text()[-3000:]
    assert _alone(tmp_path / "island-0"), "the survivor never committed an outer step on its own"
    healed = [r for r in _records(tmp_path / "island-1", "outer_step") if r["healed"]]
    assert healed and healed[0]["committed"], "the restarted island did not heal from its peer"
    leave = [_records(tmp_path / f"island-{k}", "leave")[-1] for k in range(2)]
    assert leave[0]["global_hash"] == leave[1]["global_hash"], leave
    assert leave[0]["step"] == leave[1]["step"] == 40
    from archipelago.federation.trust import load_key

    federation = f"key {load_key(str(key_file)).federation_id.hex()[:12]}"
    assert all(federation in (tmp_path / f"island-{k}.log").read_text() for k in range(2))
    # The restarted island resumed from its own checkpoint, whose manifest the key signs.
    assert [r["step"] for r in _records(tmp_path / "island-1", "resume")] == [12]
    manifest = json.loads((tmp_path / "island-1" / "checkpoints" / "step-00000040" / "COMPLETE.json").read_text())
    assert len(manifest["hmac"]) == 64


@pytest.mark.timeout(300)
@pytest.mark.slow  # 14 s on 2 cores: make test-slow (test_federation checks the fingerprint in-process)
def test_a_different_model_is_refused_naming_both_islands(islands, tmp_path):
    first = islands.start(tmp_path, 0, 1, "--training.steps", "8", "--fault_tolerance.join_wait_ms", "3000")
    other = islands.start(tmp_path, 1, 1, "--training.steps", "8", "--model.name", "qwen3")
    assert other.wait(timeout=240) == 2
    assert first.wait(timeout=240) == 0
    message = (tmp_path / "island-1.log").read_text()
    assert "does not match" in message and "llama3/debug" in message and "qwen3/debug" in message
    assert "island 0" in message and "island 1" in message


@pytest.mark.timeout(120)
def test_unreachable_lighthouse_is_a_clear_error_not_a_hang(tmp_path):
    from test_island import _free_port

    done = run_cli_here(["train", *TINY, "--training.steps", "4", "--job.run_dir", str(tmp_path / "run"),
                         "--fault_tolerance.enable", "--fault_tolerance.lighthouse",
                         f"http://127.0.0.1:{_free_port()}", "--fault_tolerance.connect_timeout_ms", "2000"])
    assert done.returncode == 2, done.output[-3000:]
    assert "cannot reach the lighthouse" in done.output and "archipelago lighthouse" in done.output


@pytest.mark.timeout(600)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_leader_scope_lets_only_the_lowest_live_island_save_the_model(islands, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    fed = _federation(tmp_path, "leader", "1,1", "--checkpoint.scope", "leader")
    assert fed["global_hash_agree"]

    def keys(island: int) -> set[str]:
        folder = tmp_path / "leader" / f"island-{island}" / "checkpoints"
        latest = folder / (folder / "latest").read_text().strip()
        return set(FileSystemReader(str(latest)).read_metadata().state_dict_metadata)

    leader, other = keys(0), keys(1)
    assert any(k.startswith("train.") for k in leader) and any(k.startswith("federation.") for k in leader)
    assert not any(k.startswith(("train.", "federation.")) for k in other)
    assert any(k.startswith("data.") for k in other)
    # Resuming the non-leader (already at its last step) reads its data position only.
    again = islands.start(tmp_path / "leader", 1, 1, "--training.steps", "8", "--checkpoint.scope", "leader")
    assert again.wait(timeout=120) == 0
    assert "data position only" in (tmp_path / "leader" / "island-1.log").read_text()


def _federation_behind_the_gate(tmp: Path, key_file: Path, rogue: bool) -> list[str]:
    """Two keyed islands (8 steps) behind a lighthouse with the key; with `rogue`, a keyless
    torchft replica at step 10^9 knocks at the same lighthouse from before they start to
    after they end. Returns the islands' final global hashes."""
    from archipelago.federation.trust import load_key
    from archipelago.launch.lighthouse import start_lighthouse

    gate = start_lighthouse("127.0.0.1:0", min_replicas=1, join_timeout_ms=60000, heartbeat_timeout_ms=2000,
                            key=load_key(str(key_file)))
    group = Islands(gate.address())
    intruder = None
    try:
        if rogue:
            env = {k: v for k, v in os.environ.items() if k != "ARCHIPELAGO_FEDERATION_KEY_FILE"}
            env.update(PYTHONUNBUFFERED="1", ARCHIPELAGO_TEST_TOKEN=group.token)
            log = open(tmp / "rogue.log", "w")  # noqa: SIM115 - closed by the child's exit
            intruder = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "rogue_island.py"), gate.address(), str(tmp / "marker"),
                 str(tmp / "joined")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            group.procs.append(intruder)
            deadline = time.monotonic() + 60
            while not gate.refused and time.monotonic() < deadline:
                time.sleep(0.2)
            assert gate.refused, (tmp / "rogue.log").read_text()[-2000:]
        honest = [group.start(tmp, k, 1, "--training.steps", "8") for k in range(2)]
        for k, proc in enumerate(honest):
            assert proc.wait(timeout=300) == 0, (tmp / f"island-{k}.log").read_text()[-3000:]
        if intruder is not None:
            assert intruder.poll() is None, "the rogue gave up before the islands ended"
            assert all(r.startswith("island_2") for r in gate.refused), gate.refused
    finally:
        group.close()
        gate.shutdown()
    # Every round had both islands: the gate passes torchft's heartbeats (no deadline) on.
    assert {r["participants"] for k in range(2) for r in _records(tmp / f"island-{k}", "outer_step")} == {2}
    return [_records(tmp / f"island-{k}", "leave")[-1]["global_hash"] for k in range(2)]


@pytest.mark.timeout(600)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_a_rogue_without_the_key_at_step_1e9_runs_nothing_gets_nothing_and_changes_nothing(
        tmp_path, caplog, monkeypatch):
    key_file = tmp_path / "fed.key"
    key_file.write_text(run_cli_here(["secret", "new"]).output)
    key_file.chmod(0o600)
    monkeypatch.setenv("ARCHIPELAGO_FEDERATION_KEY_FILE", str(key_file))  # the honest islands' key
    (tmp_path / "clean").mkdir()
    (tmp_path / "attacked").mkdir()
    clean = _federation_behind_the_gate(tmp_path / "clean", key_file, rogue=False)
    attacked = _federation_behind_the_gate(tmp_path / "attacked", key_file, rogue=True)
    assert attacked == clean and clean[0] == clean[1]
    assert not (tmp_path / "attacked" / "marker").exists()  # no island unpickled its state
    assert not (tmp_path / "attacked" / "joined").exists()  # it never entered a quorum: no download
    assert "refused an unauthenticated member (replica id 'island_2:" in caplog.text
    for k in range(2):  # the islands never saw it: no outsider in a quorum, no refused rows
        text = (tmp_path / "attacked" / f"island-{k}.log").read_text()
        assert "unauthenticated" not in text and "refus" not in text, text[-2000:]
        heals = [r["outer_step"] for r in _records(tmp_path / "attacked" / f"island-{k}", "heal")]
        assert heals == [r["outer_step"] for r in _records(tmp_path / "clean" / f"island-{k}", "heal")]


def _thin_federation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, carried: int,
                     *options: str) -> tuple[Path, int]:
    """`archipelago local` with islands 0 and 1 members and island 2 thin, carried by island 0
    every 2 rounds (with a federation key), run to its end: (its run directory, the port)."""
    from test_island import _free_port

    key_file = tmp_path / "fed.key"
    key_file.write_text(run_cli_here(["secret", "new"]).output)
    key_file.chmod(0o600)
    monkeypatch.setenv("ARCHIPELAGO_FEDERATION_KEY_FILE", str(key_file))
    port, run_dir = _free_port(), tmp_path / "thin"
    done = run_cli(["local", "--islands", "1,1,1", "--no-table", *TINY, *ROUND, *options,
                    "--job.run_dir", str(run_dir), "--fault_tolerance.thin_islands", "1",
                    "--island-options", f"0:--fault_tolerance.carries 2 --fault_tolerance.carried_tokens {carried} "
                                        f"--fault_tolerance.carry_port {port}",
                    "--island-options", f"2:--fault_tolerance.carrier http://127.0.0.1:{port} "
                                        "--fault_tolerance.carrier_island 0 --fault_tolerance.carry_rounds 2"],
                   timeout=360)
    assert done.returncode == 0, done.output[-4000:]
    return run_dir, port


@pytest.mark.slow  # about 40 s on 2 cores: make test-slow (tests/test_thin.py checks the arithmetic in-process)
@pytest.mark.timeout(400)
def test_a_thin_island_carried_by_a_member_enters_the_federation(tmp_path, monkeypatch):
    carried = 8 * 64 * 4 * 2  # batch x seq_len x sync_steps x carry_rounds
    run_dir, port = _thin_federation(tmp_path, monkeypatch, carried, "--training.steps", "16")
    fed = json.loads((run_dir / "federation.json").read_text())
    assert fed["global_hash_agree"] and fed["global_hash_outer_step"] is not None
    thin = fed["islands"][2]
    assert thin["carrier"] == f"http://127.0.0.1:{port}" and thin["uploads"] == 2 and thin["final_step"] == 16
    assert not _records(run_dir / "island-2", "outer_step")  # it joined no quorum
    # Its rows entered through island 0's: every upload but perhaps the last (which may
    # arrive after the members' last round) was carried into a committed outer step.
    carried_in = sum(r.get("carried", 0) for r in _records(run_dir / "island-0", "outer_step") if r["committed"])
    assert 1 <= carried_in <= 2
    assert not any(r.get("carried") for r in _records(run_dir / "island-1", "outer_step"))


@pytest.mark.slow  # about a minute on 2 cores: make test-slow
@pytest.mark.timeout(400)
def test_a_time_paced_thin_island_is_carried_by_a_time_paced_member(tmp_path, monkeypatch):
    # Time-paced rounds (2 s): the carrier declares the thin island's tokens on top of its
    # batch and still joins the members (the pacing compares batches), and the thin island
    # carries after 2 rounds' seconds, each upload within carried_tokens (its most steps,
    # max_inner_steps x carry_rounds).
    carried = 8 * 64 * 16 * 2  # batch x seq_len x max_inner_steps x carry_rounds
    run_dir, _ = _thin_federation(tmp_path, monkeypatch, carried, "--training.steps", "32",
                                  "--fault_tolerance.round_pacing", "time", "--fault_tolerance.round_seconds", "2",
                                  "--fault_tolerance.max_inner_steps", "16")
    fed = json.loads((run_dir / "federation.json").read_text())
    assert fed["global_hash_agree"] and fed["global_hash_outer_step"] is not None
    thin = fed["islands"][2]
    assert thin["uploads"] >= 1 and thin["final_step"] == 32
    uploads = _records(run_dir / "island-2", "upload")
    assert uploads and all(0 < u["tokens"] <= carried for u in uploads)
    refused = _records(run_dir / "island-2", "refused")
    assert not refused, refused
    carried_in = sum(r.get("carried", 0) for r in _records(run_dir / "island-0", "outer_step") if r["committed"])
    assert carried_in >= 1
