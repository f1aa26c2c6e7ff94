"""Decoupled rounds on the platform: what an island keeps so that it need not wait for its
exchange (`fault_tolerance.round_mode = "decoupled"`, docs/rounds.md).

At a round's end the island hands off its pseudo-gradient (its `base` weights minus its
weights) and, when the round overlaps, trains on at once from the global weights minus that
pseudo-gradient (`OuterCore.rebased`): its own progress is kept while the exchange travels.
At the next round's end the exchange is finished first, its outer step applied to the
global weights (not to the island's weights, which moved on), then the next one is handed
off. A round is waited for instead (the synchronous round, bit for bit) while the members'
exchanges are cheap against a round's compute (`overlap_threshold`).

Everything every island must see alike comes from the members' signed agreement flags
(agreement.agree_on_exchange), never from one island's clock:

* whether the next exchange overlaps: the lower median of the members' measures of their
  last exchange is above `overlap_threshold` of a round's compute seconds (0: always overlap);
* the staleness of an exchange's rows: 1 when the previous exchange was overlapped by more
  than half of the members and applied an outer step at this round's end (their rows were
  taken from weights that step had not reached), else 0; with `arrival_steps` the overlapped exchange is applied
  that many inner steps into the next round, every island moves to the new global weights
  plus its progress since, and the rows are not stale. An island that joined or healed sends
  nothing in that exchange.

This object holds no collective: OuterLoop drives it on its bridge ranks (the tensors are
their chunks of the flat layout) and on every rank (the decisions).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from archipelago.config.errors import ConfigError
from archipelago.config.schema import FaultToleranceConfig

OVERLAP_SCALE = 1e6  # a measured fraction travels in the agreement frame's integer field, in millionths


class Handoffs:
    """One island's decoupled-round state."""

    def __init__(self, threshold: float, arrival_steps: int = 0) -> None:
        self.threshold = threshold
        self.arrival_steps = arrival_steps   # > 0: an overlapped exchange is applied that far into the next round
        self.base: list[torch.Tensor] = []   # per fragment: the weights its next pseudo-gradient starts from
        self.carry: list[torch.Tensor | None] = []  # per fragment: a lost exchange's pseudo-gradient, resent
        self.overlaps = threshold <= 0       # the next exchange overlaps the next round
        self.stale = False                   # the next exchange's rows are one outer step stale
        self.sends_nothing = False           # the receivers refused this island's last row: the next is void
        self.overlapped = False              # some member trained on while the last exchange travelled

    def start(self, weights: Sequence[torch.Tensor]) -> None:
        """The island takes `weights` (the global weights, nothing in flight) as its base."""
        self.base = [w.detach().clone() for w in weights]
        self.carry = [None] * len(self.base)

    def pseudo_gradient(self, fragment: int, local: torch.Tensor, out: torch.Tensor) -> None:
        """out = base - local (+ a lost exchange's pseudo-gradient, sent again)."""
        torch.sub(self.base[fragment].to(out.device, non_blocking=True), local.to(out.device), out=out)
        carried = self.carry[fragment]
        if carried is not None:
            out += carried.to(out.device)
            self.carry[fragment] = None

    def rebase(self, fragment: int, weights: torch.Tensor) -> None:
        """The island continues from `weights`; its next pseudo-gradient starts there."""
        self.base[fragment] = weights.detach().clone()

    def lost(self, fragment: int, own: torch.Tensor) -> None:
        """An overlapped exchange did not commit: the island's weights still hold `own`
        (rebased away from the global weights), so its next row sends it again."""
        self.carry[fragment] = own.detach().to("cpu", copy=True)

    def decide(self, facts: Sequence[tuple[float, float]]) -> tuple[bool, bool]:
        """From every member's agreement facts after an exchange (exchange seconds / round
        compute seconds in OVERLAP_SCALE units; 1 where that member trained on while the
        exchange travelled): (more than half of the members overlapped it, the next exchange
        overlaps: the lower median of the measures taken is above the threshold). No facts
        (the agreement failed): the next exchange keeps this island's decision.

        A pure function of the all-gathered facts, so every island decides alike. Neither
        side can be moved by one member's claim alone (`any` and `max` were: one lying
        member made every island train on while exchanges travel and discounted every row
        as stale); with two islands the lower median is the lower claim, so a liar can only
        keep exchanges waited for and rows undiscounted. A member whose facts are (0, 0)
        (its flag not signed for this round, or nothing measured and nothing overlapped)
        says nothing."""
        told = [(measure, flag) for measure, flag in facts if measure > 0 or flag > 0]
        overlapped = 2 * sum(flag > 0 for _, flag in told) > len(told)
        if self.threshold <= 0 or not facts:
            return overlapped, self.overlaps
        measured = [measure for measure, _ in told if measure > 0]
        return overlapped, bool(measured) and statistics.median_low(measured) / OVERLAP_SCALE > self.threshold

    def settle(self, overlapped: bool, overlaps_next: bool, applied: bool) -> None:
        """What every island of the round decided (`decide`, combined over its ranks), and
        whether the exchange applied an outer step. Applied during the next round
        (`arrival_steps`), every island then moves to its global weights, so the next rows are
        not stale."""
        self.stale = overlapped and applied and not self.arrival_steps
        self.overlapped, self.overlaps = overlapped, overlaps_next


def check_decoupled(ft: FaultToleranceConfig) -> None:
    """The settings decoupled rounds run with on the platform (a ConfigError names the fix)."""
    if ft.round_mode != "decoupled":
        return
    problems = [
        (ft.num_fragments != 1, "num_fragments = 1 (the whole model is handed off at once)"),
        (ft.fragment_sync_delay != 0, "fragment_sync_delay = 0 (the exchange overlaps a whole round instead)"),
        (ft.fragment_update_alpha != 0, "fragment_update_alpha = 0 (the island continues from its rebased weights)"),
        (ft.average_optimizer_state, "average_optimizer_state = false (only pseudo-gradients are handed off)"),
        (ft.adam_federation_batch, "adam_federation_batch = false (only pseudo-gradients are handed off)"),
        (ft.codec == "auto", "a codec other than \"auto\" (its link measurement assumes waited exchanges)"),
    ]
    wrong = [fix for bad, fix in problems if bad]
    if wrong:
        raise ConfigError("fault_tolerance.round_mode = \"decoupled\" needs " + "; ".join(wrong))
