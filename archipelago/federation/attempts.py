"""A round's exchange, attempt by attempt: start it, judge its rows and sum the accepted
ones, settle with every member whether it went through, and when a member died or a link
broke in it, run it again with the members left in a new quorum (up to
`exchange_retries` times), else lose the round on every island (docs/rounds.md, "When a
member dies in the exchange").

The outer loop (diloco.OuterLoop, the `AttemptsHost` here) plans the round and applies
its outcome; this part moves the pending pseudo-gradient through the exchange
(exchange.py, sums.py, agreement.py) and says how it went (`Tried`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.agreement import settle_exchange
from archipelago.federation.auto_codec import AutoCodec
from archipelago.federation.carry import Upload
from archipelago.federation.codecs import Codec, schedule_round
from archipelago.federation.confirm import inspect_gather
from archipelago.federation.decoupled import OVERLAP_SCALE, Handoffs
from archipelago.federation.exchange import (
    Framing,
    Gathered,
    empty_table,
    seconds_until_in,
    start_gather,
    take_handed,
    wire_device,
)
from archipelago.federation.give_up import wait_for
from archipelago.federation.inner_state import InnerStateAverager, StateExchange
from archipelago.federation.island_ranks import IslandRanks
from archipelago.federation.judging import RowJudge
from archipelago.federation.layout import FlatLayout
from archipelago.federation.outer_core import staleness_discount
from archipelago.federation.policy import Membership, keeps_pending, retries_exchange
from archipelago.federation.repair import Repaired, RepairRefused, finish_repair, repair_first_phase
from archipelago.federation.round_book import RoundBook
from archipelago.federation.sums import finish_gather
from archipelago.federation.trust import FederationKey, member_island, member_public_key

# Failed attempts whose buffers are kept (ExchangeAttempts.abandoned): the last one is what
# the transport may still write from; one more for margin.
ABANDONED_HELD = 2

log = logging.getLogger("archipelago.federation")


@dataclass
class Pending:
    """An exchange started by `prepare` and finished by `perform`."""

    fragment: int
    buffer: torch.Tensor | None = None
    reset: bool = False      # this island healed (or was refused): discard its local progress
    prepare_s: float = 0.0   # seconds prepare() blocked (quorum, healing, gather)
    tokens: int = 0          # this island's tokens since the previous exchange
    weight: float = 0.0
    norm: float | None = None
    own_refused: str | None = None
    gathered: Gathered | None = None  # the exchange's rows (bridge ranks)
    exchanged: bool = False           # the island takes part in an exchange this round (all ranks)
    participants: int = 0             # islands in the quorum (rows of the exchange)
    participant_rank: int = -1            # this island's row
    state: StateExchange | None = None  # the inner optimizer's moments (average_optimizer_state)
    started: float = 0.0              # perf_counter when the exchange was handed to the network
    waited: float = 0.0               # perf_counter when perform's wait for the rows returned
    residue: torch.Tensor | None = None  # codec = "auto": top-k's residue this dense round carries
    outer_step: int = 0               # the federation's outer step the round started from
    joining: bool = False             # the island's join round (it sends nothing)
    framing: Framing | None = None    # how this attempt's rows are framed (its quorum's id)
    codec_state: dict[str, torch.Tensor] | None = None  # the codec's state before it encoded (a retry restores it)
    spent: tuple[int, int] = (0, 0)   # (sent, received) bytes of attempts that failed (bridge rank's own)
    total: torch.Tensor | None = None  # the exchange's sum, apart from `buffer` when a retry may resend it
    overlapped: bool = False          # decoupled rounds: the island trains on while this exchange travels
    staleness: int = 0                # decoupled rounds: outer steps its rows' base weights are behind
    own: torch.Tensor | None = None   # a carrier's own pseudo-gradient when `buffer` carries a thin island's too
    carried: list[Upload] = field(default_factory=list)  # the thin island's uploads folded into `buffer`
    carried_tokens: int = 0           # ... their tokens (in `tokens`, the row's claim)
    facts: list[tuple[float, float]] = field(default_factory=list)  # the members' agreement facts (decoupled)
    midway: bool = False              # decoupled: judged and its second phase started during the round
    judged: Judged | None = None      # the receivers' verdicts on its rows, once judged
    midway_s: float = 0.0             # seconds the island blocked for that, during the round
    members: list[str] = field(default_factory=list)  # the attempt's quorum, replica ids by replica rank
    repaired: Repaired | None = None  # a retry finished by the segment repair (exchange_repair = "segment")
    repaired_table: torch.Tensor | None = None  # ... and the table of the survivors' rows it judged
    repaired_done: float = 0.0        # ... perf_counter when its sums were in

    def own_values(self) -> torch.Tensor | None:
        """This island's own pseudo-gradient in the row (bridge ranks): without what it carries."""
        if self.own is not None:
            return self.own
        return self.buffer[:-2] if self.buffer is not None else None


@dataclass
class Tried:
    """How the exchange of a round went, for its report (ExchangeAttempts.until_agreed)."""

    decode_s: float = 0.0
    refused: list[dict[str, Any]] = field(default_factory=list)
    retries: int = 0       # exchanges run again with a new quorum
    retry_s: float = 0.0   # from the first failed exchange to the end of the last
    repaired: int = 0      # retries finished by the segment repair instead of a whole exchange
    exposed_s: float = 0.0  # seconds the island waited for the exchange


@dataclass
class Judged:
    """The receivers' verdicts on an exchange's rows (ExchangeAttempts.judge_rows)."""

    weights: list[float]       # to sum each row with (0: refused or idle; discounted when stale)
    tokens: float              # of the accepted rows
    refused: list[dict[str, Any]]
    divisor: float             # what the sum is divided by (the undiscounted weights)
    decode_s: float            # seconds spent opening and judging the rows


class AttemptsHost(Protocol):
    """What the exchange's attempts read of the outer loop they belong to, and ask of it."""

    ft: FaultToleranceConfig
    ranks: IslandRanks
    manager: Any
    key: FederationKey | None
    signer: Any
    outer_step: int
    codec_name: str
    auto: AutoCodec
    inner_state: InnerStateAverager | None
    handoffs: Handoffs | None
    layouts: list[FlatLayout]
    judge: RowJudge
    is_bridge: bool
    book: RoundBook

    @property
    def codecs(self) -> list[Codec]: ...

    @property
    def globals(self) -> list[nn.Parameter]: ...



    def enter_quorum(self, again: bool = False) -> Membership: ...

    def start_round(self, m: Membership, joining: bool) -> Pending: ...


def signing(key: FederationKey | None, signer: Any, members: list[str]) -> dict[str, Any]:
    """A round's Framing fields for signed frames (exchange.Framing): this member's signing
    key, and the quorum's public signing keys and island ids by replica rank, read from the
    member tokens the lighthouse handed every member (none without a key)."""
    if key is None or not members:
        return {}
    return {"signer": signer, "members": tuple(member_public_key(key, m) for m in members),
            "islands": tuple(member_island(key, m) for m in members)}


class ExchangeAttempts:
    """The exchange of the round in flight (`Pending`), attempt by attempt (see module doc)."""

    def __init__(self, host: AttemptsHost) -> None:
        self.host = host
        # The buffers of failed attempts, kept until an exchange goes through again: every
        # tensor their collectives were handed (exchange.hand_over: the rows sent and
        # received, the moments, the tables, the sums, the agreement's flags, the repair's
        # parts), one list per attempt. A collective that failed on one pair (the dead member's) may
        # still be writing to the others from these buffers on gloo's transport thread
        # until torchft's next quorum aborts the old group; freeing them under it made a
        # survivor abort ("writev ... Bad address", a terminate in gloo's thread). Each new
        # quorum aborts the group before it, so the last ABANDONED_HELD failures are all
        # that can still be written from: at most that many exchanges' buffers, until the
        # next agreed one.
        self.abandoned: list[list[torch.Tensor]] = []

    def start(self, p: Pending, m: Membership, forge: str | None = None) -> None:
        """Hand the pending pseudo-gradient (and moments) to the exchange of quorum `m`, in
        frames signed for that quorum; the codec's state is kept first, for a retry."""
        h = self.host
        framing = self._frame(p, m)
        if p.exchanged and p.buffer is not None:
            codec = h.codecs[p.fragment]
            schedule_round(codec, h.ft, p.outer_step)  # topk_early_rounds: this round's values a chunk
            if h.ft.exchange_retries > 0:  # encoding moves error feedback; a retry starts from here
                p.codec_state = {k: v.clone() for k, v in codec.state_dict().items()}
            p.gathered = start_gather(h.manager, codec, p.buffer[:-2], p.tokens, p.weight,
                                      replace(framing, forge=forge))
        self._start_moments(p, framing)

    def _start_moments(self, p: Pending, framing: Framing) -> None:
        """Start the exchange of the inner optimizer's moments (average_optimizer_state): a
        collective over the island's ranks too, so every rank calls it at the same point."""
        h = self.host
        if h.inner_state is not None and p.exchanged:
            device = torch.device("cpu") if h.ft.copy_pseudogradients_to_cpu else None
            carry = h.codec_name != "auto" or p.buffer is None or h.auto.carries_moments
            p.state = h.inner_state.start(p.fragment, p.weight > 0, h.manager, h.ranks.max, framing, device, carry)
            if not p.state.carried:  # codec = "auto" left them out of this round, on every rank alike
                p.state = None

    def _frame(self, p: Pending, m: Membership) -> Framing:
        """The attempt's place in quorum `m`: its rows' rank, signed frames for that quorum,
        and the quorum's members (replica ids by rank, for a later segment repair)."""
        h = self.host
        p.participants, p.participant_rank = m.participants, m.participant_rank
        p.members = list(getattr(h.manager, "_archipelago_replica_ids", None) or [])
        p.framing = Framing(h.key, int(h.manager._quorum_id or 0) if h.manager is not None else 0,
                            h.outer_step, p.fragment, h.ft.replica_id, **signing(h.key, h.signer, p.members))
        return p.framing

    def until_agreed(self, p: Pending) -> tuple[Pending, Tried]:
        """Finish the exchange; every member must agree that it went through, or all run it
        again with a new quorum (up to exchange_retries times), else the round is lost."""
        tried = Tried()
        tried.decode_s, tried.refused = self._finish(p)
        failed_at = 0.0
        while p.exchanged:
            agreed = not self._failed(p)
            if agreed:  # every group the failed attempts used has been aborted by now
                self.abandoned.clear()
                take_handed(self.host.manager)  # and this exchange's collectives all completed
            failed_at = failed_at or (0.0 if agreed else time.perf_counter())
            if not retries_exchange(agreed, tried.retries, self.host.ft.exchange_retries):
                if not agreed:
                    self._lose_round(p)
                break
            tried.retries += 1
            p = self._retry(p, tried.retries)
            tried.repaired += p.repaired is not None
            tried.decode_s, tried.refused = self._finish(p)
        tried.retry_s = time.perf_counter() - failed_at if tried.retries else 0.0
        return p, tried

    def judge_rows(self, p: Pending) -> None:
        """Wait for the rows and judge them (`p.judged`); in decoupled rounds every row of a
        stale exchange is discounted alike (decoupled.py)."""
        h = self.host
        if p.gathered is not None:  # the network's share; opening and judging the rows is decode_s
            wait_for(h.manager, p.gathered, p.gathered.framing)
        judging = p.waited = time.perf_counter()
        weights, tokens, refused = self._judge(p)
        divisor = sum(weights)
        if p.staleness:
            factor = staleness_discount(p.staleness, h.ft.staleness_exponent, h.ft.max_staleness)
            weights, divisor = [w * factor for w in weights], divisor if factor > 0 else 0.0
        if p.state is not None and h.inner_state is not None:  # the moments of the islands it accepted
            h.inner_state.judge_moments(p.state, weights, h.ranks.max)
        p.judged = Judged(weights, tokens, refused, divisor, time.perf_counter() - judging)

    def measure_link(self, p: Pending, carried: bool, decode_s: float = 0.0) -> None:
        """codec = "auto": the link and the CPU seconds this exchange measured (AutoCodec.measure;
        `decode_s`: opening, judging and summing its rows)."""
        h = self.host
        until_in = self._seconds_until_in(p) if p.gathered is not None else 0.0
        h.auto.measure(h.codecs[p.fragment], p.gathered, p.residue, carried, until_in, p.waited, h.book.compute_s,
                       decode_s)

    def exchange_bytes(self, p: Pending) -> tuple[int, int]:
        """(sent, received) bytes of the island's bridge ranks in this exchange: what they
        handed to the cross-island collective, and what came back from the other islands
        (their rows; with averaged moments also the moments' all-reduce)."""
        sent, received = self._attempt_bytes(p)
        totals = self.host.ranks.sums([float(sent + p.spent[0]), float(received + p.spent[1])])
        return int(totals[0]), int(totals[1])

    # ---- one attempt ---------------------------------------------------------------

    def _judge(self, p: Pending) -> tuple[list[float], float, list[dict[str, Any]]]:
        """Every receiver's verdict on every island's row (judging.RowJudge; the same on
        every island): the weights to sum with, the tokens of the accepted rows, and the
        refused ones (island, reason). A collective over the island."""
        h, n = self.host, p.participants
        if p.repaired_table is not None:  # the segment repair inspected the survivors' rows
            table = p.repaired_table
        else:
            table = (inspect_gather(p.gathered, h.codecs[p.fragment], h.manager, n)  # waits for the rows
                     if p.gathered is not None else empty_table(n))
        if table.shape[0] != n:  # a lost round's rows: nothing to judge (it will not commit)
            table = empty_table(n)
        global_sumsq = float(h.globals[p.fragment].detach().double().square().sum()) if h.is_bridge else 0.0
        judged = h.judge.judge(table, h.layouts[p.fragment].numel, global_sumsq, h.outer_step, p.participant_rank)
        if judged.own_refused:  # this island's own row: it takes the federation's weights
            p.reset, p.own_refused = True, p.own_refused or judged.own_refused
        return judged.weights, judged.tokens, judged.refused

    def _finish(self, p: Pending) -> tuple[float, list[dict[str, Any]]]:
        """Judge the rows (unless that was done halfway through the round) and sum the
        accepted ones into the buffer: the decode seconds and the refused rows."""
        h = self.host
        if not p.exchanged:
            return 0.0, []
        if p.judged is None:
            self.judge_rows(p)
        judged = p.judged
        assert judged is not None
        decode_s = judged.decode_s
        if (p.gathered is not None or p.repaired is not None) and p.buffer is not None:
            # The sum goes beside the pseudo-gradient when a retry may have to send that again
            # (one more copy of the chunk during the exchange; exchange_retries = 0 saves it).
            resent = h.ft.exchange_retries > 0 or h.handoffs is not None  # decoupled: a lost row is resent
            p.total = torch.empty_like(p.buffer) if resent else p.buffer
            trimmed = h.ft.outer_aggregation == "trimmed_mean"
            if p.repaired is not None:
                began = time.perf_counter()
                finish_repair(p.repaired, h.codecs[p.fragment], p.total, judged.weights, judged.tokens, h.manager,
                              trimmed)
                p.repaired_done = time.perf_counter()
                decode_s += p.repaired_done - began
            else:
                assert p.gathered is not None
                decode_s += finish_gather(p.gathered, h.codecs[p.fragment], p.total, judged.weights, judged.tokens,
                                          h.manager, trimmed)
            if p.staleness:  # the sum is divided by the undiscounted weights (OuterCore.weight)
                p.total[-1] = judged.divisor if h.manager.errored() is None else 0.0
        return decode_s, judged.refused

    def _failed(self, p: Pending) -> bool:
        """Settle with every member whether the exchange went through everywhere
        (agreement.settle_exchange on each bridge rank's group), then over the island's
        ranks: True when it failed somewhere. Only a failure of a member or link counts;
        refused rows are a verdict every island reached alike."""
        h = self.host
        failed, p.facts = False, []
        if h.manager is not None and p.framing is not None and p.exchanged:
            device = p.buffer.device if p.buffer is not None else torch.device("cpu")
            failed = settle_exchange(h.manager, p.framing, wire_device(h.manager, device),
                                     [p.gathered, p.state.gathered if p.state is not None else None],
                                     self._exchange_fraction(p), p.overlapped, p.facts)
        return h.ranks.max([float(failed)])[0] > 0

    def _exchange_fraction(self, p: Pending) -> float:
        """Decoupled rounds: this exchange's seconds (from its start until its rows were in)
        over this round's compute seconds, in OVERLAP_SCALE units (0: nothing to measure)."""
        h = self.host
        if h.handoffs is None or h.book.compute_s <= 0:
            return 0.0
        if p.repaired is not None:  # the failed attempt, the new quorum and the repair, all of it
            return max(0.0, p.repaired_done - p.started) / h.book.compute_s * OVERLAP_SCALE
        if p.gathered is None:
            return 0.0
        second = p.gathered.second.seconds() if p.gathered.second is not None else 0.0
        return (self._seconds_until_in(p) + second) / h.book.compute_s * OVERLAP_SCALE

    @staticmethod
    def _seconds_until_in(p: Pending) -> float:
        """From the exchange's start until its rows were in: the transport's thread stamped
        that where it can, else the wait for them returned (`judge_rows`)."""
        assert p.gathered is not None
        return seconds_until_in(p.gathered.started or p.started, p.waited, p.gathered.done_at)

    def _attempt_bytes(self, p: Pending) -> tuple[int, int]:
        """(sent, received) bytes of this bridge rank in the pending attempt of the exchange."""
        sent = received = 0
        if p.gathered is not None:
            sent, received = p.gathered.sent, p.gathered.received
        if p.state is not None:  # the rows of moments
            sent, received = sent + p.state.sent, received + p.state.received
        if p.repaired is not None:  # the segment repair's parts, tables and sums
            sent, received = sent + p.repaired.sent, received + p.repaired.received
        return sent, received

    # ---- after a failed attempt ------------------------------------------------------

    def _retry(self, p: Pending, attempt: int) -> Pending:
        """Run a failed exchange again with the members left: a new quorum through the usual
        path (healing, state claims, fingerprints), the same pseudo-gradient, tokens and
        weight, in frames signed for the new quorum. If the federation went on without this
        island meanwhile (it healed), the round is planned again from the new quorum."""
        h = self.host
        log.warning("the exchange of outer step %d failed (%s); running it again with a new quorum "
                    "(retry %d of %d, fault_tolerance.exchange_retries)", p.outer_step + 1, self._failure(), attempt,
                    h.ft.exchange_retries)
        old, old_members = p.gathered, p.members
        self._forget(p)
        began = time.perf_counter()
        m = h.enter_quorum(again=True)
        log.info("outer step %d: a new quorum of %d island(s) after %.2f s; exchanging again", p.outer_step + 1,
                 m.participants, time.perf_counter() - began)
        if not keeps_pending(m, p.outer_step):
            self._give_back(p)
            if h.handoffs is not None:  # decoupled: it healed; the row after this one is void too
                h.handoffs.sends_nothing = True
            fresh = h.start_round(m, p.joining)
            fresh.prepare_s, fresh.started, fresh.spent = p.prepare_s, p.started, p.spent
            return fresh
        if h.codec_name == "auto" and p.buffer is not None:  # the members' collectives of a round, in order
            h.auto.rechoose(h.codecs[p.fragment], p.buffer.device)
        survivors = self._survivors(p, m, old, old_members)
        if survivors is None or old is None:
            self.start(p, m)
        else:
            self._repair(p, m, old, old_members, survivors)
        return p

    def _survivors(self, p: Pending, m: Membership, old: Gathered | None, old_members: list[str]) -> list[int] | None:
        """The old replica ranks of the retry's quorum `m` when the failed attempt can be
        finished by the segment repair (exchange_repair = "segment": a dense two-phase
        exchange on gloo, the new quorum exactly some of the old members in the same order), else
        None (the exchange runs again whole). Every member decides alike: the config, the
        two quorums and the codec's choice are the same on all of them."""
        h = self.host
        if (h.ft.exchange_repair != "segment" or h.codec_name == "auto" or h.codecs[p.fragment].sparse
                or not p.exchanged):
            return None
        if old is None or old.segments is None or h.manager is None:  # not two-phase, or not a bridge rank
            return None
        if p.buffer is None or wire_device(h.manager, p.buffer.device).type != "cpu":  # parts cross on gloo
            return None
        new = list(getattr(h.manager, "_archipelago_replica_ids", None) or [])
        survivors = [j for j, member in enumerate(old_members) if member in new]
        if (len(old_members) != len(old.segments) or new != [old_members[j] for j in survivors]
                or len(new) != m.participants or len(survivors) < 2 or old.rank not in survivors
                or survivors.index(old.rank) != m.participant_rank):
            return None
        return survivors

    def _repair(self, p: Pending, m: Membership, old: Gathered, old_members: list[str], survivors: list[int]) -> None:
        """Finish the failed exchange by the segment repair (repair.py) among the survivors
        of quorum `m`, in frames signed for it; averaged moments are exchanged again whole,
        after it. A repair that fails reports to the manager: the members then settle that
        this attempt failed too, and the next retry (if any) runs the exchange again whole."""
        h = self.host
        framing = self._frame(p, m)
        assert p.buffer is not None
        named = [member_island(h.key, member) for member in old_members]
        islands = named if min(named) >= 0 else None  # ids that name no island: the tables' claims alone
        began = time.perf_counter()
        try:
            p.repaired, p.repaired_table = repair_first_phase(h.manager, h.codecs[p.fragment], old, framing,
                                                              p.buffer[:-2], p.tokens, p.weight, survivors, islands)
        except RepairRefused as exc:
            if h.manager.errored() is None:
                h.manager.report_error(exc)
            log.warning("outer step %d: the segment repair failed (%s)", p.outer_step + 1, exc)
        else:
            log.info("outer step %d: the segment repair among %d survivor(s) sent %d bytes in %.2f s instead of "
                     "running the exchange again (fault_tolerance.exchange_repair)", p.outer_step + 1,
                     len(survivors), p.repaired.sent, time.perf_counter() - began)
        self._start_moments(p, framing)

    def _forget(self, p: Pending) -> None:
        """What a failed attempt leaves: its bytes counted, the codec's state as it was before."""
        sent, received = self._attempt_bytes(p)
        p.spent = (p.spent[0] + sent, p.spent[1] + received)
        if p.codec_state is not None:
            self.host.codecs[p.fragment].load_state_dict(p.codec_state)
        self._hold(p)
        p.gathered, p.state, p.total, p.judged = None, None, None, None
        p.repaired, p.repaired_table, p.repaired_done = None, None, 0.0

    def _hold(self, p: Pending) -> None:
        """Keep a failed attempt's buffers alive (see `abandoned`)."""
        self.abandoned = [*self.abandoned, take_handed(self.host.manager)][-ABANDONED_HELD:]

    def _give_back(self, p: Pending) -> None:
        """A round abandoned for a new plan: top-k's residue it took goes back to the codec."""
        if p.residue is not None:
            self.host.codecs[p.fragment].give_back(p.residue)  # type: ignore[attr-defined]
            p.residue = None

    def _lose_round(self, p: Pending) -> None:
        """The exchange failed somewhere and no retry is left: no island of the federation
        commits this round (the manager's error makes this island's vote say no)."""
        manager = self.host.manager
        self._hold(p)  # the round ends, but the transport may write on
        log.warning("the exchange of outer step %d failed (%s) and no retry is left "
                    "(fault_tolerance.exchange_retries = %d): the round is lost", p.outer_step + 1, self._failure(),
                    self.host.ft.exchange_retries)
        if manager is not None and manager.errored() is None:
            manager.report_error(RuntimeError("another member's exchange failed (agree_on_exchange)"))

    def _failure(self) -> str:
        manager = self.host.manager
        error = manager.errored() if manager is not None else None
        cause = getattr(error, "original_exception", error)
        return f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}" if cause is not None else \
            "it failed on another bridge rank or island"
