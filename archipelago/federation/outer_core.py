"""The outer step without collectives: the one piece every driver of a federation shares.

The platform (diloco.py: bridge ranks that gather rows over torchft), the quality
simulator (archipelago/quality_simulator.py: islands in lockstep in one process) and the scale
simulator (federation/simulate.py: no tensors, only weights and clocks) all ask this module
the same questions, so they cannot drift apart:

* which fragment a round synchronises (`policy.fragment_of`, the pure rule it applies);
* what weight an island's pseudo-gradient gets: its tokens (or 1), 0 when it sends no
  progress, discounted by its staleness (`contribution_weight`, `staleness_discount`);
* how accepted contributions are combined (`aggregate`: a weighted sum in a fixed order, or
  a trimmed mean), and how a member folds the rows of thin islands it carries into its own
  (`OuterCore.fold`);
* how the global weights move (`OuterCore.apply`: the outer optimizer on sum / divisor)
  and what an island continues from (`OuterCore.island_weights`, `rebased`).

Staleness. In decoupled rounds (`fault_tolerance.round_mode`) an island hands its
pseudo-gradient off and trains on; it enters a later outer step. Its staleness is the number
of outer steps applied between the global weights it started from and the one it enters
(0 in a synchronous round). A stale contribution's weight is multiplied by
(1 + staleness) ^ -`staleness_exponent` (FedAsync's and FedBuff's polynomial rule), and one
staler than `max_staleness` is left out; the sum is still divided by the undiscounted
weights, so a discount shrinks the step instead of cancelling out. The outer optimizer steps
once per outer step over everything that entered it (never once per arriving contribution:
momentum applied per stale arrival is what makes naive asynchronous DiLoCo worse, Liu et al.
2024), and not at all when nothing entered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.fragments import build_outer_optimizer
from archipelago.federation.policy import fragment_of


def staleness_discount(staleness: int, exponent: float, max_staleness: int) -> float:
    """(1 + staleness) ^ -exponent, 0 beyond `max_staleness` (a contribution too old to use)."""
    if staleness < 0:
        raise ValueError(f"staleness {staleness} < 0: a contribution cannot enter before its base")
    if staleness > max_staleness:
        return 0.0
    return 1.0 if staleness == 0 else (1.0 + staleness) ** -exponent


def contribution_weight(weighting: str, tokens: int | float, contributes: bool, accepted: bool = True) -> float:
    """An island's undiscounted weight in the average: its tokens since the fragment's last
    exchange (`tokens`), or 1 (`equal`); 0 when it sends no progress or its own guard (or
    the receivers) refused it."""
    if not contributes or not accepted:
        return 0.0
    return 1.0 if weighting == "equal" else float(tokens)


def aggregate(values: Sequence[torch.Tensor], weights: Sequence[float], trimmed: bool = False) -> torch.Tensor:
    """sum_k w_k * values_k, in list order (every island the same order, so the same bits).

    With `trimmed` and three or more values: per coordinate, the weighted mean of the values
    without that coordinate's largest and smallest one, times sum_k w_k (the outer step
    divides by it): one island's extreme values cannot move the average.
    """
    if not trimmed or len(values) < 3:
        total = torch.zeros_like(values[0])
        for weight, value in zip(weights, values):
            total += weight * value
        return total
    stacked = torch.stack(list(values))
    w = torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device)[:, None].expand_as(stacked)
    order = stacked.argsort(dim=0, stable=True)  # ties: the lower replica rank counts as smaller
    keep = torch.ones_like(stacked, dtype=torch.bool)
    keep.scatter_(0, order[:1], False)
    keep.scatter_(0, order[-1:], False)
    kept = torch.where(keep, w, torch.zeros_like(w))
    return (stacked * kept).sum(dim=0) / kept.sum(dim=0) * sum(weights)


@dataclass
class Carried:
    """A thin island's row as a member carries it into an exchange (`OuterCore.fold`): its
    decoded values, its tokens, and its staleness when that exchange enters."""

    values: torch.Tensor
    tokens: float
    staleness: int


class OuterCore:
    """The global weights of every fragment (flat tensors on CPU) and their outer
    optimizers. No collective, no clock: drivers hand it contributions and apply its
    answers; two drivers that hand it the same values get the same bits."""

    def __init__(self, ft: FaultToleranceConfig, initial: Sequence[torch.Tensor], pin: bool = False) -> None:
        self.ft = ft
        self.globals = [nn.Parameter(_host_copy(t, pin)) for t in initial]
        self.outer = [build_outer_optimizer(ft, g) for g in self.globals]

    @property
    def fragments(self) -> int:
        return len(self.globals)

    def fragment(self, outer_step: int) -> int:
        """The fragment the round after `outer_step` synchronises."""
        return fragment_of(outer_step, self.fragments)

    def discount(self, staleness: int) -> float:
        """This federation's staleness rule (`staleness_exponent`, `max_staleness`)."""
        return staleness_discount(staleness, self.ft.staleness_exponent, self.ft.max_staleness)

    def weight(self, tokens: int | float, contributes: bool, accepted: bool = True,
               staleness: int = 0) -> tuple[float, float]:
        """(weight to sum with, divisor share): the undiscounted weight times the discount,
        and the undiscounted weight itself (0 for both if the discount drops it)."""
        base = contribution_weight(self.ft.outer_weighting, tokens, contributes, accepted)
        factor = self.discount(staleness)
        return (base * factor, base) if factor > 0 else (0.0, 0.0)

    def merge(self, values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        """The weighted sum of accepted pseudo-gradients (trimmed per `outer_aggregation`)."""
        return aggregate(values, weights, self.ft.outer_aggregation == "trimmed_mean")

    def fold(self, own: torch.Tensor, own_tokens: float, staleness: int,
             carried: Sequence[Carried]) -> tuple[torch.Tensor, float]:
        """A member's row with the rows of the thin islands it carries folded in: (values,
        tokens) such that every receiver, weighing the row as usual (`weight(tokens, True,
        staleness=staleness)`), adds exactly the member's own discounted share plus each
        carried row's, the latter discounted by its own staleness, and counts their tokens in
        the divisor. A carried row staler than `max_staleness` is left out (its tokens too),
        and so is everything a row too stale to enter would carry.
        Needs token weighting and the plain mean: under `equal` weighting a folded row would
        count as one island, and a trimmed mean trims per island."""
        if self.ft.outer_weighting != "tokens" or self.ft.outer_aggregation != "mean":
            raise ValueError("carried islands need outer_weighting = \"tokens\" and outer_aggregation = \"mean\": "
                             "their rows travel inside a member's")
        kept = [(c, self.discount(c.staleness)) for c in carried]
        kept = [(c, factor) for c, factor in kept if factor > 0 and c.tokens > 0]
        tokens = float(own_tokens) + sum(float(c.tokens) for c, _ in kept)
        row_factor = self.discount(staleness)
        if not kept or row_factor <= 0:  # nothing to carry, or a row too stale to enter carries nothing in
            return own, float(own_tokens)
        scale = row_factor * tokens  # what each receiver multiplies the folded values by
        values = own.float() * (row_factor * float(own_tokens) / scale)
        for c, factor in kept:
            values += c.values.to(values.device).float() * (factor * float(c.tokens) / scale)
        return values, tokens

    def pseudo_gradient(self, fragment: int, local: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """base - local in fp32 on `local`'s device; the base is the global fragment, or in
        decoupled rounds the global weights the island last took (`base`)."""
        start = self.globals[fragment].detach() if base is None else base
        return start.to(local.device) - local.float()

    @torch.no_grad()
    def apply(self, fragment: int, total: torch.Tensor, divisor: float) -> bool:
        """Step the fragment's global weights with `total / divisor` (divided on the globals'
        device, CPU, by every driver: a GPU divides by multiplying with 1/divisor, which
        rounds differently). Nothing entered (divisor 0): no step, momentum untouched."""
        if divisor <= 0:
            return False
        g = self.globals[fragment]
        g.grad = total.to(g.device) / divisor
        self.outer[fragment].step()
        self.outer[fragment].zero_grad(set_to_none=True)
        return True

    def island_weights(self, fragment: int, local: torch.Tensor | None,
                       held_back: torch.Tensor | None = None) -> torch.Tensor:
        """What an island continues from after a committed outer step: the global fragment,
        or with `fragment_update_alpha` > 0 (and its own `local` fragment) a blend of both,
        or with `topk_keep_residue` the global fragment minus what the island `held_back`
        (its decayed top-k residue, `TopKCodec.release_residue`)."""
        new = self.globals[fragment].detach()
        if local is not None and self.ft.fragment_update_alpha > 0:
            new = new.lerp(local.to(new.device), self.ft.fragment_update_alpha)
        if held_back is not None:
            new = new - held_back.to(new.device)
        return new

    def rebased(self, fragment: int, in_flight: Sequence[torch.Tensor]) -> torch.Tensor:
        """Decoupled rounds: what an island continues from after a hand-off: the global
        weights minus its own pseudo-gradients that have not entered them yet (its progress
        is not set back while its exchange travels; once a contribution enters, its averaged
        share is in the global weights instead, so nothing counts twice)."""
        new = self.globals[fragment].detach().clone()
        for own in in_flight:
            new -= own.to(new.device)
        return new


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = t.detach().to("cpu").clone()
    return copy.pin_memory() if pin else copy
