"""A member cannot buy a dominating weight or a wider norm bound with what it declares.

What an island declares at the join (tokens per inner step, inner learning rate) nobody can
check. At ac842c6 `declared_limit = 16` let one island declare 16x the others' batch and
learning rate: it then held 94% of a two-island average and 89% of a three-island one, and
its rows were allowed 16x the others' norm. The receivers now cap one row's share of a
round (`max_island_share`) and bound every island's norm by the lower median of the
declared learning rates.
"""

from __future__ import annotations

import math

import pytest
import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation import exchange as rows
from archipelago.federation.judging import RowJudge

TOKENS_PER_STEP, LR, NUMEL = 64.0, 1e-3, 1000


class _Declared:
    """The quorum's fingerprints as the judge reads them: (tokens per step, inner lr, island + 1)."""

    def __init__(self, declared: list[tuple[float, float]]) -> None:
        self.rows, self.odd_ranks = declared, set()

    def declared(self, rank: int) -> list[float]:
        tokens, lr = self.rows[rank]
        return [tokens, lr, float(rank + 1)]


def _judge(declared: list[tuple[float, float]], claims: list[float], norms: list[float], **ft_overrides):
    """Every island's verdict (one rank, no island sums to make) on rows that claim `claims`
    tokens (and as much weight) with these norms."""
    ft = FaultToleranceConfig(enable=True, sync_steps=10, **ft_overrides)
    judge = RowJudge(ft, _Declared(declared), rank=0, fragments=1, island_sums=lambda values: values)
    table = torch.zeros(len(claims), len(rows.COLUMNS), dtype=torch.float64)
    table[:, rows.TOKENS] = table[:, rows.WEIGHT] = torch.tensor(claims, dtype=torch.float64)
    table[:, rows.SUMSQ] = torch.tensor([n * n for n in norms], dtype=torch.float64)
    table[:, rows.ISLAND] = torch.arange(len(claims), dtype=torch.float64)
    return judge.judge(table, NUMEL, global_sumsq=0.0, step=3, own=0)


@pytest.mark.parametrize("islands", [2, 3])
def test_a_sixteenfold_declaration_buys_at_most_the_stated_share(islands):
    """The attack of the issue: the last island declares 16x the batch (and claims it) within
    declared_limit = 16; at ac842c6 it held 16/17 = 94% (two islands) and 16/18 = 89% (three)
    of the average. Now its weight is at most max_island_share (0.75) of the round."""
    honest = TOKENS_PER_STEP * 10
    declared = [(TOKENS_PER_STEP, LR)] * (islands - 1) + [(16 * TOKENS_PER_STEP, 16 * LR)]
    claims = [honest] * (islands - 1) + [16 * honest]
    verdicts = _judge(declared, claims, norms=[0.01] * islands)
    assert not verdicts.refused  # within every declared bound: accepted, but capped
    share = verdicts.weights[-1] / sum(verdicts.weights)
    assert share == pytest.approx(0.75)
    assert verdicts.weights[:-1] == [honest] * (islands - 1)  # the honest rows keep their weights
    assert verdicts.tokens == pytest.approx(honest * (islands - 1) * 4)  # counted tokens capped alike


def test_islands_of_honest_sizes_up_to_three_to_one_keep_their_weights():
    """A 3-rank island beside a 1-rank one (tokens 3:1): the cap does not bind."""
    declared = [(3 * TOKENS_PER_STEP, LR), (TOKENS_PER_STEP, LR)]
    claims = [3 * TOKENS_PER_STEP * 10, TOKENS_PER_STEP * 10]
    verdicts = _judge(declared, claims, norms=[0.01, 0.01])
    assert verdicts.weights == claims and verdicts.tokens == sum(claims)


def test_a_huge_declared_learning_rate_buys_no_wider_norm_bound():
    """The island declares 16x the inner lr and sends a row 12x larger than the honest bound
    allows: at ac842c6 its allowance grew 16x and the row was accepted."""
    ft = FaultToleranceConfig(enable=True, sync_steps=10)
    honest_bound = ft.outer_norm_limit * 10 * LR * math.sqrt(NUMEL)  # global weights of norm 0
    declared = [(TOKENS_PER_STEP, LR), (TOKENS_PER_STEP, LR), (TOKENS_PER_STEP, 16 * LR)]
    claims = [TOKENS_PER_STEP * 10] * 3
    verdicts = _judge(declared, claims, norms=[0.01, 0.01, 12 * honest_bound], outer_norm_limit=ft.outer_norm_limit)
    assert [r["island"] for r in verdicts.refused] == [2]
    assert "absolute bound" in verdicts.refused[0]["reason"]
    assert verdicts.weights[2] == 0.0


def test_the_share_cap_and_the_learning_rate_bound_as_pure_functions():
    """Against values worked by hand: share s caps a row at s / (1 - s) x the others' sum."""
    from archipelago.federation.policy import agreed_inner_lr, capped_shares

    assert capped_shares([10.0, 10.0, 160.0], 0.75) == [10.0, 10.0, 60.0]
    assert capped_shares([10.0, 160.0], 0.5) == [10.0, 10.0]
    assert capped_shares([10.0, 160.0], 1.0) == [10.0, 160.0]
    assert capped_shares([0.0, 160.0], 0.5) == [0.0, 160.0]  # alone in the round: nothing to outweigh
    assert agreed_inner_lr([1e-3, 1.6e-2]) == [1e-3, 1e-3]  # two islands: the smaller declaration
    assert agreed_inner_lr([1e-3, 2e-3, 1.0]) == [1e-3, 2e-3, 2e-3]
    assert agreed_inner_lr([0.0, 1e-3]) == [0.0, 1e-3]  # an undeclared one stays undeclared


def test_a_share_outside_half_to_one_names_the_fix():
    from archipelago.config.errors import ConfigError
    from archipelago.config.schema import Config
    from archipelago.config.validate import validate

    cfg = Config()
    cfg.fault_tolerance.enable, cfg.fault_tolerance.max_island_share = True, 0.3
    with pytest.raises(ConfigError, match="max_island_share = 0.3: use a share between 0.5"):
        validate(cfg)
