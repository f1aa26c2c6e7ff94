"""One fault grammar (config/faults.py) for --kill, --inject and ARCHIPELAGO_FAULT."""

from __future__ import annotations

import pytest

from archipelago.config import ConfigError
from archipelago.config.faults import (
    POISON_KINDS,
    TRAINER_KINDS,
    Fault,
    env_value,
    faults_from_env,
    parse_fault,
    parse_faults,
)


def test_every_kind_parses_with_its_unit():
    assert parse_fault("1:kill@2.5") == Fault("kill", 2.5, 1)
    assert parse_fault("1:kill_at_step@16") == Fault("kill_at_step", 16, 1)
    assert parse_fault("crash@7") == Fault("crash", 7)
    assert parse_fault("0:nan-loss@3") == Fault("nan-loss", 3, 0)
    assert parse_fault("scale1000@4") == Fault("scale1000", 4)
    assert str(parse_fault("1:nan@2")) == "1:nan@2"


@pytest.mark.parametrize("text", ["crash@1.5", "nan@0", "kill@-1", "kill_at_step@2.5", "boom@3", "crash@",
                                  "x:crash@3", "crash"])
def test_malformed_faults_name_the_form(text):
    with pytest.raises(ConfigError, match=r"expected \[ISLAND:\]KIND@AT with KIND one of"):
        parse_fault(text)


def test_where_a_fault_is_given_limits_its_kinds_and_island():
    with pytest.raises(ConfigError, match="KIND one of nan, scale1000"):
        parse_fault("crash@3", kinds=POISON_KINDS)
    with pytest.raises(ConfigError):
        parse_fault("nan@3", island=True)  # --inject needs the island
    with pytest.raises(ConfigError):
        parse_fault("1:nan@3", island=False)  # the environment value is one island's already


def test_the_environment_carries_a_list_and_the_rank_filter(monkeypatch):
    faults = parse_faults("crash@7, nan@2,nan-loss@3")
    assert env_value(faults) == "crash@7,nan@2,nan-loss@3"
    monkeypatch.setenv("ARCHIPELAGO_FAULT", env_value(faults))
    assert [f.kind for f in faults_from_env(TRAINER_KINDS, rank=0)] == ["crash", "nan-loss"]
    assert [f.kind for f in faults_from_env(POISON_KINDS)] == ["nan"]
    monkeypatch.setenv("ARCHIPELAGO_FAULT_RANK", "1")
    assert faults_from_env(TRAINER_KINDS, rank=0) == []
    assert len(faults_from_env(TRAINER_KINDS, rank=1)) == 2


def test_die_in_exchange_is_an_outer_loop_fault_that_archipelago_local_injects(monkeypatch):
    from archipelago.config.faults import OUTER_KINDS
    from archipelago.federation.guard import poisons_from_env
    from archipelago.launch.local import parse_args

    assert parse_fault("2:die_in_exchange@3") == Fault("die_in_exchange", 3, 2)
    with pytest.raises(ConfigError, match="outer steps count from 1"):
        parse_fault("die_in_exchange@0")
    assert "die_in_exchange" in OUTER_KINDS and "die_in_exchange" not in POISON_KINDS + TRAINER_KINDS
    opts = parse_args(["--islands", "1,1,1", "--inject", "2:die_in_exchange@3"])
    assert opts.injections == {2: [Fault("die_in_exchange", 3, 2)]}
    monkeypatch.setenv("ARCHIPELAGO_FAULT", env_value(opts.injections[2]))
    assert [(p.kind, p.round) for p in poisons_from_env()] == [("die_in_exchange", 3)]
