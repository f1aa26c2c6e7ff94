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
valid local progress, or whose update the guard rejected), and the average divides by
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
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.agreement import settle_exchange
from archipelago.federation.auto_codec import AutoCodec
from archipelago.federation.codecs import Codec, build_codec, effective_codec
from archipelago.federation.decoupled import OVERLAP_SCALE, Handoffs
from archipelago.federation.exchange import (
    Framing,
    Gathered,
    empty_table,
    inspect_gather,
    seconds_until_in,
    start_gather,
    wire_device,
)
from archipelago.federation.fragments import load_tensor_state, tensor_state
from archipelago.federation.guard import DIE_IN_EXCHANGE, FORGE_KINDS, Poison, UpdateGuard
from archipelago.federation.healing import Healing, digest
from archipelago.federation.inner_state import InnerStateAverager, StateExchange
from archipelago.federation.judging import RowJudge
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outer_core import OuterCore, contribution_weight, staleness_discount
from archipelago.federation.policy import (
    Membership,
    RoundResult,
    Verdict,
    aligned_inner_step,
    applies_outer_step,
    keeps_pending,
    merges_local,
    must_wait,
    plan_round,
    retries_exchange,
    round_is_up,
    skips_exchange,
)
from archipelago.federation.quorum import Quorum
from archipelago.federation.sums import finish_gather, start_sums
from archipelago.federation.trust import FederationKey

log = logging.getLogger("archipelago.federation")

# Hash the global weights after every round below this size (cheap); larger models
# hash them only at the end of the run (sha256 reads every byte once).
HASH_EVERY_ROUND_MAX_NUMEL = 1 << 26


class FederationError(RuntimeError):
    """The federation cannot go on (e.g. too many rounds in a row failed to commit)."""


@dataclass
class OuterReport:
    """What one synchronisation did; logged as an `outer_step` event."""

    step: int = 0                 # inner step at which the round ended
    outer_step: int = 0           # the federation's step count after this round
    committed: bool = False
    participants: int = 0         # islands in the quorum
    contributors: float = 0.0     # sum of contribution weights (islands that sent progress)
    fragment: int = 0
    healed: bool = False          # this island received the global state from a peer
    bytes_sent: int = 0           # rows this island handed to the cross-island exchange
    sync_s: float = 0.0           # seconds spent blocked in the synchronisation (waiting at the outer step)
    inner_steps: int = 0          # inner steps this island ran in the round
    tokens: int = 0               # tokens this island trained in the round
    compute_s: float = 0.0        # seconds of those inner steps (emulated slowdown included)
    weight: float = 0.0           # this island's weight in the average (0: sent no update)
    federation_tokens: int = 0    # tokens trained by the whole federation, after this round
    norm: float | None = None     # norm of this island's pseudo-gradient (None: not checked)
    rejected: str | None = None   # why this island's update was kept out (its own guard or the receivers)
    refused: list[dict[str, Any]] = field(default_factory=list)  # rows every receiver refused: island, reason
    codec: str = "fp32"
    bytes_received: int = 0       # what this island got back from the other islands' exchange
    encode_s: float = 0.0         # seconds encoding (and signing) this island's row
    decode_s: float = 0.0         # seconds opening, judging and summing the rows
    overlap_s: float = 0.0        # inner-step seconds that ran while the exchange was in flight
    exposed_s: float = 0.0        # seconds the island then still waited for the exchange
    untimed_s: float = 0.0        # seconds of evaluation and checkpointing in the round (busy, not training)
    global_hash: str | None = None
    retries: int = 0              # exchanges of this round run again, with a new quorum, after a member failed
    retry_s: float = 0.0          # seconds from the first failed exchange to the end of the last (mostly: the
                                  # lighthouse dropping the dead member after its heartbeat timeout)
    # Time pacing: the seconds from the round's start at each inner step's end, what
    # round_is_up decided on (this rank's clock), so that a recorded run can be replayed.
    pacing_elapsed_s: list[float] | None = None


@dataclass
class _Pending:
    """An exchange started by `prepare` and finished by `perform`."""

    fragment: int
    buffer: torch.Tensor | None = None
    reset: bool = False      # this island healed (or was rejected): discard its local progress
    prepare_s: float = 0.0   # seconds prepare() blocked (quorum, healing, gather)
    tokens: int = 0          # this island's tokens since the previous exchange
    weight: float = 0.0
    norm: float | None = None
    rejected: str | None = None
    gathered: Gathered | None = None  # the exchange's rows (bridge ranks)
    exchanged: bool = False           # the island takes part in an exchange this round (all ranks)
    participants: int = 0             # islands in the quorum (rows of the exchange)
    replica_rank: int = -1            # this island's row
    state: StateExchange | None = None  # the inner optimizer's moments (average_optimizer_state)
    started: float = 0.0              # perf_counter when the exchange was handed to the network
    waited: float = 0.0               # perf_counter when perform's wait for the rows returned
    residue: torch.Tensor | None = None  # codec = "auto": top-k's residue this dense round carries
    step: int = 0                     # the federation's outer step the round started from
    joining: bool = False             # the island's join round (it sends nothing)
    framing: Framing | None = None    # how this attempt's rows are framed (its quorum's id)
    codec_state: dict[str, torch.Tensor] | None = None  # the codec's state before it encoded (a retry restores it)
    spent: tuple[int, int] = (0, 0)   # (sent, received) bytes of attempts that failed (bridge rank's own)
    total: torch.Tensor | None = None  # the exchange's sum, apart from `buffer` when a retry may resend it
    overlapped: bool = False          # decoupled rounds: the island trains on while this exchange travels
    staleness: int = 0                # decoupled rounds: outer steps its rows' base weights are behind
    facts: list[tuple[float, float]] = field(default_factory=list)  # the members' agreement facts (decoupled)
    midway: bool = False              # decoupled: judged and its second phase started halfway through the round
    judged: Judged | None = None      # the receivers' verdicts on its rows, once judged
    midway_s: float = 0.0             # seconds the island blocked for that, halfway through the round


@dataclass
class _Tried:
    """How the exchange of a round went, for its report (OuterLoop._exchange_until_agreed)."""

    decode_s: float = 0.0
    refused: list[dict[str, Any]] = field(default_factory=list)
    retries: int = 0       # exchanges run again with a new quorum
    retry_s: float = 0.0   # from the first failed exchange to the end of the last
    exposed_s: float = 0.0  # seconds the island waited for the exchange


@dataclass
class Judged:
    """The receivers' verdicts on an exchange's rows (OuterLoop._judge_exchange)."""

    weights: list[float]       # to sum each row with (0: refused or idle; discounted when stale)
    tokens: float              # of the accepted rows
    refused: list[dict[str, Any]]
    divisor: float             # what the sum is divided by (the undiscounted weights)
    decode_s: float            # seconds spent opening and judging the rows


class OuterLoop:
    """Runs the outer synchronisation after each inner optimizer step (see module doc)."""

    def __init__(self, ft: FaultToleranceConfig, fragments: list[list[nn.Parameter]], rank: int,
                 world_size: int, manager: Any, fingerprint: dict[str, Any],
                 group: dist.ProcessGroup | None = None, poisons: list[Poison] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, key: FederationKey | None = None) -> None:
        self.ft, self.rank, self.world_size, self.group = ft, rank, world_size, group
        self.key = key  # signs this island's rows and checks the others' (None: plain rows)
        self.poisons = {p.round: p for p in poisons or []}  # test-only: outer step -> poison
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
        self.step = 0             # the federation's step count (torchft's manager step)
        self.pending: _Pending | None = None
        self.inner_step = 0       # the trainer's step count, sent to healing peers
        self.healed = False       # the last quorum sent this island the global state
        self.leads = True         # this island is the lowest live one (checkpoint.scope = "leader")
        self.peer_inner_step = 0  # the step count of the peer this island last healed from
        self.peer_delay = self.delay  # inner steps that peer trains between its state and its commit
        self.quorum = Quorum(ft, manager, key, rank)  # entering each quorum; the members' fingerprints
        self.judge = RowJudge(ft, self.quorum, rank, len(fragments), self._island_sums)
        self.core: OuterCore | None = None  # the global weights and outer optimizers (bridge ranks)
        self.codec_name = effective_codec(ft)
        self.codecs: list[Codec] = []  # one per fragment chunk, on bridge ranks
        self.auto = AutoCodec(ft, manager, key, self.per_fragment)  # codec = "auto": the measured link
        self.healing = Healing(self)  # a peer's state, held until the members vouch for it
        self.established = False     # this process committed a round (policy.reference_fingerprint)
        self.last_committed = False  # its last round committed ("current" in its state claim)
        self._digest: str | None = None  # chunk_digest()'s, until the global weights change
        self.guard = UpdateGuard(ft.outer_norm_limit, len(fragments))
        self.round_tokens = 0             # this island's tokens since the last exchange
        self.fragment_tokens = [0] * len(fragments)  # ... since each fragment's last exchange
        self.round_steps, self.round_compute_s, self.round_untimed_s = 0, 0.0, 0.0
        self.round_elapsed: list[float] = []
        self.federation_tokens = 0        # tokens the whole federation trained (at the last outer step)
        self.tokens_ratio = float(ft.group_size)  # federation tokens per own token, last round
        self._scale_inner_batch()
        self.round_start = self._last_step_end = time.monotonic()
        # Decoupled rounds (decoupled.py): the base weights and the decisions every island shares.
        self.handoffs = Handoffs(ft.overlap_threshold) if ft.round_mode == "decoupled" else None
        self.early_reports: list[OuterReport] = []  # a round end that finished two exchanges: the first
        self.save_global()  # collective: the initial weights are the first global weights
        if not ft.init_sync:  # islands start from their own weights: peers check they are the same
            self.fingerprint = dict(fingerprint, start=f"own weights {self.global_hash()}")  # collective
        if manager is not None:
            manager.register_state_dict_fn("archipelago_outer", self.healing.load, self.healing.state)
            expect = getattr(getattr(manager, "_checkpoint_transport", None), "expect_state_like", None)
            if expect is not None:  # a peer's state may be at most about this island's own size
                expect({"user": {"archipelago_outer": self.healing.shape()},
                        "torchft": {"step": 0, "batches_committed": 0}})

    # ---- public --------------------------------------------------------------------

    @property
    def globals(self) -> list[nn.Parameter]:
        """The global weights of this bridge rank's chunks, one per fragment (none elsewhere)."""
        return self.core.globals if self.core is not None else []

    @property
    def outer(self) -> list[torch.optim.Optimizer]:
        """Their outer optimizers."""
        return self.core.outer if self.core is not None else []

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
        self.round_tokens += tokens
        self.fragment_tokens = [t + tokens for t in self.fragment_tokens]
        self.round_steps += 1
        self.round_compute_s += compute_s
        if self._midway_due():
            self._judge_midway()
        if self.ft.round_pacing == "time":
            if not self._time_is_up():
                return None
        else:
            if self.handoffs is None and self.local_step == self.per_fragment - self.delay:
                self.prepare()
            if self.local_step < self.per_fragment:
                return None
        self.local_step = 0
        if self.handoffs is not None:
            return self._decoupled_round_end(inner_step)
        if self.pending is None:  # time pacing: the exchange starts at the round's end
            self.prepare()
        return self.perform(inner_step)

    def _decoupled_round_end(self, inner_step: int) -> OuterReport | None:
        """Decoupled rounds: finish the exchange that overlapped this round (its outer
        step), hand off this round's pseudo-gradient, then wait for it or, when the members
        agreed that exchanges overlap, train on from the global weights minus it."""
        earlier = self.perform(inner_step) if self.pending is not None else None
        self.prepare()
        p = self.pending
        assert self.handoffs is not None and p is not None
        if self.handoffs.overlaps and p.exchanged:
            self._hand_off(p)
            if earlier is None:  # the first overlapped hand-off: no report, but a new round all the same
                self._start_round_clock()
            return earlier
        if earlier is not None:
            self.early_reports.append(earlier)
        return self.perform(inner_step)

    def _hand_off(self, p: _Pending) -> None:
        """The island trains on while `p`'s exchange travels: from the global weights minus
        its own pseudo-gradient in it (OuterCore.rebased; the global weights alone when it
        sends nothing), which become its base."""
        assert self.handoffs is not None
        p.overlapped = True
        two_phase = p.gathered is not None and p.gathered.segments is not None  # bridge ranks know it
        p.midway = self._island_max([float(two_phase)])[0] > 0
        own = [p.buffer[:-2]] if p.buffer is not None and p.weight > 0 else []
        new = self.core.rebased(p.fragment, own) if self.core is not None else None
        self.layouts[p.fragment].scatter(new)
        if new is not None:
            self.handoffs.rebase(p.fragment, new)

    def finish_rounds(self, inner_step: int) -> OuterReport | None:
        """Decoupled rounds, at the end of the run (every island at the same round end):
        the exchange still in flight enters, and the island takes the global weights."""
        if self.pending is None or not self.pending.overlapped:
            return None
        fragment = self.pending.fragment
        report = self.perform(inner_step)
        self._take_global(fragment)
        return report

    def _take_global(self, fragment: int) -> None:
        """Decoupled rounds: the island continues from the global weights, nothing in flight."""
        new = self.globals[fragment].detach() if self.is_bridge else None
        self.layouts[fragment].scatter(new)
        if new is not None and self.handoffs is not None:
            self.handoffs.rebase(fragment, new)

    def add_untimed(self, seconds: float) -> None:
        """Count evaluation or checkpoint seconds of this round (reported as `untimed_s`)."""
        self.round_untimed_s += seconds

    def federation_tokens_estimate(self) -> float:
        """Tokens the whole federation has trained by now: the count at the last outer
        step plus this island's tokens since, scaled by last round's federation/own ratio."""
        return self.federation_tokens + self.round_tokens * self.tokens_ratio

    def _time_is_up(self) -> bool:
        """Time pacing: end the round now? (policy.round_is_up; all ranks must agree)"""
        now = time.monotonic()
        step_s, self._last_step_end = now - self._last_step_end, now
        self.round_elapsed.append(now - self.round_start)
        ft = self.ft
        up = round_is_up(self.local_step, ft.min_inner_steps, ft.max_inner_steps, now - self.round_start,
                         step_s, ft.round_seconds)
        if self.local_step >= ft.max_inner_steps or self.local_step < ft.min_inner_steps:
            return up  # decided by step counts alone: the same on every rank
        # Clocks differ between ranks: a tiny all-reduce per inner step (multi-rank islands only).
        return self._island_max([float(up)])[0] > 0

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
        self.core = OuterCore(self.ft, chunks, pin=torch.cuda.is_available())
        self.forget_digest()
        if self.handoffs is not None:
            self.handoffs.start(self.globals)
        if len(self.codecs) != len(self.globals):  # codec state (error feedback) outlives a reset
            self.codecs = [build_codec(self.ft, g.numel()) for g in self.globals]

    def global_hash(self) -> str:
        """SHA-256 over the global weights in canonical order (a collective)."""
        digests = self._island_gather_objects(self.chunk_digest() if self.is_bridge else None)
        return hashlib.sha256("".join(d for d in digests if d).encode()).hexdigest()[:16]

    def chunk_digest(self) -> str:
        """SHA-256 of this bridge rank's global chunks, computed once per change of them:
        the round's global hash and the next round's state claim hash the same bytes."""
        if self._digest is None:
            self._digest = digest(self.globals)
        return self._digest

    def forget_digest(self) -> None:
        """The global chunks changed: hash them again when asked."""
        self._digest = None

    def shutdown(self) -> None:
        if self.manager is not None:
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
                    if self.handoffs is not None and self.handoffs.overlaps:
                        self._join_overlapping()
                    return report
            time.sleep(0.5)

    def _join_overlapping(self) -> None:
        """Decoupled rounds that overlap: the members start their next exchange at the
        round end that let this island in, so it starts one too, sending nothing, and
        finishes it at its first round end as they do (it stays in step with them)."""
        if self.prepare(joining=True) and self.pending is not None and self.pending.exchanged:
            self._hand_off(self.pending)
        elif self.pending is not None:
            self.perform(self.inner_step)

    def prepare(self, joining: bool = False, need: int = 1) -> bool:
        """Join the quorum (healing if behind) and start averaging one fragment.

        Returns False, having started nothing, when a new federation (outer step 0) has
        fewer than `need` islands in the quorum: every island of that quorum sees the
        same count and waits, so none is left alone in an all-reduce.
        """
        began = time.perf_counter()
        m = self._enter_quorum()
        if must_wait(m, need):
            return False
        self.pending = self._plan(m, joining)
        self.pending.prepare_s = time.perf_counter() - began
        return True

    def _enter_quorum(self, again: bool = False) -> Membership:
        """Join a quorum (a new one with `again`: a retry), healing if behind; the island's view."""
        m = self.healing.settle(self._island_membership(self._membership(again)))
        self.step, self.leads = m.outer_step, m.leads
        return m

    def _plan(self, m: Membership, joining: bool) -> _Pending:
        """This round's pseudo-gradient, checked and weighted, with its exchange started."""
        self.healed = m.healed
        if self.healed:
            self.peer_inner_step = m.peer_inner_step
            # A running federation's members train fragment_sync_delay steps between handing
            # out their state and committing; in a new federation's join round every island
            # commits at once (join), so the healed island starts at the peer's own step.
            self.peer_delay = 0 if joining and m.outer_step == 0 else self.delay
        plan = plan_round(m, joining, len(self.layouts))
        if self.handoffs is not None and self.handoffs.sends_nothing:  # its last row was refused
            plan, self.handoffs.sends_nothing = replace(plan, contributes=False), False
        fragment = plan.fragment
        local = self.layouts[fragment].gather()
        buffer = self._pseudo_gradient(fragment, local) if local is not None else None  # bridge ranks
        poison = self.poisons.get(self.step + 1)
        corrupt = poison if poison is not None and plan.contributes and poison.kind != DIE_IN_EXCHANGE else None
        if buffer is not None and corrupt is not None:
            log.warning("ARCHIPELAGO_FAULT: poisoning this island's update (%s) in outer step %d",
                        corrupt.kind, self.step + 1)
            corrupt.apply(buffer[:-2])
        pending = _Pending(fragment, reset=plan.reset, tokens=self.round_tokens, step=self.step, joining=joining,
                           staleness=int(self.handoffs.stale) if self.handoffs is not None else 0)
        pending.exchanged = not skips_exchange(joining, self.step, self.ft.init_sync)
        if pending.exchanged and buffer is not None and self.codec_name == "auto":  # before the guard sees it
            pending.residue = self.auto.choose(self.codecs[fragment], buffer, plan.contributes)
        verdict = self._guard(fragment, buffer, pending) if plan.contributes else Verdict(True)
        pending.weight = contribution_weight(self.ft.outer_weighting, self.fragment_tokens[fragment],
                                             plan.contributes, verdict.accepted)
        self.round_tokens, self.fragment_tokens[fragment] = 0, 0
        if buffer is not None:
            if not pending.weight:  # nothing of this island enters the average
                buffer[:-2].zero_()
            buffer[-2], buffer[-1] = float(pending.tokens), pending.weight
        pending.buffer = buffer
        forge = corrupt.kind if corrupt is not None and corrupt.kind in FORGE_KINDS else None
        self._start_exchange(pending, m, forge)
        pending.started = time.perf_counter()
        if poison is not None and poison.kind == DIE_IN_EXCHANGE and pending.exchanged:
            poison.die()  # test-only: this island's row is in flight
        return pending

    def _start_exchange(self, p: _Pending, m: Membership, forge: str | None = None) -> None:
        """Hand the pending pseudo-gradient (and moments) to the exchange of quorum `m`, in
        frames signed for that quorum; the codec's state is kept first, for a retry."""
        p.participants, p.replica_rank = m.participants, m.replica_rank
        p.framing = Framing(self.key, int(self.manager._quorum_id or 0) if self.manager is not None else 0,
                            self.step, p.fragment, self.ft.replica_id)
        if p.exchanged and p.buffer is not None:
            codec = self.codecs[p.fragment]
            if self.ft.exchange_retries > 0:  # encoding moves error feedback; a retry starts from here
                p.codec_state = {k: v.clone() for k, v in codec.state_dict().items()}
            p.gathered = start_gather(self.manager, codec, p.buffer[:-2], p.tokens, p.weight,
                                      replace(p.framing, forge=forge))
        if self.inner_state is not None and p.exchanged:
            device = torch.device("cpu") if self.ft.copy_pseudogradients_to_cpu else None
            p.state = self.inner_state.start(p.fragment, p.weight > 0, self.manager, self._island_max,
                                             p.framing, device)

    def _exchange_failed(self, p: _Pending) -> bool:
        """Settle with every member whether the exchange went through everywhere (exchange.
        settle_exchange on each bridge rank's group), then over the island's ranks: True
        when it failed somewhere. Only a failure of a member or link counts; refused rows
        are a verdict every island reached alike."""
        failed, p.facts = False, []
        if self.manager is not None and p.framing is not None and p.exchanged:
            device = p.buffer.device if p.buffer is not None else torch.device("cpu")
            failed = settle_exchange(self.manager, p.framing, wire_device(self.manager, device),
                                     [p.gathered, p.state.gathered if p.state is not None else None],
                                     self._exchange_fraction(p), p.overlapped, p.facts)
        return self._island_max([float(failed)])[0] > 0

    def _retry_exchange(self, p: _Pending, attempt: int) -> _Pending:
        """Run a failed exchange again with the members left: a new quorum through the usual
        path (healing, state claims, fingerprints), the same pseudo-gradient, tokens and
        weight, in frames signed for the new quorum. If the federation went on without this
        island meanwhile (it healed), the round is planned again from the new quorum."""
        log.warning("the exchange of outer step %d failed (%s); running it again with a new quorum "
                    "(retry %d of %d, fault_tolerance.exchange_retries)", p.step + 1, self._failure(), attempt,
                    self.ft.exchange_retries)
        self._forget_attempt(p)
        began = time.perf_counter()
        m = self._enter_quorum(again=True)
        log.info("outer step %d: a new quorum of %d island(s) after %.2f s; exchanging again", p.step + 1,
                 m.participants, time.perf_counter() - began)
        if not keeps_pending(m, p.step):
            self._give_back(p)
            if self.handoffs is not None:  # decoupled: it healed; the row after this one is void too
                self.handoffs.sends_nothing = True
            fresh = self._plan(m, p.joining)
            fresh.prepare_s, fresh.started, fresh.spent = p.prepare_s, p.started, p.spent
            return fresh
        if self.codec_name == "auto" and p.buffer is not None:  # the members' collectives of a round, in order
            self.auto.rechoose(self.codecs[p.fragment], p.buffer.device)
        self._start_exchange(p, m)
        return p

    def _forget_attempt(self, p: _Pending) -> None:
        """What a failed attempt leaves: its bytes counted, the codec's state as it was before."""
        sent, received = self._attempt_bytes(p)
        p.spent = (p.spent[0] + sent, p.spent[1] + received)
        if p.codec_state is not None:
            self.codecs[p.fragment].load_state_dict(p.codec_state)
        p.gathered, p.state, p.total, p.judged = None, None, None, None

    def _give_back(self, p: _Pending) -> None:
        """A round abandoned for a new plan: top-k's residue it took goes back to the codec."""
        if p.residue is not None:
            self.codecs[p.fragment].give_back(p.residue)  # type: ignore[attr-defined]
            p.residue = None

    def _failure(self) -> str:
        error = self.manager.errored() if self.manager is not None else None
        cause = getattr(error, "original_exception", error)
        return f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}" if cause is not None else \
            "it failed on another bridge rank or island"

    def _measure_link(self, p: _Pending, carried: bool) -> None:
        """codec = "auto": the link this exchange measured (AutoCodec.measure)."""
        until_in = self._exchange_seconds(p) if p.gathered is not None else 0.0
        self.auto.measure(self.codecs[p.fragment], p.gathered, p.residue, carried, until_in, p.waited,
                          self.round_compute_s)

    def _membership(self, again: bool = False) -> Membership:
        """This rank's view of the quorum: a bridge rank joins it (blocking; a healing island
        receives the state here); the other ranks know nothing yet. With `again` (a retry),
        the lighthouse is made to hand out a new quorum id even for the same members."""
        if self.manager is None:
            return Membership()
        self.healing.begin()
        self.quorum.start(again)  # a healing island's Healing.load holds the peer's state
        self.quorum.refuse_outsiders()
        refusal = self.healing.judge_offer()
        self.quorum.check_members(self.fingerprint, self.established)
        offer = self.healing.offer
        healed = offer is not None and refusal is None
        same = healed and all(torch.equal(g.detach(), f["global"].to(g.device))
                              for g, f in zip(self.globals, offer["fragments"]))  # type: ignore[index]
        return Membership(outer_step=self.manager.current_step(), healed=healed,
                          progress_void=healed and not same,
                          peer_inner_step=self.healing.taken.inner_step if healed else 0,
                          participants=self.manager.num_participants(),
                          replica_rank=_rank_or_none(self.manager), heal_refused=refusal is not None)

    def _island_membership(self, mine: Membership) -> Membership:
        """The island's view: the element-wise max of its ranks' views."""
        return Membership.from_values(self._island_max(mine.to_values()))

    def _guard(self, fragment: int, buffer: torch.Tensor | None, pending: _Pending) -> Verdict:
        """One bad island must not poison the others: check the update before it is sent."""
        # The island's norm over its bridge chunks; a NaN/inf anywhere makes it non-finite.
        sumsq = 0.0 if buffer is None else float(torch.linalg.vector_norm(buffer[:-2])) ** 2  # a device sync
        pending.norm = math.sqrt(self._island_sums([sumsq])[0])
        pending.rejected = self.guard.check(fragment, pending.norm)
        if pending.rejected:
            pending.reset = True  # it takes the global weights, like a healed island
            log.warning("rejected this island's update at outer step %d: %s; it sends weight 0 and "
                        "takes the federation's weights", self.step + 1, pending.rejected)
        return Verdict(pending.rejected is None, pending.rejected)

    def perform(self, inner_step: int) -> OuterReport:
        """Finish the exchange, vote, and step (or restore) the fragment's global weights."""
        p = self.pending
        assert p is not None, "perform() without prepare()"
        self.pending = None
        blocked_since = time.perf_counter()
        p, tried = self._exchange_until_agreed(p)
        own = p.buffer if p.overlapped else None  # decoupled: the island's pseudo-gradient in this exchange
        if p.total is not None:  # the agreed sum replaces the pseudo-gradient (freed)
            p.buffer, p.total = p.total, None
        tried.exposed_s = time.perf_counter() - blocked_since + p.midway_s
        result, state_accepted = self._vote(p)
        if self.codec_name == "auto" and p.buffer is not None and p.exchanged:
            refused_me = any(r.get("island") == self.ft.replica_id for r in tried.refused)
            self._measure_link(p, carried=result.committed and p.weight > 0 and not refused_me)
        self._apply_round(p, own, result)
        if p.state is not None and self.inner_state is not None:
            self.inner_state.finish(p.state, apply=result.committed and state_accepted)
        if p.reset:  # a healed island takes every fragment's global weights
            for i, layout in enumerate(self.layouts):
                if i != p.fragment:
                    layout.scatter(self.globals[i].detach() if self.is_bridge else None)
            self.fragment_tokens = [0] * len(self.fragment_tokens)
        self._count_round(p, result)
        report = self._report(p, inner_step, result, tried, blocked_since)
        self._start_round_clock()
        return report

    def _exchange_until_agreed(self, p: _Pending) -> tuple[_Pending, _Tried]:
        """Finish the exchange; every member must agree that it went through, or all run it
        again with a new quorum (up to exchange_retries times), else the round is lost."""
        tried = _Tried()
        tried.decode_s, tried.refused = self._finish_exchange(p)
        failed_at = 0.0
        while p.exchanged:
            agreed = not self._exchange_failed(p)
            failed_at = failed_at or (0.0 if agreed else time.perf_counter())
            if not retries_exchange(agreed, tried.retries, self.ft.exchange_retries):
                if not agreed:
                    self._lose_round(p)
                break
            tried.retries += 1
            p = self._retry_exchange(p, tried.retries)
            tried.decode_s, tried.refused = self._finish_exchange(p)
        tried.retry_s = time.perf_counter() - failed_at if tried.retries else 0.0
        return p, tried

    def _vote(self, p: _Pending) -> tuple[RoundResult, bool]:
        """torchft's vote on this bridge rank, combined over the island's ranks: the round's
        result, and whether the averaged moments had any island's weight."""
        mine = RoundResult()
        if self.manager is not None and p.buffer is not None:
            mine = RoundResult(self._should_commit(), self.manager.num_participants(),
                               float(p.buffer[-1]), int(float(p.buffer[-2])))
        state_weight = sum(p.state.weights) if p.state is not None else 0.0
        values = self._island_max([*mine.to_values(), state_weight])
        return RoundResult.from_values(values[:-1]), values[-1] > 0

    def _apply_round(self, p: _Pending, own: torch.Tensor | None, result: RoundResult) -> None:
        """The outer step on the global weights (when the round applies one), and the
        island's weights that follow: the global ones (merged with its own, with
        fragment_update_alpha), or under decoupled rounds its own, moved on."""
        merge = merges_local(result, p.reset, self.ft.fragment_update_alpha)
        local = self.layouts[p.fragment].gather() if merge and not p.overlapped else None
        if p.buffer is not None and applies_outer_step(result):  # bridge ranks
            self._outer_step(p.fragment, p.buffer, result.total_weight)
        if self.handoffs is not None and p.exchanged:
            self._settle_handoffs(p, applies_outer_step(result))
        if p.overlapped:  # the island trained on: its weights are not the global ones
            self._after_overlapped(p, own, result.committed)
            return
        new = self.core.island_weights(p.fragment, local) if self.core is not None else None  # bridge ranks
        self.layouts[p.fragment].scatter(new)
        if self.handoffs is not None and new is not None:
            self.handoffs.rebase(p.fragment, new)

    def _count_round(self, p: _Pending, result: RoundResult) -> None:
        """The federation's step and token counts after the round."""
        self.last_committed = result.committed
        if not result.committed:
            return
        self.step += 1
        self.established = True
        self.federation_tokens += result.federation_tokens
        if p.tokens:
            self.tokens_ratio = result.federation_tokens / p.tokens
            self._scale_inner_batch()

    def _report(self, p: _Pending, inner_step: int, result: RoundResult, tried: _Tried,
                blocked_since: float) -> OuterReport:
        """The round's record; the round's counters start again."""
        sent, received = self._exchange_bytes(p)
        report = OuterReport(step=inner_step, outer_step=self.step, committed=result.committed,
                             participants=result.participants, contributors=result.total_weight,
                             fragment=p.fragment, healed=self.healed, bytes_sent=sent,
                             sync_s=p.prepare_s + p.midway_s + time.perf_counter() - blocked_since,
                             inner_steps=self.round_steps, tokens=p.tokens, compute_s=self.round_compute_s,
                             weight=p.weight, federation_tokens=self.federation_tokens, norm=p.norm,
                             rejected=p.rejected, refused=tried.refused, codec=self._codec_label(p.fragment),
                             bytes_received=received,
                             encode_s=p.gathered.encode_s if p.gathered else 0.0, decode_s=tried.decode_s,
                             overlap_s=blocked_since - p.started, exposed_s=tried.exposed_s,
                             untimed_s=self.round_untimed_s,
                             retries=tried.retries, retry_s=tried.retry_s,
                             pacing_elapsed_s=self.round_elapsed if self.ft.round_pacing == "time" else None)
        self.round_steps, self.round_compute_s, self.round_untimed_s = 0, 0.0, 0.0
        self.round_elapsed = []
        if self.numel <= HASH_EVERY_ROUND_MAX_NUMEL:
            report.global_hash = self.global_hash()
        return report

    def _start_round_clock(self) -> None:
        """A round starts now (time pacing measures its seconds from here)."""
        self.round_start = self._last_step_end = time.monotonic()

    def _settle_handoffs(self, p: _Pending, applied: bool) -> None:
        """Decoupled rounds: every island's decisions from the members' agreement facts
        (the bridge ranks hold them; combined over the island, so all ranks decide alike)."""
        assert self.handoffs is not None
        overlapped, overlaps = self.handoffs.decide(p.facts) if self.is_bridge else (False, False)
        shared = self._island_max([float(overlapped), float(overlaps)])
        self.handoffs.settle(shared[0] > 0, shared[1] > 0, applied)

    def _after_overlapped(self, p: _Pending, own: torch.Tensor | None, committed: bool) -> None:
        """Decoupled rounds, an overlapped exchange finished: its outer step is in the
        global weights, the island's weights moved on. Lost, its row is sent again with the
        next one; refused by the receivers, the island takes the global weights and its next
        row is void (it was trained from the refused one)."""
        assert self.handoffs is not None
        if not committed and own is not None and p.weight > 0:
            self.handoffs.lost(p.fragment, own[:-2])
        if p.reset and p.weight > 0:
            self._take_global(p.fragment)
            self.handoffs.sends_nothing = True

    def _exchange_fraction(self, p: _Pending) -> float:
        """Decoupled rounds: this exchange's seconds (from its start until its rows were in)
        over this round's compute seconds, in OVERLAP_SCALE units (0: nothing to measure)."""
        if self.handoffs is None or p.gathered is None or self.round_compute_s <= 0:
            return 0.0
        second = p.gathered.second.seconds() if p.gathered.second is not None else 0.0
        return (self._exchange_seconds(p) + second) / self.round_compute_s * OVERLAP_SCALE

    @staticmethod
    def _exchange_seconds(p: _Pending) -> float:
        """From the exchange's start until its rows were in: the transport's thread stamped
        that where it can, else the wait for them returned (`_finish_exchange`)."""
        assert p.gathered is not None
        return seconds_until_in(p.gathered.started or p.started, p.waited, p.gathered.done_at)

    def _midway_due(self) -> bool:
        """Decoupled rounds whose exchange is the reduce-scatter: judge its rows and start its
        second phase now? Halfway through the round (in inner steps; under time pacing in
        seconds, agreed over the island's ranks), so that each phase has half a round to
        travel while the island trains (they move about the same bytes)."""
        p = self.pending
        if p is None or not p.midway or p.judged is not None:
            return False
        if self.ft.round_pacing != "time":
            return self.local_step == max(1, self.per_fragment // 2)
        half = time.monotonic() - self.round_start >= self.ft.round_seconds / 2
        return self._island_max([float(half)])[0] > 0

    def _judge_midway(self) -> None:
        """Judge the rows of the exchange in flight (waiting for the first phase if it is not
        in yet) and start its second phase; the round's end then waits only for that."""
        p = self.pending
        assert p is not None
        began = time.perf_counter()
        self._judge_exchange(p)
        assert p.judged is not None
        if p.gathered is not None and p.gathered.segments is not None and p.buffer is not None:
            # (another bridge rank's chunk may have taken the reduce-scatter and this one not)
            start_sums(p.gathered, self.codecs[p.fragment], p.judged.weights, self.manager, p.buffer.device,
                       self.ft.outer_aggregation == "trimmed_mean")
        p.midway_s = time.perf_counter() - began
        self._last_step_end = time.monotonic()  # time pacing: the block is not an inner step's length
        log.info("outer step %d: rows judged halfway through the round (%.2f s blocked); the second phase "
                 "travels while the island trains", p.step + 1, p.midway_s)

    def _judge_exchange(self, p: _Pending) -> None:
        """Wait for the rows and judge them (`p.judged`); in decoupled rounds every row of a
        stale exchange is discounted alike (decoupled.py)."""
        if p.gathered is not None:
            p.gathered.work.wait()  # the network's share; opening and judging the rows is decode_s
        judging = p.waited = time.perf_counter()
        weights, tokens, refused = self._judge(p)
        divisor = sum(weights)
        if p.staleness:
            factor = staleness_discount(p.staleness, self.ft.staleness_exponent, self.ft.max_staleness)
            weights, divisor = [w * factor for w in weights], divisor if factor > 0 else 0.0
        if p.state is not None and self.inner_state is not None:  # the moments of the islands it accepted
            self.inner_state.judge_moments(p.state, weights, self._island_max)
        p.judged = Judged(weights, tokens, refused, divisor, time.perf_counter() - judging)

    def _finish_exchange(self, p: _Pending) -> tuple[float, list[dict[str, Any]]]:
        """Judge the rows (unless that was done halfway through the round) and sum the
        accepted ones into the buffer: the decode seconds and the refused rows."""
        if not p.exchanged:
            return 0.0, []
        if p.judged is None:
            self._judge_exchange(p)
        judged = p.judged
        assert judged is not None
        decode_s = judged.decode_s
        if p.gathered is not None and p.buffer is not None:
            # The sum goes beside the pseudo-gradient when a retry may have to send that again
            # (one more copy of the chunk during the exchange; exchange_retries = 0 saves it).
            resent = self.ft.exchange_retries > 0 or self.handoffs is not None  # decoupled: a lost row is resent
            p.total = torch.empty_like(p.buffer) if resent else p.buffer
            decode_s += finish_gather(p.gathered, self.codecs[p.fragment], p.total, judged.weights, judged.tokens,
                                      self.manager, self.ft.outer_aggregation == "trimmed_mean")
            if p.staleness:  # the sum is divided by the undiscounted weights (OuterCore.weight)
                p.total[-1] = judged.divisor if self.manager.errored() is None else 0.0
        return decode_s, judged.refused

    def _lose_round(self, p: _Pending) -> None:
        """The exchange failed somewhere and no retry is left: no island of the federation
        commits this round (the manager's error makes this island's vote say no)."""
        log.warning("the exchange of outer step %d failed (%s) and no retry is left "
                    "(fault_tolerance.exchange_retries = %d): the round is lost", p.step + 1, self._failure(),
                    self.ft.exchange_retries)
        if self.manager is not None and self.manager.errored() is None:
            self.manager.report_error(RuntimeError("another member's exchange failed (agree_on_exchange)"))

    # ---- pieces --------------------------------------------------------------------

    def _scale_inner_batch(self) -> None:
        """adam_federation_batch: the inner AdamW's batch ratio is the federation's tokens per
        own token (the same on every rank of the island; 1 when it trains alone)."""
        if self.scaled_optimizer is not None:
            self.scaled_optimizer.batch_ratio = max(1.0, self.tokens_ratio)  # type: ignore[attr-defined]

    def _pseudo_gradient(self, fragment: int, local: torch.Tensor) -> torch.Tensor:
        """[global - local ..., tokens, weight], the last two still 0 (prepare fills them).

        Weighted and summed across islands, the last element is the total weight the
        average divides by, the one before it the tokens the federation trained.

        Built on the island's device, so NCCL can carry it, or on CPU with
        `copy_pseudogradients_to_cpu` (the fragment then crosses PCIe before the exchange
        instead of after it; the global weights live on CPU either way).
        """
        g = self.globals[fragment].detach()
        device = torch.device("cpu") if self.ft.copy_pseudogradients_to_cpu else local.device
        buffer = torch.zeros(g.numel() + 2, dtype=g.dtype, device=device)
        if self.handoffs is not None:  # decoupled rounds: from the island's own base weights
            self.handoffs.pseudo_gradient(fragment, local, buffer[:-2])
            return buffer
        torch.sub(g.to(device, non_blocking=True), local.to(device), out=buffer[:-2])
        return buffer

    def _judge(self, p: _Pending) -> tuple[list[float], float, list[dict[str, Any]]]:
        """Every receiver's verdict on every island's row (judging.RowJudge; the same on
        every island): the weights to sum with, the tokens of the accepted rows, and the
        refused ones (island, reason). A collective over the island."""
        n = p.participants
        table = (inspect_gather(p.gathered, self.codecs[p.fragment], self.manager, n)  # waits for the rows
                 if p.gathered is not None else empty_table(n))
        if table.shape[0] != n:  # a lost round's rows: nothing to judge (it will not commit)
            table = empty_table(n)
        global_sumsq = float(self.globals[p.fragment].detach().double().square().sum()) if self.is_bridge else 0.0
        judged = self.judge.judge(table, self.layouts[p.fragment].numel, global_sumsq, self.step, p.replica_rank)
        if judged.own_refused:  # this island's own row: it takes the federation's weights
            p.reset, p.rejected = True, p.rejected or judged.own_refused
        return judged.weights, judged.tokens, judged.refused

    def _outer_step(self, fragment: int, buffer: torch.Tensor, total: float) -> None:
        """The core's outer step on the agreed sum (from a GPU buffer: a device-to-host copy)."""
        assert self.core is not None, "only bridge ranks hold the global weights"
        self.core.apply(fragment, buffer[:-2], total)
        self.forget_digest()

    def _should_commit(self) -> bool:
        try:
            return bool(self.manager.should_commit())
        except RuntimeError as exc:  # torchft raises after max_retries failures in a row
            raise FederationError(f"{exc}; the federation is not making progress: check that the other "
                                  "islands are alive and reachable (fault_tolerance.max_retries)") from exc

    def _codec_label(self, fragment: int) -> str:
        """The codec's name for the record; with `auto`, the round's choice (`auto:int8`)."""
        if self.codec_name == "auto" and self.codecs:
            return f"auto:{self.codecs[fragment].current}"  # type: ignore[attr-defined]
        return self.codec_name

    def _exchange_bytes(self, p: _Pending) -> tuple[int, int]:
        """(sent, received) bytes of the island's bridge ranks in this exchange: what they
        handed to the cross-island collective, and what came back from the other islands
        (their rows; with averaged moments also the moments' all-reduce)."""
        sent, received = self._attempt_bytes(p)
        totals = self._island_sums([float(sent + p.spent[0]), float(received + p.spent[1])])
        return int(totals[0]), int(totals[1])

    def _attempt_bytes(self, p: _Pending) -> tuple[int, int]:
        """(sent, received) bytes of this bridge rank in the pending attempt of the exchange."""
        sent = received = 0
        if p.gathered is not None:
            sent, received = p.gathered.sent, p.gathered.received
        if p.state is not None:  # the rows of moments
            sent, received = sent + p.state.sent, received + p.state.received
        return sent, received

    # ---- checkpoint (DCP Stateful) -------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"local_step": self.local_step, "step": self.step,
                                 "federation_tokens": self.federation_tokens, "guard": self.guard.state_tensor()}
        if self.is_bridge:
            state[f"bridge{self.rank}"] = {f"fragment{i}": {"global": g.detach(), "outer": tensor_state(o, g),
                                                           **_codec_state(c)}
                                          for i, (g, o, c) in enumerate(zip(self.globals, self.outer, self.codecs))}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local_step, self.step = int(state["local_step"]), int(state["step"])
        self.federation_tokens = int(state["federation_tokens"])
        self.guard.load_state_tensor(state["guard"])
        if self.is_bridge:
            for i, (g, o, c) in enumerate(zip(self.globals, self.outer, self.codecs)):
                saved = state[f"bridge{self.rank}"][f"fragment{i}"]
                load_tensor_state(o, g, saved)
                c.load_state_dict(saved.get("codec", {}))
            self.forget_digest()
            if self.handoffs is not None:  # the exchange that was in flight is lost: the next row resends it
                self.handoffs.start(self.globals)
        if self.manager is not None:
            self.manager.load_state_dict({"step": self.step, "batches_committed": 0})

    # ---- island collectives --------------------------------------------------------

    def _island_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, op=ReduceOp.MAX, group=self.group)
        return t.tolist()

    def _island_sums(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def _island_gather_objects(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _rank_or_none(manager: Any) -> int:
    rank = manager.participating_rank()
    return -1 if rank is None else int(rank)


def _codec_state(codec: Codec) -> dict[str, Any]:
    """The codec's state for a checkpoint, under "codec" (nothing for stateless codecs)."""
    state = codec.state_dict()
    return {"codec": state} if state else {}


def report_record(report: OuterReport) -> dict[str, Any]:
    record = asdict(report)
    if record["pacing_elapsed_s"] is None:  # steps-paced rounds: nothing to replay
        del record["pacing_elapsed_s"]
    return record
