"""Every receiver's verdict on every island's row of an exchange, for the whole island.

An island's bridge ranks each hold a table of what every row of their chunk claims and
holds (exchange.inspect_gather); the island combines them in one sum over its ranks (the
claims as bridge rank 0 read them, every chunk's frame and finiteness flags and sums of
squares), adds what each island declared at the join (rank 0's fingerprint table) and
judges each row with policy.judge_contributions: signature, claims, finiteness, an
absolute norm bound, the others' median. Every island judges the same bytes with the
same facts, so every island reaches the same verdicts; a refused row gets weight 0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation import exchange as rows
from archipelago.federation.policy import (
    FRAME_DISPUTED,
    FRAME_MALFORMED,
    FRAME_OK,
    FRAME_UNSIGNED,
    Allowance,
    Contribution,
    agreed_inner_lr,
    bounded_batches,
    capped_shares,
    judge_contributions,
    norm_allowance,
    steps_between_exchanges,
)
from archipelago.federation.quorum import Quorum

log = logging.getLogger("archipelago.federation")

FACTS = 12  # per row: tokens, weight, island, unsigned, malformed, nonfinite, sumsq, declared x3, odd, disputed


@dataclass
class RowVerdicts:
    """The island's verdicts on one exchange's rows, by replica rank."""

    weights: list[float]                 # to sum with (0 for a refused row)
    tokens: float                        # the accepted rows' tokens
    refused: list[dict[str, Any]] = field(default_factory=list)  # {island, reason} per refused row
    own_refused: str | None = None       # why this island's own row was refused, if it was


class RowJudge:
    """Judges the rows of an island's exchanges. `island_sums` sums values over the
    island's ranks (every rank calls `judge` with its own table: a collective)."""

    def __init__(self, ft: FaultToleranceConfig, quorum: Quorum, rank: int, fragments: int,
                 island_sums: Callable[[list[float]], list[float]]) -> None:
        self.ft, self.quorum, self.rank, self.fragments, self.island_sums = ft, quorum, rank, fragments, island_sums

    def judge(self, table: torch.Tensor, numel: int, global_sumsq: float, step: int,
              own: int | None) -> RowVerdicts:
        """The verdicts on the rows of `table` (this rank's, [participants, COLUMNS]), for a
        fragment of `numel` values whose global weights' sum of squares on this rank is
        `global_sumsq`; `own` is this island's replica rank, `step` the outer step (logs)."""
        facts, total_sumsq = self._island_facts(table, global_sumsq)
        ft = self.ft
        steps = steps_between_exchanges(ft.round_pacing, ft.sync_steps, ft.max_inner_steps, self.fragments)
        global_norm = math.sqrt(total_sumsq)
        contributions, allowances, islands = [], [], []
        # What islands declared at the join, each held to declared_limit x the others' median.
        per_steps = bounded_batches([row[7] for row in facts], ft.declared_limit)
        lrs = agreed_inner_lr([row[8] for row in facts])  # one liar cannot widen the norm bounds
        for row, per_step, lr in zip(facts, per_steps, lrs):
            tokens, weight, island, unsigned, malformed, nonfinite, sumsq, _, _, declared, odd, disputed = row
            frame = (FRAME_UNSIGNED if unsigned else FRAME_DISPUTED if disputed else FRAME_MALFORMED if malformed
                     else FRAME_OK)
            contributions.append(Contribution(tokens, weight, frame, not nonfinite, math.sqrt(sumsq), not odd))
            allowances.append(Allowance(per_step * steps, norm_allowance(ft.outer_norm_limit, steps, lr, numel,
                                                                          global_norm)))
            # Its id from its join (by replica rank), else what its frame claims (unproven).
            islands.append(int(declared) - 1 if declared > 0 else int(island))
        verdicts = judge_contributions(contributions, allowances, ft.outer_weighting, ft.outer_norm_limit)
        # No accepted row holds more than max_island_share of the round (declarations are
        # unproven: a member could otherwise buy most of the average with a huge batch).
        weights = capped_shares([c.weight if v.accepted else 0.0 for c, v in zip(contributions, verdicts)],
                                ft.max_island_share)
        counted = capped_shares([c.tokens if v.accepted else 0.0 for c, v in zip(contributions, verdicts)],
                                ft.max_island_share)
        judged = RowVerdicts(weights, sum(counted))
        for k, v in enumerate(verdicts):
            if v.accepted:
                continue
            log.warning("refused the pseudo-gradient of island %s at outer step %d: %s", islands[k], step + 1, v.reason)
            judged.refused.append({"island": islands[k], "reason": v.reason})
            if k == own:  # this island's own row: it takes the federation's weights
                judged.own_refused = judged.own_refused or v.reason
        return judged

    def _island_facts(self, table: torch.Tensor, global_sumsq: float) -> tuple[list[list[float]], float]:
        """What the island's ranks know of each row, combined (one sum over the island):
        per row the claims (tokens, weight, island: bridge rank 0's view), the frame and
        finiteness flags and the sum of squares (every bridge chunk's), what the island
        declared at the join (tokens per step, inner lr, island id + 1: rank 0's fingerprint
        table), whether its fingerprint is refused; then the global fragment's sum of squares."""
        n = table.shape[0]
        facts = torch.zeros(n, FACTS, dtype=torch.float64)
        if self.rank == 0:
            facts[:, 0:3] = table[:, [rows.TOKENS, rows.WEIGHT, rows.ISLAND]]
            facts[:, 7:10] = torch.tensor([self.quorum.declared(k) for k in range(n)],
                                          dtype=torch.float64).view(n, 3)
            facts[:, 10] = torch.tensor([float(k in self.quorum.odd_ranks) for k in range(n)], dtype=torch.float64)
        facts[:, 3] = (table[:, rows.FRAME] == FRAME_UNSIGNED).double()
        facts[:, 4] = (table[:, rows.FRAME] == FRAME_MALFORMED).double()
        facts[:, 5] = table[:, rows.NONFINITE]
        facts[:, 6] = table[:, rows.SUMSQ]
        facts[:, 11] = (table[:, rows.FRAME] == FRAME_DISPUTED).double()
        combined = self.island_sums([*facts.flatten().tolist(), global_sumsq])
        return [combined[k * FACTS:(k + 1) * FACTS] for k in range(n)], combined[-1]
