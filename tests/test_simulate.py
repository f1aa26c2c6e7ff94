"""`archipelago simulate`: rounds, utilisation, failures and scenarios against figures worked out by hand."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from archipelago.config import ConfigError
from archipelago.federation.simulate import Simulation, load_scenario, scaled, scenario_from_dict
from archipelago.federation.simulate_cli import simulate

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "configs" / "scenarios").glob("*.toml"))

PARAMS = 1_000_000
MBIT = 100.0


def _scenario(groups: list[dict], hours: float = 1.0, **ft) -> dict:
    return {"simulation": {"hours": hours, "params": PARAMS, "detect_s": 10.0},
            "fault_tolerance": {"min_replica_size": 1, **ft},
            "islands": [{"bandwidth_mbit": MBIT, "latency_ms": 5.0, "restart_s": 100.0, **g} for g in groups]}


def _fp32_exchange_s(islands: int) -> float:
    """By hand: each island receives the other islands' fp32 rows (16-byte header, rounded
    up to 8 bytes) over its link, plus one latency: the rows' all-to-all is one phase."""
    row = 16 + 4 * PARAMS
    return (islands - 1) * row * 8 / (MBIT * 1e6) + 0.005


@pytest.mark.parametrize("ft, phases", [({"codec": "fp32"}, 1),  # the rows' all-gather
                                        ({"codec": "int8"}, 2),  # reduce-scatter, then the sums' all-gather
                                        ({"codec": "fp32", "average_optimizer_state": True}, 2)])  # + the moments'
def test_an_exchange_waits_a_latency_per_phase_not_per_ring_hop(ft, phases):
    raw = _scenario([{"count": 4, "step_s": 1.0, "latency_ms": 250.0}], **ft)
    sim = Simulation(scenario_from_dict(raw))
    link_s = sim.received(4) * 8 / (MBIT * 1e6)
    # Every phase is an all-to-all: each island sends to the three others at once, so four
    # islands wait as many latencies as two do (a ring would wait 2 x 3 per phase).
    assert sim._exchange_s(4) == pytest.approx(link_s + phases * 0.25)
    assert sim._exchange_s(2) - sim.received(2) * 8 / (MBIT * 1e6) == pytest.approx(
        (2 if ft.get("average_optimizer_state") else 1) * 0.25)  # two islands: no reduce-scatter


def test_two_alike_islands_round_after_round():
    report = simulate(scenario_from_dict(_scenario([{"count": 2, "step_s": 1.0}], sync_steps=20)))
    exchange = _fp32_exchange_s(2)
    # Round 0 is the join (no training, one exchange); then rounds of 20 steps and an exchange
    # until the hour is up.
    rounds = 1 + math.ceil((3600 - exchange) / (20 + exchange))
    assert report.rounds == rounds and report.committed == rounds and report.failed_rounds == 0
    for k in range(2):
        assert report.islands[k].compute_s == pytest.approx((rounds - 1) * 20)
        assert report.islands[k].tokens == (rounds - 1) * 20 * 65536
        assert report.islands[k].received == rounds * (16 + 4 * PARAMS)


def test_topk_early_rounds_receive_the_early_fractions_bytes_then_the_configs():
    # The join round (outer step 0) and the next 5 send 2% of each chunk, the rest 1%: each
    # round's bytes are those of a codec built at that fraction (the reference).
    from archipelago.federation.simulate import exchange_bytes

    topk = {"codec": "topk", "topk_fraction": 0.01, "topk_chunk_size": 1024, "sync_steps": 20}
    two = [{"count": 2, "step_s": 1.0}]
    sparse = exchange_bytes(scenario_from_dict(_scenario(two, **topk)).ft, PARAMS, 2)
    dense = exchange_bytes(scenario_from_dict(_scenario(two, **{**topk, "topk_fraction": 0.02})).ft, PARAMS, 2)
    assert dense > sparse
    plain = simulate(scenario_from_dict(_scenario(two, **topk)))
    early = simulate(scenario_from_dict(_scenario(two, **topk, topk_early_fraction=0.02, topk_early_rounds=5)))
    assert plain.failed_rounds == early.failed_rounds == 0 and early.rounds > 10
    for k in range(2):
        assert plain.islands[k].received == plain.rounds * sparse
        assert early.islands[k].received == 6 * dense + (early.rounds - 6) * sparse


def test_time_pacing_keeps_unlike_islands_busy_where_step_pacing_idles_the_fast_one():
    groups = [{"step_s": 1.0}, {"step_s": 3.0}]
    steps = simulate(scenario_from_dict(_scenario(groups, sync_steps=20)))
    timed = simulate(scenario_from_dict(_scenario(groups, round_pacing="time", round_seconds=60.0)))
    # Steps: both train 20 steps a round, the fast one a third as long (it waits for the other).
    assert steps.utilisation(0) == pytest.approx(steps.utilisation(1) / 3, rel=1e-6)
    # Time: each trains until the next step would end further past 60 s than this one ends
    # before it: 60 steps of 1 s, 20 of 3 s; both about 60 / (60 + exchange) busy.
    busy = 60 / (60 + _fp32_exchange_s(2))
    assert timed.utilisation(0) == pytest.approx(busy, rel=0.02)
    assert timed.utilisation(1) == pytest.approx(busy, rel=0.02)
    assert timed.islands[0].tokens == 3 * timed.islands[1].tokens


def test_a_failure_before_the_exchange_costs_the_island_and_not_the_round():
    scenario = scenario_from_dict(_scenario([{"count": 2, "step_s": 1.0}], sync_steps=20))
    exchange = _fp32_exchange_s(2)
    round_s = 20 + exchange
    fail = exchange + 2 * round_s + 5.0  # 5 s into round 3's training
    report = simulate(scenario, fail_at=[(1, fail)])
    assert report.failed_rounds == 0
    survivor, failed = report.islands
    assert failed.failures == 1 and failed.down_s == 100.0
    # Back after 100 s, it heals at the next round's start (the global weights, fp32, over its link).
    assert failed.heal_s == pytest.approx(4 * PARAMS * 8 / (MBIT * 1e6) + 0.005)
    assert failed.wasted_s == pytest.approx(5.0)  # the 5 s of round 3 it trained before it died
    assert survivor.compute_s > failed.compute_s + 100  # it trained through


def test_a_failure_inside_the_exchange_loses_the_round_for_every_island_without_retries():
    scenario = scenario_from_dict(_scenario([{"count": 3, "step_s": 1.0}], sync_steps=20, exchange_retries=0))
    exchange = _fp32_exchange_s(3)
    fail = exchange + 20 + exchange / 2  # the middle of round 1's exchange
    report = simulate(scenario, fail_at=[(2, fail)])
    assert report.failed_rounds == 1
    assert all(s.wasted_s == pytest.approx(20.0) for s in report.islands)  # round 1's training, lost


@pytest.mark.parametrize("repair", ["restart", "segment"])
def test_with_retries_the_survivors_commit_the_round_a_member_died_in(repair):
    raw = _scenario([{"count": 3, "step_s": 1.0}], sync_steps=20, exchange_retries=1)
    raw["simulation"]["repair"] = repair
    exchange3, exchange2 = _fp32_exchange_s(3), _fp32_exchange_s(2)
    fail = exchange3 + 20 + exchange3 / 2  # the middle of round 1's exchange
    report = Simulation(scenario_from_dict(raw), fail_at=[(2, fail)])
    report.joined = [True] * 3  # round 1, by hand: the join took one exchange
    end, ok = report._round(exchange3, [0, 1, 2], 1)
    assert ok
    # By hand: the lighthouse drops the dead member after detect_s (10 s); then the two others
    # run the whole exchange again (restart), or only the dead member's segment: 2 x a half.
    again = exchange2 if repair == "restart" else 2 * exchange2 / 2
    assert end == pytest.approx(fail + 10.0 + again)
    survivors, dead = report.stats[:2], report.stats[2]
    assert all(s.compute_s == pytest.approx(20.0) and s.wasted_s == 0 for s in survivors)
    assert dead.wasted_s == pytest.approx(20.0) and dead.failures == 1


def test_retries_are_bounded_a_second_death_past_them_loses_the_round():
    scenario = scenario_from_dict(_scenario([{"count": 4, "step_s": 1.0}], sync_steps=20, exchange_retries=1))
    exchange = _fp32_exchange_s(4)
    fail = exchange + 20 + exchange / 4
    sim = Simulation(scenario, fail_at=[(2, fail), (3, fail + 1.0)])
    sim.joined = [True] * 4
    _, ok = sim._round(exchange, [0, 1, 2, 3], 1)
    assert not ok
    assert all(s.compute_s == 0 for s in sim.stats)


def test_reduce_scatter_is_what_keeps_topk_bytes_bounded_at_a_hundred_islands():
    from archipelago.federation.simulate import exchange_bytes

    base = scenario_from_dict(_scenario([{"count": 2, "step_s": 1.0}], codec="topk"))
    gathered = scenario_from_dict(_scenario([{"count": 2, "step_s": 1.0}], codec="topk",
                                            topk_exchange="all_gather"))
    for islands in (10, 100):
        auto = exchange_bytes(base.ft, PARAMS, islands)
        ring = exchange_bytes(gathered.ft, PARAMS, islands)
        assert (auto < ring) == (islands >= 17)
    assert exchange_bytes(base.ft, PARAMS, 100) < 4.5 * PARAMS < exchange_bytes(gathered.ft, PARAMS, 100)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_every_shipped_scenario_parses_and_runs_scaled(path):
    scenario = load_scenario(path)
    assert len(scenario.islands) >= 2
    small = scaled(scenario, 4)
    assert len(small.islands) == 4
    report = simulate(small)
    assert report.rounds > 0 and 0 <= report.goodput <= 1


def test_scenario_errors_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="did you mean `step_s`"):
        scenario_from_dict(_scenario([{"step": 1.0}]))
    with pytest.raises(ConfigError, match=r"\[\[islands\]\]"):
        scenario_from_dict({"simulation": {"hours": 1.0}})
    with pytest.raises(ConfigError, match="min_replica_size 3 is more than the 2 islands"):
        scenario_from_dict(_scenario([{"count": 2}], min_replica_size=3))
    with pytest.raises(ConfigError, match="unknown section"):
        scenario_from_dict({**_scenario([{"count": 2}]), "model": {}})


def test_the_cli_prints_a_table_per_island_count(tmp_path, capsys):
    from archipelago.launch.cli import main

    out = tmp_path / "runs.json"
    assert main(["simulate", str(SCENARIOS[0]), "--islands", "3", "5", "--hours", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## 3 islands" in text and "## 5 islands" in text and "goodput" in text
    import json

    runs = json.loads(out.read_text())
    assert [r["islands"] for r in runs] == [3, 5] and all(r["hours"] == 2 for r in runs)


def test_the_cli_applies_decoupled_exchanges_on_arrival_and_refuses_a_step_outside_the_round(capsys):
    from archipelago.launch.cli import main

    continents = [s for s in SCENARIOS if s.name == "continents.toml"][0]  # 100-step rounds
    common = [str(continents), "--round-mode", "decoupled", "--islands", "3", "--hours", "6"]
    assert main(["simulate", *common]) == 0
    late = capsys.readouterr().out
    assert main(["simulate", *common, "--arrival-steps", "60"]) == 0
    applied = capsys.readouterr().out
    assert "contributions entered 0.00 outer steps stale" in applied and "0.00 outer steps" not in late
    assert main(["simulate", *common, "--arrival-steps", "100"]) != 0  # the scenario's problems, with their fix
    assert "arrival_steps = 100: must be 0 (at the next round's end) up to sync_steps - 1 = 99" in \
        capsys.readouterr().err


def _write_run(root: Path, records: dict[int, list[dict]], events: list[dict], pacing: dict) -> Path:
    """A run directory as `archipelago local` leaves one, with just what the replay reads."""
    import json

    for k, recs in records.items():
        island = root / f"island-{k}"
        island.mkdir(parents=True)
        config = {"fault_tolerance": {"round_pacing": "time", "sync_steps": 10, "min_inner_steps": 1,
                                      "max_inner_steps": 1000, "outer_weighting": "tokens", "num_fragments": 1,
                                      **pacing},
                  "training": {"batch_size": 2}, "data": {"seq_len": 8}}
        (island / "config.json").write_text(json.dumps(config))
        (island / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (root / "federation.json").write_text(json.dumps({"events": events}))
    return root


def _outer(step: int, t: float, steps: int, weight: float, elapsed: list[float] | None, healed: bool = False) -> dict:
    record = {"event": "outer_step", "time": t, "outer_step": step, "committed": True, "sync_s": 0.5,
              "healed": healed, "inner_steps": steps, "weight": weight, "own_refused": None}
    if elapsed is not None:
        record["pacing_elapsed_s"] = elapsed
    return record


def test_replay_recomputes_pacing_weights_and_members_and_names_each_difference(tmp_path):
    from archipelago.federation.replay import compare, replayed

    # Rounds of 3 s: island 0's steps of 1 s end it after 3 (2.5 + 0.5 >= 3), island 1's of
    # 1.4 s after 2 (2.8 + 0.7 >= 3). Island 1 dies at t=7 and asks to join again at t=12;
    # island 0's round that was in flight fails (its record keeps outer step 2's number).
    fast, slow = [1.0, 2.0, 3.0], [1.4, 2.8]
    failed = {**_outer(2, 7.4, 2, 32.0, [1.0, 2.0]), "committed": False}
    records = {
        0: [{"event": "join", "time": 0.0}, _outer(1, 1.0, 0, 0.0, []), _outer(2, 5.0, 3, 48.0, fast), failed,
            _outer(3, 9.0, 3, 48.0, fast), _outer(4, 13.6, 3, 48.0, fast), _outer(5, 17.0, 3, 48.0, fast)],
        1: [{"event": "join", "time": 0.2}, _outer(1, 1.0, 0, 0.0, []), _outer(2, 5.0, 2, 32.0, slow),
            {"event": "join", "time": 12.0}, _outer(4, 13.6, 0, 0.0, [], healed=True),
            _outer(5, 17.0, 2, 32.0, slow)]}
    events = [{"event": "join", "time": 0.0, "island": 0}, {"event": "join", "time": 0.2, "island": 1},
              {"event": "kill", "time": 7.0, "island": 1}, {"event": "join", "time": 12.0, "island": 1}]
    run = _write_run(tmp_path / "run", records, events, {"round_seconds": 3.0})
    assert compare(run) == []
    members = {(d.outer_step, d.island): d.participants for d in replayed(run)}
    assert members[(3, 0)] == (0,) and members[(4, 1)] == (0, 1) and members[(2, 1)] == (0, 1)
    # A record that disagrees with the decisions is named: island 1 claims 3 steps in round 5.
    records[1][-1] = _outer(5, 17.0, 3, 48.0, slow)
    run = _write_run(tmp_path / "forged", records, events, {"round_seconds": 3.0})
    [(want, got)] = compare(run)
    assert (want.inner_steps, got.inner_steps, got.weight) == (3, 2, 32.0)


def test_replay_refuses_a_run_recorded_without_its_pacing(tmp_path):
    from archipelago.federation.replay import replayed

    records = {0: [{"event": "join", "time": 0.0}, _outer(1, 1.0, 0, 0.0, None), _outer(2, 5.0, 3, 48.0, None)]}
    run = _write_run(tmp_path / "run", records, [{"event": "join", "time": 0.0, "island": 0}],
                     {"round_seconds": 3.0})
    with pytest.raises(ConfigError, match="pacing_elapsed_s"):
        replayed(run)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_recorded_federation_with_a_kill_and_a_restart_replays_exactly(tmp_path):
    from conftest import run_cli

    from archipelago.federation.replay import compare, recorded

    run = tmp_path / "run"
    done = run_cli(["local", "--islands", "1,1", "--no-table", "--kill", "1@30", "--restart-after", "3",
                    "--config", "configs/llama3/federation.toml", "--training.steps", "100000",
                    "--training.time_budget_s", "60", "--fault_tolerance.round_pacing", "time",
                    "--fault_tolerance.round_seconds", "6", "--training.batch_size", "4", "--checkpoint.no_enable",
                    "--training.val_every", "100000", "--metrics.no_tensorboard", "--metrics.log_every", "1",
                    "--job.run_dir", str(run)],
                   timeout=400)
    assert done.returncode == 0, done.output[-3000:]
    rounds = recorded(run)
    alone = [r for r in rounds if r.participants == (0,)]
    rejoined = [r for r in rounds if r.island == 1 and r.inner_steps == 0 and r.outer_step > 1]
    assert alone and rejoined, rounds  # the kill left island 0 alone; island 1 came back through a join
    differ = compare(run)
    assert differ == [], "\n".join(f"recorded {want}\nreplayed {got}" for want, got in differ)


def test_auto_codec_in_the_simulator_keeps_the_exchange_within_its_target():
    from dataclasses import replace

    from archipelago.federation.simulate import Simulation, exchange_bytes

    base = _scenario([{"count": 3, "step_s": 1.0}], sync_steps=100, codec="auto", target_exchange_s=2.0)
    for mbit in (1000.0, 100.0, 20.0):
        raw = {**base, "islands": [{**g, "bandwidth_mbit": mbit} for g in base["islands"]]}
        sim = Simulation(scenario_from_dict(raw))
        sim.run()
        chosen = sim.round_ft(3)
        seconds = {name: exchange_bytes(replace(chosen, codec=name), PARAMS, 3) * 8 / (mbit * 1e6)
                   for name in ("fp32", "bf16", "int8", "topk")}
        order = list(seconds)
        fits = [name for name in order if seconds[name] <= 2.0]
        assert chosen.codec == (fits[0] if fits else min(seconds, key=seconds.get)), (mbit, seconds)
        assert set(sim.codecs_used) == {chosen.codec}


def test_a_round_left_with_fewer_islands_than_the_quorum_minimum_does_not_commit():
    scenario = scenario_from_dict(_scenario([{"count": 2, "step_s": 1.0}], sync_steps=20, min_replica_size=2))
    exchange = _fp32_exchange_s(2)
    report = simulate(scenario, fail_at=[(1, exchange + 20 + exchange + 3.0)])  # 3 s into round 2's training
    assert report.failed_rounds == 1  # island 0 alone is below min_replica_size: no commit
    assert report.islands[0].wasted_s == pytest.approx(20.0)
    # ... and with every island dead before the exchange, nothing commits either.
    both = simulate(scenario_from_dict(_scenario([{"count": 2, "step_s": 1.0}], sync_steps=20)),
                    fail_at=[(0, exchange + 5.0), (1, exchange + 6.0)])
    assert both.failed_rounds >= 1 and both.islands[0].failures == 1


# ---- decoupled rounds (simulate_decoupled.py) ----------------------------------------


def test_decoupled_islands_never_wait_and_each_contribution_is_one_step_stale():
    report = simulate(scenario_from_dict(_scenario([{"count": 2, "step_s": 1.0}], sync_steps=20,
                                                   round_mode="decoupled", overlap_threshold=0.0)))
    # By hand: a hand-off every 20 s from t = 20 to 3600, each 20 steps; the exchange overlaps
    # the next 20 steps, so no island ever idles: every token enters.
    assert report.rounds == report.committed == 180 and report.failed_rounds == 0
    assert report.goodput == pytest.approx(1.0)
    # The first contribution started from the initial weights, nothing applied before it
    # enters; each later one misses exactly the outer step of the round before it.
    assert sorted(report.staleness) == [0, 0] + [1] * (2 * 179)


@pytest.mark.parametrize("exchange_steps", [2, 0.5], ids=["not-in-yet", "in-by-then"])
def test_decoupled_exchanges_applied_during_the_next_round_are_fresh_and_cost_the_wait(exchange_steps):
    exchange = _fp32_exchange_s(2)
    step_s = exchange / exchange_steps  # the exchange lasts `exchange_steps` inner steps
    report = simulate(scenario_from_dict(_scenario([{"count": 2, "step_s": step_s}], sync_steps=20,
                                                   round_mode="decoupled", overlap_threshold=0.0,
                                                   arrival_steps=1)))
    # By hand: a hand-off every 20 steps; each exchange is applied one step into the next
    # round, so every contribution starts from the outer step before it (none stale), and
    # where the exchange lasts longer than that step (`not-in-yet`: two steps) each island
    # idles one step per round, so every contribution but the first holds 19 steps.
    rounds = math.floor(3600 / (20 * step_s))
    assert report.committed == rounds and sorted(report.staleness) == [0] * (2 * rounds)
    idle = max(0.0, exchange - step_s)
    assert report.islands[0].compute_s == pytest.approx(20 * step_s + (rounds - 1) * (20 * step_s - idle))


def test_decoupled_rounds_wait_for_a_short_exchange_as_a_synchronous_round_does():
    raw = _scenario([{"count": 2, "step_s": 1.0}], sync_steps=20, round_mode="decoupled", overlap_threshold=0.05)
    exchange = _fp32_exchange_s(2)
    assert exchange < 0.05 * 20  # short: waited for
    report = simulate(scenario_from_dict(raw))
    # By hand: a round of 20 s, then the exchange, nothing stale; the first starts at 0.
    rounds = math.floor((3600 - 20) / (20 + exchange)) + 1
    assert report.committed == rounds and report.staleness == [0] * (2 * rounds)
    assert report.utilisation(0) == pytest.approx(rounds * 20 / 3600)


def test_decoupled_member_killed_mid_exchange_costs_only_its_own_work():
    raw = _scenario([{"count": 3, "step_s": 1.0}], sync_steps=20, round_mode="decoupled", exchange_retries=1,
                    overlap_threshold=0.0)
    exchange3 = _fp32_exchange_s(3)
    fail = 40 + exchange3 / 2  # in the middle of the exchange of the hand-off at t = 40
    report = simulate(scenario_from_dict(raw), fail_at=[(2, fail)])
    assert report.failed_rounds == 0
    alive, dead = report.islands[0], report.islands[2]
    assert alive.compute_s == pytest.approx(3600.0)  # every second of the survivors entered
    # The dead island lost the 20 s it handed off at t = 40 (in flight) and the seconds it
    # trained after the hand-off; then 100 s down and a heal of the fp32 weights.
    assert dead.wasted_s == pytest.approx(20.0 + exchange3 / 2)
    assert dead.down_s == 100.0 and dead.heal_s == pytest.approx(4 * PARAMS * 8 / (MBIT * 1e6) + 0.005)


def test_a_thin_link_island_sends_through_a_member_every_few_rounds_and_its_work_enters():
    fast = {"count": 2, "step_s": 1.0, "bandwidth_mbit": 1000.0}
    thin = {"count": 1, "step_s": 1.0, "bandwidth_mbit": 1.0}  # the 3-member exchange: 64 s > a round
    raw = _scenario([fast, thin], hours=2.0, round_pacing="time", round_seconds=30.0, round_mode="decoupled",
                    max_staleness=8)
    from archipelago.federation.simulate_decoupled import DecoupledSimulation

    sim = DecoupledSimulation(scenario_from_dict(raw))
    assert sim.thin == {2}
    # By hand: its row (16-byte header + 4 bytes per value) up and the weights in bf16 down
    # over 1 Mbit/s, plus a latency each way, in whole rounds of 30 s.
    link_s = ((16 + 4 * PARAMS) + 2 * PARAMS) * 8 / 1e6 + 2 * 0.005
    assert sim.cycle[2] == math.ceil(link_s / 30.0) == 2
    report = sim.run()
    assert report.thin == 1 and report.islands[2].tokens > 0
    assert report.utilisation(2) > 0.9 and report.utilisation(0) > 0.98  # nobody waits for the thin link
    synchronous = simulate(scenario_from_dict({**raw, "fault_tolerance": {**raw["fault_tolerance"],
                                                                           "round_mode": "synchronous"}}))
    assert synchronous.utilisation(0) < 0.6  # the same federation, every round waiting for 4 Mbit/s


def test_decoupled_rounds_reach_the_goodput_the_issue_asks_of_the_mixed_speeds_scenario():
    scenario = load_scenario(ROOT / "configs" / "scenarios" / "mixed-speeds.toml")
    synchronous = simulate(scenario).goodput
    ft = replace(scenario.ft, round_mode="decoupled", exchange_retries=1000)
    decoupled = simulate(replace(scenario, ft=ft)).goodput
    assert synchronous < 0.5 and decoupled >= 0.9
