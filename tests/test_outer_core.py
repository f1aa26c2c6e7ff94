"""The outer-step core (federation/outer_core.py) against hand computations, and the quality
simulator's decoupled rounds driven through it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.outer_core import Carried, OuterCore, staleness_discount
from archipelago.federation.policy import fragment_of


def test_staleness_discount_is_the_polynomial_rule_with_a_cut_off():
    assert staleness_discount(0, 0.5, 4) == 1.0
    assert staleness_discount(1, 0.5, 4) == pytest.approx(1 / math.sqrt(2))
    assert staleness_discount(3, 1.0, 4) == pytest.approx(0.25)
    assert staleness_discount(4, 0.5, 4) == pytest.approx(5 ** -0.5)
    assert staleness_discount(5, 0.5, 4) == 0.0      # too stale: left out
    assert staleness_discount(7, 0.0, 8) == 1.0      # exponent 0: no discount
    with pytest.raises(ValueError, match="cannot enter before its base"):
        staleness_discount(-1, 0.5, 4)


def test_a_stale_update_enters_with_the_weight_and_correction_computed_by_hand():
    ft = FaultToleranceConfig(outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True, staleness_exponent=0.5,
                              max_staleness=4)
    start = torch.tensor([1.0, -2.0, 0.5, 3.0])
    core = OuterCore(ft, [start])
    fresh, stale = torch.tensor([0.1, 0.2, -0.3, 0.4]), torch.tensor([-0.5, 0.25, 0.125, 1.0])
    w_fresh, d_fresh = core.weight(100, contributes=True)
    w_stale, d_stale = core.weight(300, contributes=True, staleness=3)
    assert (w_fresh, d_fresh) == (100.0, 100.0)
    assert (w_stale, d_stale) == (pytest.approx(300 * 4 ** -0.5), 300.0)  # (1 + 3)^-0.5 = 0.5
    assert core.apply(0, core.merge([fresh, stale], [w_fresh, w_stale]), d_fresh + d_stale)
    # By hand, in float64: the mean divides by the undiscounted tokens (400), so the discount
    # shrinks the stale island's share (150 of 400, not 300 of 400); Nesterov's first step
    # from a zero buffer moves by lr x (1 + momentum) x the mean.
    mean = (100 * fresh.double() + 150 * stale.double()) / 400
    expected = start.double() - 0.7 * (1 + 0.9) * mean
    assert torch.allclose(core.globals[0].detach().double(), expected, rtol=0, atol=1e-6)


def test_too_stale_or_refused_or_not_contributing_weighs_nothing_everywhere():
    core = OuterCore(FaultToleranceConfig(max_staleness=2), [torch.zeros(3)])
    assert core.weight(500, True, staleness=3) == (0.0, 0.0)
    assert core.weight(500, True, accepted=False, staleness=0) == (0.0, 0.0)
    assert core.weight(500, False) == (0.0, 0.0)
    equal = OuterCore(FaultToleranceConfig(outer_weighting="equal"), [torch.zeros(3)])
    assert equal.weight(500, True) == (1.0, 1.0)


def test_nothing_entered_means_no_outer_step_and_momentum_untouched():
    ft = FaultToleranceConfig(outer_lr=0.7, outer_momentum=0.9)
    core = OuterCore(ft, [torch.ones(4)])
    core.apply(0, torch.full((4,), 0.5), 1.0)
    weights, buffer = core.globals[0].detach().clone(), core.outer[0].state[core.globals[0]]["momentum_buffer"].clone()
    assert not core.apply(0, torch.zeros(4), 0.0)  # Nesterov would still move by momentum x buffer
    assert torch.equal(core.globals[0].detach(), weights)
    assert torch.equal(core.outer[0].state[core.globals[0]]["momentum_buffer"], buffer)


def test_a_carried_row_folded_into_a_members_enters_as_if_sent_alone():
    # A thin island's row travels inside a member's (docs/rounds.md, thin links): every
    # receiver weighs the folded row as any row, so what it adds to the sum and the divisor
    # must be the two rows' own discounted shares, computed here by hand in float64.
    ft = FaultToleranceConfig(staleness_exponent=0.5, max_staleness=4)
    core = OuterCore(ft, [torch.zeros(3)])
    own, thin, too_old = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([4.0, 0.0, -1.0]), torch.ones(3)
    values, tokens = core.fold(own, 300, 1, [Carried(thin, 100, 3), Carried(too_old, 50, 5)])
    assert tokens == 400  # the too-stale row's tokens stay out of the divisor
    weight, divisor = core.weight(tokens, True, staleness=1)
    assert divisor == 400
    expected = (300 * 2 ** -0.5 * own.double() + 100 * 4 ** -0.5 * thin.double())
    assert torch.allclose((weight * values).double(), expected, rtol=1e-6)
    # Nothing to carry, or a carrying row too stale to enter itself: the member's row as it is.
    assert core.fold(own, 300, 1, [Carried(too_old, 50, 5)]) == (own, 300.0)
    assert core.fold(own, 300, 5, [Carried(thin, 100, 1)]) == (own, 300.0)
    # A member that sends nothing of its own (it healed) still carries.
    values, tokens = core.fold(torch.zeros(3), 0, 0, [Carried(thin, 100, 2)])
    assert tokens == 100 and torch.allclose(core.weight(tokens, True)[0] * values, 100 * 3 ** -0.5 * thin)
    for other in (replace(ft, outer_weighting="equal"), replace(ft, outer_aggregation="trimmed_mean")):
        with pytest.raises(ValueError, match="carried islands need"):
            OuterCore(other, [torch.zeros(3)]).fold(own, 300, 0, [Carried(thin, 100, 1)])


def test_fragment_choice_and_decoupled_rebase():
    assert [fragment_of(step, 3) for step in range(5)] == [0, 1, 2, 0, 1]
    core = OuterCore(replace(FaultToleranceConfig(), fragment_update_alpha=0.25), [torch.tensor([4.0, 8.0])])
    local = torch.tensor([0.0, 4.0])
    assert torch.equal(core.island_weights(0, local), torch.tensor([3.0, 7.0]))  # 0.75 global + 0.25 local
    own = torch.tensor([1.0, -1.0])  # its pseudo-gradient still travelling: its progress stays
    assert torch.equal(core.rebased(0, [own]), torch.tensor([3.0, 9.0]))


def _tiny(mode: str, steps: int = 12):  # noqa: ANN202 - a Config
    from conftest import TINY

    from archipelago.config import load_config

    return load_config(["--config", "configs/llama3/federation.toml", *TINY, "--fault_tolerance.enable",
                        "--fault_tolerance.no_average_optimizer_state", "--fault_tolerance.sync_steps", "3",
                        "--training.steps", str(steps), "--training.val_every", "0",
                        "--fault_tolerance.round_mode", mode])


@pytest.mark.slow  # over 30 s on 2 cores: make test-slow (CI runs it)
@pytest.mark.timeout(300)
def test_decoupled_rounds_without_delay_are_the_synchronous_round_bit_for_bit(shakespeare):
    from archipelago.quality_simulator import simulate

    synchronous = simulate(_tiny("synchronous"), islands=2, eval_windows=8)
    undelayed = simulate(_tiny("decoupled"), islands=2, eval_windows=8, handoff_delays=[0, 0])
    for island in range(2):
        ours, theirs = synchronous.models[island].state_dict(), undelayed.models[island].state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert undelayed.staleness == [0] * 8  # 4 rounds x 2 islands, none stale
    delayed = simulate(_tiny("decoupled"), islands=2, eval_windows=8, handoff_delays=[1, 2])
    # Island 0, a member, hands off every round and enters one round later; island 1, thin,
    # uploads every second round to island 0, where its row arrives two rounds later and
    # goes in island 0's next row. By hand over 4 boundaries: boundary 2 takes island 0's
    # first (base step 0, nothing applied yet: 0); boundary 3 its second (base 0 -> 1 step:
    # 1); boundary 4 its third (base 1 -> 2: 1); the end of the run lets in its fourth (base
    # 2 -> 3: 1) with island 1's first folded in (uploaded at boundary 2 from step 0, arrived
    # at 4: 3), and island 1's second (uploaded at 4 from step 1: 2) in a last row of island 0.
    assert delayed.staleness == [0, 1, 1, 1, 3, 2]
    assert not torch.equal(delayed.models[0].state_dict()["norm.weight"],
                           synchronous.models[0].state_dict()["norm.weight"])


class _Stub:
    """An island of the quality simulator without a model: one flat tensor of weights."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.fragments = [[torch.nn.Parameter(weights.clone())]]
        self.codecs: list = []

    def flat(self, fragment: int) -> torch.Tensor:
        return self.fragments[fragment][0].detach().clone()

    def write(self, fragment: int, flat: torch.Tensor) -> None:
        self.fragments[fragment][0].data.copy_(flat)


def test_an_exchange_applied_on_arrival_moves_each_island_to_the_global_weights_plus_its_progress():
    from archipelago.simulated_rounds import Decoupled

    cfg = _tiny("decoupled")
    cfg = replace(cfg, fault_tolerance=replace(cfg.fault_tolerance, codec="fp32", arrival_steps=1))
    g0 = torch.tensor([1.0, 2.0, 3.0])
    islands = [_Stub(g0), _Stub(g0)]
    rounds = Decoupled(cfg, islands, [1, 1])  # sync_steps 3: rows enter 1 step into the next round

    def delta(k: int, step: int) -> torch.Tensor:  # island k's progress at an inner step (exact in fp32)
        return torch.tensor([k + 1.0, float(step), -float(k * step)])

    def step(n: int) -> list[torch.Tensor]:
        for k, island in enumerate(islands):
            island.write(0, island.flat(0) + delta(k, n))
        rounds.after_inner_step([4, 4])
        return [island.flat(0) for island in islands]

    seen = {n: step(n) for n in range(1, 10)}
    progress = [[sum(delta(k, n) for n in range(a, a + 3)) for k in range(2)] for a in (1, 4, 7)]
    g1 = g0 + (progress[0][0] + progress[0][1]) / 2  # equal tokens: the mean of both rows
    g2 = g1 + (progress[1][0] + progress[1][1]) / 2
    for k in range(2):  # one step after each hand-off: the new global weights plus that step
        assert torch.equal(seen[4][k], g1 + delta(k, 4))
        assert torch.equal(seen[7][k], g2 + delta(k, 7))
        assert torch.equal(seen[9][k], g2 + progress[2][k])  # the third row is handed off, in flight
    assert rounds.staleness == [0] * 4  # every row started from the outer step before it
    rounds.finish()
    assert torch.equal(rounds.core.globals[0].detach(), g2 + (progress[2][0] + progress[2][1]) / 2)
    late = replace(cfg, fault_tolerance=replace(cfg.fault_tolerance, arrival_steps=3))
    with pytest.raises(ValueError, match="arrival_steps 3"):  # a round's end is arrival_steps 0
        Decoupled(late, [_Stub(g0), _Stub(g0)], [1, 1])


def test_the_platform_names_every_setting_decoupled_rounds_cannot_run_with():
    from archipelago.config import ConfigError
    from archipelago.federation.decoupled import check_decoupled

    decoupled = FaultToleranceConfig(round_mode="decoupled")
    check_decoupled(decoupled)  # the defaults run
    check_decoupled(replace(decoupled, round_mode="synchronous", num_fragments=4))  # not decoupled: nothing to say
    wrong = replace(decoupled, num_fragments=2, fragment_sync_delay=1, codec="auto", average_optimizer_state=True)
    with pytest.raises(ConfigError) as refused:
        check_decoupled(wrong)
    message = str(refused.value)
    for fix in ("num_fragments = 1", "fragment_sync_delay = 0", "average_optimizer_state = false",
                "a codec other than \"auto\""):
        assert fix in message, message
    assert "fragment_update_alpha" not in message and "adam_federation_batch" not in message  # only what is wrong


def test_arrival_steps_must_fall_inside_the_next_round_of_a_decoupled_federation():
    from archipelago.config.validate import fault_tolerance_problems
    from archipelago.federation.membership import fingerprint, mismatch

    decoupled = FaultToleranceConfig(enable=True, round_mode="decoupled", sync_steps=10)
    assert not fault_tolerance_problems(replace(decoupled, arrival_steps=9))
    late = fault_tolerance_problems(replace(decoupled, arrival_steps=10))
    assert any("arrival_steps = 10" in p and "sync_steps - 1 = 9" in p for p in late), late
    timed = replace(decoupled, round_pacing="time", round_seconds=30.0, min_inner_steps=3, arrival_steps=3)
    assert any("raise min_inner_steps" in p for p in fault_tolerance_problems(timed))
    assert not fault_tolerance_problems(replace(timed, min_inner_steps=4))
    synchronous = fault_tolerance_problems(replace(decoupled, round_mode="synchronous", arrival_steps=2))
    assert any("only decoupled rounds" in p for p in synchronous), synchronous
    # Every island must apply the exchanges alike (the rows' staleness follows): the join compares it.
    prints = [fingerprint("llama3", [("w", (2, 2))], replace(decoupled, arrival_steps=n), 1, 512) for n in (0, 2)]
    assert mismatch(prints[0], prints[1]) is not None and "applied 2 steps in" in prints[1]["pacing"]


def test_an_exchange_not_in_by_arrival_steps_names_the_setting_that_covers_it(caplog):
    from types import SimpleNamespace

    from archipelago.federation.decoupled_rounds import DecoupledRounds
    from archipelago.federation.round_book import OuterReport

    caplog.set_level("INFO", logger="archipelago.federation")
    host = SimpleNamespace(ft=FaultToleranceConfig(round_mode="decoupled", sync_steps=20, arrival_steps=4))
    rounds = DecoupledRounds(host)  # type: ignore[arg-type]
    step = OuterReport(step=24, outer_step=3, committed=True, inner_steps=20, compute_s=10.0)  # 0.5 s a step
    rounds.advise(step)  # nothing waited for
    assert not caplog.records
    step.exposed_s = 1.2  # 2.4 steps: 3 more would have covered it
    rounds.advise(step)
    assert caplog.records[-1].levelname == "WARNING"
    assert "waited 1.20 s for it (about 3 steps)" in caplog.text and "arrival_steps = 7 would" in caplog.text
    rounds.advise(step)  # once warned, then only logged
    assert caplog.records[-1].levelname == "INFO"
