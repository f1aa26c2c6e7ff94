"""Guards against bad pseudo-gradients: what may not enter the federation's average.

An island checks its own pseudo-gradient before it sends it. Non-finite values, or a
norm above `outer_norm_limit` times the running median of the norms it sent before,
make it send weight 0 for the round: the exchange still completes, the others
average without it, and it takes the new global weights like everyone else.

Every receiver then checks every island's row again (policy.judge_contributions), from
the first round on: an island that skips its own guard, or lies, is refused by the others.

`ARCHIPELAGO_FAULT=KIND@ROUND` (set by `archipelago local --inject ISLAND:KIND@ROUND`, for
tests and demos only; config/faults.py) makes this island misbehave in outer step ROUND,
to show that the checks catch it: `nan` fills its pseudo-gradient with NaN, `scale1000`
multiplies it by 1000 (both are caught by its own guard once it has a history, and by the
receivers before that); the lying kinds skip its own guard and falsify what it sends:
`forge_tokens` claims 10^15 tokens, `forge_weight` a weight of -10^6, `unsigned` signs
with a key outside the federation (only meaningful with a federation key); `equivocate`
sends each peer of an all-gather exchange a different, validly signed row, and `censor`, as
the summer of a reduce-scatter segment, says in its table that every other island's
segment was unsigned (both need a federation key; the members' receipts must refuse the
liar on every island alike: federation/receipts.py); `split_receipt` tells one peer in its
receipt that another's row never arrived and the others the truth (the receipts ride
again in the agreement's flags: every member must see it and fail that attempt).
`die_in_exchange` makes every rank of the island SIGKILL itself right after it handed its
row to that round's exchange (`Poison.die`): the other islands' exchange fails with a
member gone mid-collective, which they survive by re-forming the quorum and running the
exchange again (fault_tolerance.exchange_retries; docs/rounds.md).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass

import torch

from archipelago.config.faults import OUTER_KINDS, faults_from_env
from archipelago.federation.policy import GUARD_HISTORY, judge_pseudo_gradient, remember_norm

# The kinds that lie in what the island sends, not in the values it trained.
FORGE_KINDS = ("forge_tokens", "forge_weight", "unsigned", "equivocate", "censor", "split_receipt")
DIE_IN_EXCHANGE = "die_in_exchange"  # kill the island with its row in flight (config/faults.py)

log = logging.getLogger("archipelago.federation")


@dataclass(frozen=True)
class Poison:
    """A test-only corruption of one round's pseudo-gradient (see module doc)."""

    kind: str
    round: int

    def apply(self, pseudo_gradient: torch.Tensor) -> None:
        """Corrupt the values (the lying kinds leave them alone: exchange.Framing lies)."""
        if self.kind == "nan":
            pseudo_gradient.fill_(float("nan"))
        elif self.kind == "scale1000":
            pseudo_gradient.mul_(1000.0)

    def die(self) -> None:
        """SIGKILL this process now: no clean-up and no goodbye to the lighthouse, as when a
        host crashes. The log line carries the wall-clock time, so a drill can measure how
        long the survivors stalled after it."""
        log.warning("ARCHIPELAGO_FAULT: %s@%d: this island dies now, its exchange in flight (time %.3f)",
                    self.kind, self.round, time.time())
        for handler in logging.getLogger().handlers:  # the line must be out before the process is gone
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def poisons_from_env() -> list[Poison]:
    """This island's poisoned rounds from ARCHIPELAGO_FAULT (the outer loop's kinds)."""
    return [Poison(f.kind, int(f.at)) for f in faults_from_env(OUTER_KINDS)]


class PseudoGradientGuard:
    """Accepts or refuses an island's pseudo-gradient norms, one history per fragment."""

    def __init__(self, limit: float, fragments: int) -> None:
        self.limit = limit
        self.history: list[list[float]] = [[] for _ in range(fragments)]

    def check(self, fragment: int, norm: float) -> str | None:
        """None if the pseudo-gradient may be sent (and remember its norm), else why not."""
        verdict = judge_pseudo_gradient(norm, self.history[fragment], self.limit)
        if verdict.accepted:
            remember_norm(self.history[fragment], norm)
        return verdict.reason

    def state_tensor(self) -> torch.Tensor:
        """The histories as one fixed-shape tensor (NaN-padded): checkpoints need fixed shapes."""
        table = torch.full((len(self.history), GUARD_HISTORY), float("nan"), dtype=torch.float64)
        for row, norms in zip(table, self.history):
            row[:len(norms)] = torch.tensor(norms, dtype=torch.float64)
        return table

    def load_state_tensor(self, table: torch.Tensor) -> None:
        self.history = [[float(v) for v in row if not math.isnan(float(v))] for row in table]
