"""This island's contribution to a round: its pseudo-gradient, checked and weighted.

The outer loop (diloco.OuterLoop, the `ContributionHost` here) enters the quorum and hands
the result to the exchange; this part builds it (`Contributions.build`, a `Pending`):

* the pseudo-gradient on bridge ranks: the global weights (in decoupled rounds the
  island's base weights) minus its weights, followed by two slots the exchange sums too,
  the island's tokens and its weight;
* the drills' poison for this outer step (test-only, `ARCHIPELAGO_FAULT`);
* `codec = "auto"`'s choice for the round, before the guard sees the values;
* the guard's check of the pseudo-gradient's norm over the island's ranks (`PseudoGradientGuard`): one bad
  island must not poison the others;
* its weight: its tokens since the fragment's last exchange (or 1), 0 when it sends no
  progress or was refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.attempts import Pending
from archipelago.federation.auto_codec import AutoCodec
from archipelago.federation.carrying import Carrying
from archipelago.federation.codecs import Codec
from archipelago.federation.decoupled import Handoffs
from archipelago.federation.guard import DIE_IN_EXCHANGE, FORGE_KINDS, Poison, PseudoGradientGuard
from archipelago.federation.island_ranks import IslandRanks
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outer_core import OuterCore, contribution_weight
from archipelago.federation.policy import RoundPart, Verdict, skips_exchange
from archipelago.federation.round_book import RoundBook

log = logging.getLogger("archipelago.federation")


class ContributionHost(Protocol):
    """What building a contribution reads of the outer loop."""

    ft: FaultToleranceConfig
    ranks: IslandRanks
    outer_step: int
    layouts: list[FlatLayout]
    handoffs: Handoffs | None
    book: RoundBook
    codec_name: str
    auto: AutoCodec
    carrying: Carrying | None

    @property
    def core(self) -> OuterCore | None: ...

    @property
    def codecs(self) -> list[Codec]: ...

    @property
    def globals(self) -> list[nn.Parameter]: ...



class Contributions:
    """Builds this island's contribution to each round (see module doc)."""

    def __init__(self, host: ContributionHost, poisons: list[Poison] | None = None) -> None:
        self.host = host
        self.poisons = {p.round: p for p in poisons or []}  # test-only: outer step -> poison
        self.guard = PseudoGradientGuard(host.ft.outer_norm_limit, len(host.layouts))

    def build(self, part: RoundPart, joining: bool) -> tuple[Pending, str | None]:
        """The round's `Pending` (its buffer on bridge ranks), and the kind of frame forgery
        a drill asks the exchange for (None: none)."""
        h = self.host
        if h.handoffs is not None and h.handoffs.sends_nothing:  # its last row was refused
            part, h.handoffs.sends_nothing = replace(part, contributes=False), False
        fragment = part.fragment
        local = h.layouts[fragment].gather()
        buffer = self._pseudo_gradient(fragment, local) if local is not None else None  # bridge ranks
        poison = self.poisons.get(h.outer_step + 1)
        corrupt = poison if poison is not None and part.contributes and poison.kind != DIE_IN_EXCHANGE else None
        if buffer is not None and corrupt is not None:
            log.warning("ARCHIPELAGO_FAULT: poisoning this island's pseudo-gradient (%s) in outer step %d",
                        corrupt.kind, h.outer_step + 1)
            corrupt.apply(buffer[:-2])
        tokens, fragment_tokens = h.book.take_tokens(fragment)
        pending = Pending(fragment, reset=part.reset, tokens=tokens, outer_step=h.outer_step, joining=joining,
                          staleness=int(h.handoffs.stale) if h.handoffs is not None else 0)
        pending.exchanged = not skips_exchange(joining, h.outer_step, h.ft.init_sync)
        if pending.exchanged and buffer is not None and h.codec_name == "auto":  # before the guard sees it
            pending.residue = h.auto.choose(h.codecs[fragment], buffer, part.contributes)
        verdict = self._guard(fragment, buffer, pending) if part.contributes else Verdict(True)
        pending.weight = contribution_weight(h.ft.outer_weighting, fragment_tokens, part.contributes,
                                             verdict.accepted)
        if buffer is not None:
            if not pending.weight:  # nothing of this island enters the average
                buffer[:-2].zero_()
            elif h.carrying is not None and pending.exchanged:  # a thin island's rows ride in this one
                self._fold(buffer, pending)
            buffer[-2], buffer[-1] = float(pending.tokens), pending.weight
        pending.buffer = buffer
        return pending, corrupt.kind if corrupt is not None and corrupt.kind in FORGE_KINDS else None

    def _fold(self, buffer: torch.Tensor, pending: Pending) -> None:
        """Fold the thin island's uploads that arrived into this row (carrying.py); the
        island's own pseudo-gradient is kept apart (its weights are rebased on it)."""
        h = self.host
        assert h.carrying is not None and h.core is not None
        own = buffer[:-2].clone()
        values, tokens, uploads = h.carrying.fold(h.core, own, pending.weight, pending.staleness, h.outer_step)
        if not uploads:
            return
        buffer[:-2].copy_(values)
        pending.own, pending.carried = own, uploads
        pending.carried_tokens = int(round(tokens - pending.weight))
        pending.tokens += pending.carried_tokens
        pending.weight = tokens

    def drill_death(self, pending: Pending) -> None:
        """Test-only: an island asked to die in this outer step's exchange dies now, its row
        in flight (`--inject ISLAND:die_in_exchange@K`)."""
        poison = self.poisons.get(pending.outer_step + 1)
        if poison is not None and poison.kind == DIE_IN_EXCHANGE and pending.exchanged:
            poison.die()

    def _guard(self, fragment: int, buffer: torch.Tensor | None, pending: Pending) -> Verdict:
        """One bad island must not poison the others: check the pseudo-gradient before it is sent."""
        h = self.host
        # The island's norm over its bridge chunks; a NaN/inf anywhere makes it non-finite.
        sumsq = 0.0 if buffer is None else float(torch.linalg.vector_norm(buffer[:-2])) ** 2  # a device sync
        pending.norm = math.sqrt(h.ranks.sums([sumsq])[0])
        pending.own_refused = self.guard.check(fragment, pending.norm)
        if pending.own_refused:
            pending.reset = True  # it takes the global weights, like a healed island
            log.warning("refused this island's pseudo-gradient at outer step %d: %s; it sends weight 0 and "
                        "takes the federation's weights", h.outer_step + 1, pending.own_refused)
        return Verdict(pending.own_refused is None, pending.own_refused)

    def _pseudo_gradient(self, fragment: int, local: torch.Tensor) -> torch.Tensor:
        """[global - local ..., tokens, weight], the last two still 0 (build fills them).

        Weighted and summed across islands, the last element is the total weight the
        average divides by, the one before it the tokens the federation trained.

        Built on the island's device, so NCCL can carry it, or on CPU with
        `copy_pseudogradients_to_cpu` (the fragment then crosses PCIe before the exchange
        instead of after it; the global weights live on CPU either way).
        """
        h = self.host
        g = h.globals[fragment].detach()
        device = torch.device("cpu") if h.ft.copy_pseudogradients_to_cpu else local.device
        buffer = torch.zeros(g.numel() + 2, dtype=g.dtype, device=device)
        if h.handoffs is not None:  # decoupled rounds: from the island's own base weights
            h.handoffs.pseudo_gradient(fragment, local, buffer[:-2])
            return buffer
        torch.sub(g.to(device, non_blocking=True), local.to(device), out=buffer[:-2])
        return buffer
