"""The outer loop across islands: DiLoCo, streaming DiLoCo and LocalSGD.

Semantics follow torchft's `DiLoCo` where they overlap (tests/test_federation.py checks it), so that on
homogeneous islands both give the same weights:

* fragment i of n is synchronised every `sync_steps / n` inner steps, in the order
  of the federation's step count (step % n);
* the exchange of a fragment starts `fragment_sync_delay` (tau) steps before it is
  applied, and overlaps those inner steps;
* the pseudo-gradient is (global weights - local weights); the outer optimizer
  (Nesterov SGD by default) steps the global weights with its average;
* `fragment_update_alpha` blends the local weights into the new global ones;
* a round commits only if torchft's `should_commit` agrees; otherwise the island
  restores the last global weights of the fragment and goes on.

What is added to that: the islands agree that the exchange went through on every member
before anyone votes (torchft's vote is one island's), and when a member died or a link
broke in it, the survivors form a new quorum at once and run the exchange again with the
same pseudo-gradient, up to `exchange_retries` times, instead of losing the round
(docs/rounds.md, "When a member dies in the exchange").

What differs, on purpose: the global weights and the outer optimizer live on the
bridge ranks in the canonical flat layout (layout.py), so islands of any size meet
and a healing island can take them from any peer; each island's pseudo-gradient
is sent with a weight (the tokens it trained since the fragment's last exchange, or 1
with outer_weighting = "equal"; 0 for an island that has just healed and holds no
valid local progress, or whose pseudo-gradient the guard refused), and the average divides by
the sum of weights. The weight and the island's token count travel in the header of the
island's row (exchange.py), so weighting costs no extra round trip, and every island
learns how many tokens the whole federation trained. Every island receives every
island's row and judges it before anything of it is summed (policy.judge_contributions:
signature, claims, finiteness, norm bounds): a refused row gets weight 0 on every island.

Rounds end after `sync_steps` inner steps (round_pacing = "steps"), or after
`round_seconds` of wall-clock time, each island running as many inner steps as fit
(round_pacing = "time").
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.attempts import ExchangeAttempts, Pending
from archipelago.federation.auto_codec import AutoCodec
from archipelago.federation.carrying import Carrying
from archipelago.federation.codecs import Codec, effective_codec
from archipelago.federation.contribution import Contributions
from archipelago.federation.decoupled_rounds import DecoupledRounds
from archipelago.federation.give_up import finish_announcing
from archipelago.federation.global_weights import GlobalWeights
from archipelago.federation.guard import Poison
from archipelago.federation.healing import Healing
from archipelago.federation.inner_state import InnerStateAverager
from archipelago.federation.island_ranks import IslandRanks
from archipelago.federation.judging import RowJudge
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outcome import RoundOutcome
from archipelago.federation.outer_core import OuterCore
from archipelago.federation.policy import (
    Membership,
    aligned_inner_step,
    must_wait,
    part_in_round,
)
from archipelago.federation.quorum import Quorum
from archipelago.federation.round_book import OuterReport, RoundBook
from archipelago.federation.trust import FederationKey, share_member_signer

log = logging.getLogger("archipelago.federation")

class OuterLoop:
    """Runs the outer synchronisation after each inner optimizer step (see module doc)."""

    def __init__(self, ft: FaultToleranceConfig, fragments: list[list[nn.Parameter]], rank: int,
                 world_size: int, manager: Any, fingerprint: dict[str, Any],
                 group: dist.ProcessGroup | None = None, poisons: list[Poison] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, key: FederationKey | None = None,
                 tokens_per_step: int = 0) -> None:
        self.ft, self.rank, self.world_size, self.group = ft, rank, world_size, group
        self.ranks = IslandRanks(world_size, group)  # the island's own small collectives
        self.key = key  # signs this island's rows and checks the others' (None: plain rows)
        # The island's own signing key (rank 0's, on every rank): evidence of what it sent (receipts.py).
        self.signer = share_member_signer(key, ft.replica_id, self.ranks.sums, rank)
        self.manager, self.fingerprint = manager, fingerprint  # torchft Manager on bridge ranks, else None
        self.per_fragment = ft.sync_steps // len(fragments)
        self.delay = ft.fragment_sync_delay
        self.layouts = [FlatLayout(params, ft.sync_width, rank, world_size, group) for params in fragments]
        self.is_bridge = self.layouts[0].is_bridge
        if ft.average_optimizer_state and optimizer is None:
            raise ValueError("average_optimizer_state needs the island's inner optimizer")
        self.inner_state = (InnerStateAverager(optimizer, fragments, self.layouts, ft.moments_dtype)
                            if ft.average_optimizer_state and optimizer is not None else None)
        # adam_federation_batch: the inner AdamW normalises by the federation's batch, N times its own.
        self.scaled_optimizer = optimizer if ft.adam_federation_batch else None
        if self.is_bridge != (manager is not None):
            raise ValueError("bridge ranks (and only they) need a torchft Manager")
        self.numel = sum(layout.numel for layout in self.layouts)
        self.local_step = 0       # inner steps since the last round ended
        self.outer_step = 0       # the federation's step count (torchft's manager step)
        self.pending: Pending | None = None
        self.inner_step = 0       # the trainer's step count, sent to healing peers
        self.healed = False       # the last quorum sent this island the global state
        self.leads = True         # this island is the lowest live one (checkpoint.scope = "leader")
        self.peer_inner_step = 0  # the step count of the peer this island last healed from
        self.peer_delay = self.delay  # inner steps that peer trains between its state and its commit
        self.quorum = Quorum(ft, manager, key, rank)  # entering each quorum; the members' fingerprints
        self.judge = RowJudge(ft, self.quorum, rank, len(fragments), self.ranks.sums)
        self.attempts = ExchangeAttempts(self)  # the round's exchange, attempt by attempt
        self.weights = GlobalWeights(ft)  # bridge ranks: the global chunks, outer optimizers, codecs
        self.codec_name = effective_codec(ft)
        self.auto = AutoCodec(ft, manager, key, self.per_fragment,  # codec = "auto": the measured link
                              self.inner_state.row_bytes_per_value if self.inner_state is not None else 0)
        self.healing = Healing(self)  # a peer's state, held until the members vouch for it
        self.established = False     # this process committed a round (policy.reference_fingerprint)
        self.last_committed = False  # its last round committed ("current" in its state claim)
        self.contributions = Contributions(self, poisons)  # the round's pseudo-gradient, checked and weighted
        self.guard = self.contributions.guard
        # fault_tolerance.carries: a thin island's rows ride in this island's (its bridge rank serves it)
        self.carrying = (Carrying(ft, key, self.numel, tokens_per_step, float(fingerprint.get("inner_lr", 0.0)))
                         if ft.carries >= 0 and self.is_bridge else None)
        self.book = RoundBook(ft, len(fragments), self.ranks.max)  # the round in progress, its record
        self.federation_tokens = 0        # tokens the whole federation trained (at the last outer step)
        self.tokens_ratio = float(ft.group_size)  # federation tokens per own token, last round
        self.outcome = RoundOutcome(self)  # the vote, the outer step, the counts and the record
        self.outcome.scale_inner_batch()
        # Decoupled rounds (decoupled.py): the base weights and the decisions every island shares.
        self.decoupled = DecoupledRounds(self) if ft.round_mode == "decoupled" else None
        self.handoffs = self.decoupled.handoffs if self.decoupled is not None else None
        self.save_global()  # collective: the initial weights are the first global weights
        if not ft.init_sync:  # islands start from their own weights: peers check they are the same
            self.fingerprint = dict(fingerprint, start=f"own weights {self.global_hash()}")  # collective
        if manager is not None:
            self.healing.register()

    # ---- public --------------------------------------------------------------------

    @property
    def core(self) -> OuterCore | None:
        """The global weights and their outer optimizers (bridge ranks; None elsewhere)."""
        return self.weights.core

    @property
    def codecs(self) -> list[Codec]:
        """The codec of each fragment's rows (bridge ranks)."""
        return self.weights.codecs

    @property
    def globals(self) -> list[nn.Parameter]:
        """The global weights of this bridge rank's chunks, one per fragment (none elsewhere)."""
        return self.weights.globals

    @property
    def outer(self) -> list[torch.optim.Optimizer]:
        """Their outer optimizers."""
        return self.weights.outer

    @property
    def exchange_pending(self) -> bool:
        """An exchange is in flight: the island's state cannot be checkpointed now. (A
        decoupled round's overlapped exchange can: the global weights are not touched until
        it is finished, and a resumed island's base is the global weights, so its next row
        sends the progress of the lost one again.)"""
        return self.pending is not None and not self.pending.overlapped

    def after_inner_step(self, inner_step: int, tokens: int = 0, compute_s: float = 0.0) -> OuterReport | None:
        """Call after every inner optimizer step (on every rank) with the island's tokens
        of that step and its compute seconds; returns a report when a round ends."""
        self.local_step += 1
        self.inner_step = inner_step
        self.book.count_step(tokens, compute_s)
        if self.decoupled is not None and self.decoupled.midway_due():
            self.decoupled.judge_midway()
        if self.decoupled is not None and self.decoupled.arrival_due():  # never a round's end (validate)
            self.decoupled.arrive(inner_step)
        if self.ft.round_pacing == "time":
            if not self.book.time_is_up(self.local_step):
                return None
        else:
            if self.decoupled is None and self.local_step == self.per_fragment - self.delay:
                self.prepare()
            if self.local_step < self.per_fragment:
                return None
        self.local_step = 0
        if self.decoupled is not None:
            return self.decoupled.round_end(inner_step)
        if self.pending is None:  # time pacing: the exchange starts at the round's end
            self.prepare()
        return self.perform(inner_step)

    def finish_rounds(self, inner_step: int) -> OuterReport | None:
        """Decoupled rounds, at the end of the run: the exchange still in flight enters, and
        the island takes the global weights (DecoupledRounds.finish)."""
        return self.decoupled.finish(inner_step) if self.decoupled is not None else None

    @property
    def early_reports(self) -> list[OuterReport]:
        """Decoupled rounds: the first report of a round end that finished two exchanges."""
        return self.decoupled.early_reports if self.decoupled is not None else []

    def add_untimed(self, seconds: float) -> None:
        """Count evaluation or checkpoint seconds of this round (reported as `untimed_s`)."""
        self.book.add_untimed(seconds)

    def federation_tokens_estimate(self) -> float:
        """Tokens the whole federation has trained by now: the count at the last outer
        step plus this island's tokens since, scaled by last round's federation/own ratio."""
        return self.federation_tokens + self.book.tokens * self.tokens_ratio

    def aligned_inner_step(self) -> int:
        """After healing: the inner step of the peer this island healed from. (Decoupled
        rounds that overlap: the members trained a whole round on while the join exchange
        travelled, and this island's join round ended with theirs.)"""
        overlapped = self.handoffs is not None and self.handoffs.overlapped
        return aligned_inner_step(self.peer_inner_step, self.peer_delay + (self.per_fragment if overlapped else 0))

    def save_global(self) -> None:
        """Take the island's current weights as the global weights (a collective)."""
        gathered = [layout.gather() for layout in self.layouts]
        chunks = [c for c in gathered if c is not None]  # all of them on a bridge rank, none elsewhere
        if not self.is_bridge:
            return
        self.weights.take(chunks)
        if self.handoffs is not None:
            self.handoffs.start(self.globals)
        if self.carrying is not None:  # a thin island may download them from now on
            self.carrying.publish(self.outer_step, self.globals[0])

    def global_hash(self) -> str:
        """SHA-256 over the global weights in canonical order (a collective)."""
        digests = self.ranks.gather_objects(self.weights.chunk_digest() if self.is_bridge else None)
        return hashlib.sha256("".join(d for d in digests if d).encode()).hexdigest()[:16]

    def shutdown(self) -> None:
        if self.carrying is not None:
            self.carrying.close()
        if self.manager is not None:
            finish_announcing(self.manager)
            self.manager.shutdown(wait=False)

    # ---- the round -----------------------------------------------------------------

    def join(self, group_size: int, wait_s: float) -> OuterReport:
        """This island's first round: it sends no progress and receives the global state.

        A running federation takes it in at its next round end (the island heals
        from a peer and catches up to its step). A new federation (outer step 0) first
        assembles: the islands wait, up to `wait_s`, until `group_size` of them are in
        one quorum, so that all start together from the same weights.
        """
        deadline = time.monotonic() + wait_s
        while True:
            assembling = time.monotonic() < deadline
            if self.prepare(joining=True, need=group_size if assembling else 1):
                report = self.perform(self.inner_step)
                if report.committed:
                    self.local_step = 0
                    if self.decoupled is not None:
                        self.decoupled.join_overlapping()
                    return report
            time.sleep(0.5)

    def prepare(self, joining: bool = False, need: int = 1) -> bool:
        """Join the quorum (healing if behind) and start averaging one fragment.

        Returns False, having started nothing, when a new federation (outer step 0) has
        fewer than `need` islands in the quorum: every island of that quorum sees the
        same count and waits, so none is left alone in an all-reduce.
        """
        began = time.perf_counter()
        m = self.enter_quorum()
        if must_wait(m, need):
            return False
        self.pending = self.start_round(m, joining)
        self.pending.prepare_s = time.perf_counter() - began
        return True

    def enter_quorum(self, again: bool = False) -> Membership:
        """Join a quorum (a new one with `again`: a retry), healing if behind; the island's view."""
        m = self.healing.settle(self._island_membership(self.healing.membership(self.quorum, again)))
        self.outer_step, self.leads = m.outer_step, m.leads
        return m

    def start_round(self, m: Membership, joining: bool) -> Pending:
        """This round's pseudo-gradient, checked and weighted, with its exchange started."""
        self.healed = m.healed
        if self.healed:
            self.peer_inner_step = m.peer_inner_step
            # A running federation's members train fragment_sync_delay steps between handing
            # out their state and committing; in a new federation's join round every island
            # commits at once (join), so the healed island starts at the peer's own step.
            self.peer_delay = 0 if joining and m.outer_step == 0 else self.delay
        pending, forge = self.contributions.build(part_in_round(m, joining, len(self.layouts)), joining)
        self.attempts.start(pending, m, forge)
        pending.started = time.perf_counter()
        self.contributions.drill_death(pending)  # test-only: this island's row is in flight
        return pending

    def _island_membership(self, mine: Membership) -> Membership:
        """The island's view: the element-wise max of its ranks' views."""
        return Membership.from_values(self.ranks.max(mine.to_values()))

    def perform(self, inner_step: int, mid_round: bool = False) -> OuterReport:
        """Finish the exchange, vote, and step (or restore) the fragment's global weights.
        `mid_round` (decoupled rounds' `arrival_steps`): the round goes on, its clock too."""
        p = self.pending
        assert p is not None, "perform() without prepare()"
        self.pending = None
        blocked_since = time.perf_counter()
        p, tried = self.attempts.until_agreed(p)
        own = p.own_values() if p.overlapped else None  # decoupled: the island's pseudo-gradient in this exchange
        if p.total is not None:  # the agreed sum replaces the pseudo-gradient (freed)
            p.buffer, p.total = p.total, None
        tried.exposed_s = time.perf_counter() - blocked_since + p.midway_s
        result, state_accepted = self.outcome.vote(p)
        if self.codec_name == "auto" and p.buffer is not None and p.exchanged:
            refused_me = any(r.get("island") == self.ft.replica_id for r in tried.refused)
            self.attempts.measure_link(p, carried=result.committed and p.weight > 0 and not refused_me,
                                      decode_s=tried.decode_s)
        self.outcome.apply(p, own, result)
        if p.state is not None and self.inner_state is not None:
            self.inner_state.finish(p.state, apply=result.committed and state_accepted)
        if p.reset:  # a healed island takes every fragment's global weights
            for i, layout in enumerate(self.layouts):
                if i != p.fragment:
                    layout.scatter(self.globals[i].detach() if self.is_bridge else None)
            self.book.forget_fragments()
        self.outcome.count(p, result)
        if self.carrying is not None:  # the thin island's next download; its rows again if lost
            self.carrying.after_round(p.carried, result.committed, self.outer_step, self.globals[0])
        report = self.outcome.report(p, inner_step, result, tried, blocked_since)
        if not mid_round:
            self.book.start_clock()
        return report

    # ---- checkpoint (DCP Stateful) -------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"local_step": self.local_step, "step": self.outer_step,
                                 "federation_tokens": self.federation_tokens, "guard": self.guard.state_tensor()}
        if self.is_bridge:
            state[f"bridge{self.rank}"] = self.weights.state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local_step, self.outer_step = int(state["local_step"]), int(state["step"])
        self.federation_tokens = int(state["federation_tokens"])
        self.guard.load_state_tensor(state["guard"])
        if self.is_bridge:
            self.weights.load(state[f"bridge{self.rank}"])
            if self.handoffs is not None:  # the exchange that was in flight is lost: the next row resends it
                self.handoffs.start(self.globals)
        if self.manager is not None:
            self.manager.load_state_dict({"step": self.outer_step, "batches_committed": 0})
