"""The outer loop's decoupled rounds (`fault_tolerance.round_mode = "decoupled"`,
docs/rounds.md): at a round's end, finish the exchange that overlapped the round just
trained (or, with `arrival_steps`, that many inner steps into it), hand off the new
pseudo-gradient and train on; once the rows of a two-phase exchange are in (or halfway
through the round where the wire cannot tell), judge them and start its second phase.

`Handoffs` (decoupled.py) holds the island's base weights and the decisions every island
shares; this part drives them from the outer loop (diloco.OuterLoop, the `DecoupledHost`
here), which runs the exchanges themselves.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol

import torch
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.attempts import ExchangeAttempts, Pending
from archipelago.federation.codecs import Codec
from archipelago.federation.decoupled import Handoffs
from archipelago.federation.island_ranks import IslandRanks
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outer_core import OuterCore
from archipelago.federation.round_book import OuterReport, RoundBook
from archipelago.federation.sums import start_sums

log = logging.getLogger("archipelago.federation")


class DecoupledHost(Protocol):
    """What decoupled rounds read of the outer loop, and ask of it."""

    ft: FaultToleranceConfig
    ranks: IslandRanks
    manager: Any
    pending: Pending | None
    layouts: list[FlatLayout]
    attempts: ExchangeAttempts
    book: RoundBook
    is_bridge: bool
    per_fragment: int
    local_step: int
    inner_step: int

    @property
    def core(self) -> OuterCore | None: ...

    @property
    def codecs(self) -> list[Codec]: ...

    @property
    def globals(self) -> list[nn.Parameter]: ...


    def prepare(self, joining: bool = False, need: int = 1) -> bool: ...

    def perform(self, inner_step: int, mid_round: bool = False) -> OuterReport: ...


class DecoupledRounds:
    """One island's decoupled rounds, driven by its outer loop (see module doc)."""

    def __init__(self, host: DecoupledHost) -> None:
        self.host = host
        self.handoffs = Handoffs(host.ft.overlap_threshold, host.ft.arrival_steps)
        self.early_reports: list[OuterReport] = []  # a round end that finished two exchanges: the first
        self.applied = False      # the last exchange settled applied an outer step (every rank alike)
        self.took_global = False  # ... and its overlapped island took the global weights (healed or refused)
        self.advised = False      # arrival_steps was too short once already (warned)

    def round_end(self, inner_step: int) -> OuterReport | None:
        """Finish the exchange that overlapped this round (its outer step), hand off this
        round's pseudo-gradient, then wait for it or, when the members agreed that
        exchanges overlap, train on from the global weights minus it."""
        h = self.host
        earlier = h.perform(inner_step) if h.pending is not None else None
        h.prepare()
        p = h.pending
        assert p is not None
        if self.handoffs.overlaps and p.exchanged:
            self.hand_off(p)
            if earlier is None:  # the first overlapped hand-off: no report, but a new round all the same
                h.book.start_clock()
            return earlier
        if earlier is not None:
            self.early_reports.append(earlier)
        return h.perform(inner_step)

    def hand_off(self, p: Pending) -> None:
        """The island trains on while `p`'s exchange travels: from the global weights minus
        its own pseudo-gradient in it (OuterCore.rebased; the global weights alone when it
        sends nothing), which become its base."""
        h = self.host
        p.overlapped = True
        two_phase = p.gathered is not None and p.gathered.segments is not None  # bridge ranks know it
        p.midway = h.ranks.max([float(two_phase)])[0] > 0
        values = p.own_values()
        own = [values] if values is not None and p.weight > 0 else []
        new = h.core.rebased(p.fragment, own) if h.core is not None else None
        h.layouts[p.fragment].scatter(new)
        if new is not None:
            self.handoffs.rebase(p.fragment, new)

    def arrival_due(self) -> bool:
        """`arrival_steps` inner steps into a round whose exchange overlaps it: apply it now?
        (Every rank counts the same steps: no collective.)"""
        h = self.host
        p = h.pending
        return bool(h.ft.arrival_steps) and p is not None and p.overlapped and h.local_step == h.ft.arrival_steps

    def arrive(self, inner_step: int) -> None:
        """Apply the overlapped exchange now (waiting for it if it is not in yet) and move the
        island to the new global weights plus its progress since the hand-off, so its next row
        starts from this outer step. Its report goes out with the round's (`early_reports`)."""
        h = self.host
        assert h.pending is not None
        fragment = h.pending.fragment
        self.applied = self.took_global = False
        report = h.perform(inner_step, mid_round=True)
        self.early_reports.append(report)
        self.advise(report)
        if self.applied and not self.took_global:
            local = h.layouts[fragment].gather()  # a collective over the island's ranks
            new = base = None
            if local is not None and h.core is not None:  # bridge ranks
                base = h.core.rebased(fragment, [])  # the new global weights: the next row's base
                # In place on the gathered copy: (local - old base) + new base, with no
                # model-sized temporaries beside the copy and the new base.
                new = local.to(base.device).sub_(self.handoffs.base[fragment]).add_(base)
            h.layouts[fragment].scatter(new)
            if base is not None:
                self.handoffs.rebase(fragment, base)  # the next row: all progress since the hand-off
        h.book.blocked()  # time pacing: the wait is not an inner step's length

    def advise(self, report: OuterReport) -> None:
        """An exchange not in by `arrival_steps` kept the island waiting: say by how much, and
        the setting that would have covered it (the quality measured stays within 1% up to
        about a third of a round: docs/rounds.md)."""
        step_s = report.compute_s / report.inner_steps if report.inner_steps else 0.0
        if step_s <= 0 or report.exposed_s < step_s:
            return
        waited = math.ceil(report.exposed_s / step_s)  # in inner steps
        say, self.advised = (log.info if self.advised else log.warning), True  # warned once, then logged
        say("outer step %d: its exchange was not in %d inner steps into the round; the island waited "
            "%.2f s for it (about %d steps). fault_tolerance.arrival_steps = %d would have covered it",
            report.outer_step, self.host.ft.arrival_steps, report.exposed_s, waited,
            self.host.ft.arrival_steps + waited)

    def finish(self, inner_step: int) -> OuterReport | None:
        """At the end of the run (every island at the same round end): the exchange still in
        flight enters, and the island takes the global weights."""
        h = self.host
        if h.pending is None or not h.pending.overlapped:
            return None
        fragment = h.pending.fragment
        report = h.perform(inner_step)
        self.take_global(fragment)
        return report

    def take_global(self, fragment: int) -> None:
        """The island continues from the global weights, nothing in flight."""
        h = self.host
        new = h.globals[fragment].detach() if h.is_bridge else None
        h.layouts[fragment].scatter(new)
        if new is not None:
            self.handoffs.rebase(fragment, new)

    def join_overlapping(self) -> None:
        """When exchanges overlap, the members start their next exchange at the round end
        that let this island in, so it starts one too, sending nothing, and finishes it at
        its first round end as they do (it stays in step with them)."""
        h = self.host
        if not self.handoffs.overlaps:
            return
        if h.prepare(joining=True) and h.pending is not None and h.pending.exchanged:
            self.hand_off(h.pending)
        elif h.pending is not None:
            h.perform(h.inner_step)

    def settle(self, p: Pending, applied: bool) -> None:
        """Every island's decisions from the members' agreement facts (the bridge ranks hold
        them; combined over the island, so all ranks decide alike)."""
        h = self.host
        overlapped, overlaps = self.handoffs.decide(p.facts) if h.is_bridge else (False, False)
        shared = h.ranks.max([float(overlapped), float(overlaps)])
        self.handoffs.settle(shared[0] > 0, shared[1] > 0, applied)
        self.applied = applied

    def after_overlapped(self, p: Pending, own: torch.Tensor | None, committed: bool) -> None:
        """An overlapped exchange finished: its outer step is in the global weights, the
        island's weights moved on. Lost, its row (`own`: the island's own pseudo-gradient in
        it) is sent again with the next one; refused by the receivers, the island takes the
        global weights and its next row is void (it was trained from the refused one)."""
        if not committed and own is not None and p.weight > 0:
            self.handoffs.lost(p.fragment, own)
        if p.reset and p.weight > 0:
            self.take_global(p.fragment)
            self.handoffs.sends_nothing = True
            self.took_global = True

    def midway_due(self) -> bool:
        """A two-phase exchange (the reduce-scatter) in flight: judge its rows and start its
        second phase now? As soon as the first phase's rows are in on every bridge rank of
        the island (the transport's thread stamps that; over a multi-rank island one tiny
        all-reduce per inner step while it waits), so the second phase has the rest of the
        round and both are hidden when together they fit in one. Rows not in by the round's
        end are waited for there. A wire that stamps nothing (NCCL's future completes when the
        collective is enqueued) judges halfway through the round instead (in inner steps;
        under time pacing in seconds), waiting there for the rows: each phase then has half a
        round (they move about the same bytes)."""
        h = self.host
        p = h.pending
        if p is None or not p.midway or p.judged is not None:
            return False
        gathered = p.gathered
        out = gathered is not None and not gathered.done_at  # not in yet on this rank
        blind = gathered is not None and not gathered.stamped  # ... and nothing will say so
        out_anywhere, blind_anywhere = h.ranks.max([float(out), float(blind)])
        if not out_anywhere:
            return True
        if not blind_anywhere:
            return False
        if h.ft.round_pacing != "time":
            return h.local_step == max(1, h.per_fragment // 2)
        return h.book.half_elapsed()

    def judge_midway(self) -> None:
        """Judge the rows of the exchange in flight (waiting for the first phase if it is not
        in yet: halfway through a round on a wire that cannot tell) and start its second
        phase; the round's end then waits only for that."""
        h = self.host
        p = h.pending
        assert p is not None
        began = time.perf_counter()
        h.attempts.judge_rows(p)
        assert p.judged is not None
        if p.gathered is not None and p.gathered.segments is not None and p.buffer is not None:
            # (another bridge rank's chunk may have taken the reduce-scatter and this one not)
            start_sums(p.gathered, h.codecs[p.fragment], p.judged.weights, h.manager, p.buffer.device,
                       h.ft.outer_aggregation == "trimmed_mean")
        p.midway_s = time.perf_counter() - began
        h.book.blocked()  # time pacing: the block is not an inner step's length
        log.info("outer step %d: rows judged at inner step %d of the round (%.2f s blocked); the second phase "
                 "travels while the island trains", p.outer_step + 1, h.local_step, p.midway_s)
