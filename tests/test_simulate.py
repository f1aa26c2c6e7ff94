"""`archipelago simulate`: rounds, utilisation, failures and scenarios against figures worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from archipelago.config import ConfigError
from archipelago.federation.simulate import load_scenario, scaled, scenario_from_dict, simulate

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
    up to 8 bytes) over its link, plus a latency per hop there and back."""
    row = 16 + 4 * PARAMS
    return (islands - 1) * row * 8 / (MBIT * 1e6) + 2 * (islands - 1) * 0.005


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


def test_a_failure_inside_the_exchange_loses_the_round_for_every_island():
    scenario = scenario_from_dict(_scenario([{"count": 3, "step_s": 1.0}], sync_steps=20))
    exchange = _fp32_exchange_s(3)
    fail = exchange + 20 + exchange / 2  # the middle of round 1's exchange
    report = simulate(scenario, fail_at=[(2, fail)])
    assert report.failed_rounds == 1
    assert all(s.wasted_s == pytest.approx(20.0) for s in report.islands)  # round 1's training, lost


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
