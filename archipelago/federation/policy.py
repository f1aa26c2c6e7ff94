"""Every decision of a round, as pure functions of typed values.

The outer loop (diloco.py) gathers facts with collectives and torchft, asks this module
what they mean, and applies the answer. Nothing here talks to the network, torchft,
torch.distributed or the operating system, so each decision is unit-tested in
microseconds, and the simulator reuses them.

A round of one island, in order:

1. `Membership`: what the quorum told the island (its ranks combine their views with an
   element-wise max, see `Membership.to_values`).
2. `must_wait`: a new federation waits until enough islands are present.
3. `part_in_round`: which fragment, and whether the island's own progress counts.
4. `judge_pseudo_gradient`: whether the island's pseudo-gradient may enter the average (the
   sender's own check; `judge_contributions` is every receiver's, after the exchange).
5. `outer_core.contribution_weight`: its weight in the average.
6. `skips_exchange`: whether the exchange can be left out altogether.
7. `exchange_agreed` / `retries_exchange` / `keeps_pending`: whether every member
   completed the exchange, and if not, whether to run it again with a new quorum and
   whether this island's pending pseudo-gradient still belongs to the round
   (`segment_repair`: what a reduce-scatter's first phase sends again instead, with
   `exchange_repair = "segment"`; repair.py moves it).
8. `RoundResult` / `applies_outer_step`: after the exchange and the vote, what to do.

Time-paced rounds end by `round_is_up`; a healed island continues at `aligned_inner_step`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# The guard's median needs a few accepted rounds before it means anything; until then only
# non-finite pseudo-gradients are refused. The window follows the norm as training goes on.
GUARD_MIN_HISTORY = 3
GUARD_HISTORY = 32


@dataclass(frozen=True)
class Membership:
    """The island's view of the quorum at the start of a round (the same on every rank)."""

    outer_step: int = 0         # the federation's outer step count before this round
    healed: bool = False        # the island received the global state from a peer
    progress_void: bool = False  # ...whose weights differed: its own progress since is void
    peer_inner_step: int = 0    # the inner step of the peer it healed from (0 if not healed)
    participants: int = 0       # islands in the quorum
    participant_rank: int = -1  # this island's rank among the participants (-1: not one; torchft's replica rank)
    heal_refused: bool = False  # a bridge rank refused the state it was sent (heal_verdict)

    @property
    def leads(self) -> bool:
        """The lowest live island: the one that saves the model under checkpoint.scope = "leader"."""
        return self.participant_rank == 0

    def to_values(self) -> list[float]:
        """Numbers whose element-wise max over the island's ranks is the island's view:
        only bridge ranks know the quorum, the others send `Membership()` (all lowest)."""
        return [float(self.outer_step), float(self.healed), float(self.progress_void),
                float(self.peer_inner_step if self.healed else 0), float(self.participants),
                float(self.participant_rank + 1), float(self.heal_refused)]

    @classmethod
    def from_values(cls, values: Sequence[float]) -> Membership:
        step, healed, void, peer, participants, rank, heal_refused = values
        return cls(int(step), bool(healed), bool(void), int(peer) if healed else 0,
                   int(participants), int(rank) - 1, bool(heal_refused))


def must_wait(m: Membership, need: int) -> bool:
    """A new federation (outer step 0) waits for `need` islands; every island of the
    quorum sees the same count, so none is left alone in an exchange."""
    return m.outer_step == 0 and m.participants < need


@dataclass(frozen=True)
class RoundPart:
    """This island's part in the round about to start."""

    fragment: int       # the fragment this round synchronises
    reset: bool         # discard the island's local progress: take every fragment's global weights
    contributes: bool   # the island's pseudo-gradient may enter the average (if the guard agrees)


def fragment_of(outer_step: int, fragments: int) -> int:
    """The fragment the round after `outer_step` synchronises (streaming DiLoCo's order)."""
    return outer_step % fragments


def part_in_round(m: Membership, joining: bool, fragments: int) -> RoundPart:
    """A joining island only receives; a healed one whose own weights were stale, too."""
    reset = m.progress_void or (joining and m.healed)
    return RoundPart(fragment=fragment_of(m.outer_step, fragments), reset=reset, contributes=not (reset or joining))


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str | None = None  # why not, when not


def judge_pseudo_gradient(norm: float, accepted_norms: Sequence[float], limit: float) -> Verdict:
    """The guard: refuse a non-finite pseudo-gradient, or one whose norm is above `limit` x the
    median of the norms accepted before (once there are GUARD_MIN_HISTORY of them;
    `limit` 0 turns the norm check off)."""
    if not math.isfinite(norm):
        return Verdict(False, "non-finite values")
    if limit > 0 and len(accepted_norms) >= GUARD_MIN_HISTORY:
        median = statistics.median(accepted_norms)
        if norm > limit * median:
            return Verdict(False, f"norm {norm:.4g} is above {limit:g} x the running median {median:.4g}")
    return Verdict(True)


def remember_norm(accepted_norms: list[float], norm: float) -> None:
    """Add an accepted norm to the guard's window (the newest GUARD_HISTORY are kept)."""
    accepted_norms.append(norm)
    del accepted_norms[:-GUARD_HISTORY]


# How a peer's row arrived, as every receiver saw it (exchange.py fills the table).
FRAME_OK = 0         # a plain row, or a frame signed with the federation key for this round
FRAME_UNSIGNED = 1   # not signed with the key, tampered, or a replay: nothing of it was read
FRAME_MALFORMED = 2  # signed, but its payload is not one any codec of ours makes
FRAME_DISPUTED = 3   # refused by the members' receipts (equivocation, or a claim without evidence: receipts.py)


@dataclass(frozen=True)
class Contribution:
    """One island's row of an exchange: what it claims and what it holds, the same on
    every receiver (they judge the same bytes)."""

    tokens: float
    weight: float
    frame: int = FRAME_OK
    finite: bool = True      # every decoded value is finite
    norm: float = 0.0        # of the decoded pseudo-gradient, over the whole fragment
    member: bool = True      # its island matches the federation's reference fingerprint


@dataclass(frozen=True)
class Allowance:
    """What one island may claim in one exchange, from what it declared at the join (its
    tokens per inner step and inner learning rate) and the federation's pacing."""

    max_tokens: float   # its tokens per step x the most inner steps between two exchanges of a fragment
    max_norm: float     # the absolute norm bound (inf: none)


def norm_allowance(limit: float, steps: int, inner_lr: float, numel: int, global_norm: float) -> float:
    """The largest pseudo-gradient norm an honest island can send after `steps` inner steps,
    times `limit`: an Adam-type step moves each weight by about the learning rate (the
    sqrt(numel) term), weight decay or a clipped SGD step by at most the learning rate
    times the weights' norm. `limit` 0 turns the bound off."""
    if limit <= 0 or not math.isfinite(inner_lr) or inner_lr <= 0:
        return math.inf
    return limit * steps * inner_lr * (math.sqrt(numel) + global_norm)


def steps_between_exchanges(round_pacing: str, sync_steps: int, max_inner_steps: int, fragments: int) -> int:
    """The most inner steps an island trains between two exchanges of one fragment."""
    return sync_steps if round_pacing == "steps" else max_inner_steps * fragments


def judge_contributions(rows: Sequence[Contribution], allowances: Sequence[Allowance], weighting: str,
                        limit: float) -> list[Verdict]:
    """Every receiver's verdict on every island's row (the same on every island).

    A row is refused when it is not signed for this round, its payload is malformed or
    not finite, its tokens or weight are not finite, negative or beyond its allowance,
    its norm is above its absolute bound, or, with three or more contributors, above
    `limit` x the median of the other contributors' norms. A row of weight 0 (a joining
    or healed island) is only checked for its frame and claims.
    """
    verdicts = [_judge_one(row, allowance, weighting) for row, allowance in zip(rows, allowances)]
    live = [k for k, (row, v) in enumerate(zip(rows, verdicts)) if v.accepted and row.weight > 0]
    if limit > 0 and len(live) >= 3:
        for k in live:
            median = statistics.median(rows[j].norm for j in live if j != k)
            if rows[k].norm > limit * median:
                verdicts[k] = Verdict(False, f"norm {rows[k].norm:.4g} is above {limit:g} x the median "
                                             f"{median:.4g} of the other islands' norms")
    return verdicts


def _judge_one(row: Contribution, allowance: Allowance, weighting: str) -> Verdict:
    if not row.member:
        return Verdict(False, "its island does not match the federation (model or settings differ from the "
                              "majority's fingerprint)")
    if row.frame == FRAME_UNSIGNED:
        return Verdict(False, "not signed with the federation key for this round (or tampered, or a replay)")
    if row.frame == FRAME_DISPUTED:
        return Verdict(False, "refused by the members' receipts of this exchange (the log line 'receipts of "
                              "outer step ...' says why)")
    if row.frame != FRAME_OK:
        return Verdict(False, "a malformed payload")
    for name, value in (("tokens", row.tokens), ("weight", row.weight)):
        if not math.isfinite(value) or value < 0:
            return Verdict(False, f"{name} {value:g} is not a finite number >= 0")
    if row.tokens > allowance.max_tokens:
        return Verdict(False, f"tokens {row.tokens:g} are more than its declared batch and the pacing allow "
                              f"({allowance.max_tokens:g})")
    most = 1.0 if weighting == "equal" else allowance.max_tokens
    if row.weight > most:
        return Verdict(False, f"weight {row.weight:g} is more than {weighting} weighting allows ({most:g})")
    if row.weight == 0:
        return Verdict(True)
    if not row.finite:
        return Verdict(False, "non-finite values")
    if row.norm > allowance.max_norm:
        return Verdict(False, f"norm {row.norm:.4g} is above the absolute bound {allowance.max_norm:.4g} "
                              "(outer_norm_limit x inner steps x inner lr x (sqrt(numel) + global norm))")
    return Verdict(True)


def skips_exchange(joining: bool, outer_step: int, init_sync: bool) -> bool:
    """The join round of a new federation with init_sync off: every island of the quorum
    is joining and sends weight 0, so the sum is known without the network. With
    init_sync on, the exchange stays: it keeps the serving peers up until every bridge
    rank has downloaded the starting state."""
    return joining and outer_step == 0 and not init_sync


EXCHANGE_COMPLETED = 1.0  # an island's flag in the agreement after an exchange: its exchange went through


def exchange_agreed(flags: Sequence[float | None] | None, participants: int) -> bool:
    """Did every member of the quorum complete the exchange? `flags`: each member's flag in
    the agreement collective, by replica rank (EXCHANGE_COMPLETED: no member or link
    failed it; a refusal of rows is a verdict, not a failure, and counts as completed; None:
    a flag not signed with the federation's key for this round, whose island has no say, as
    its rows have no weight: an outsider in the quorum could otherwise fail every round);
    None instead of a list when that collective itself failed here. Members that see the
    same flags decide alike, so either all commit the same rows or all run the exchange
    again."""
    return (flags is not None and len(flags) == participants
            and all(flag is None or flag == EXCHANGE_COMPLETED for flag in flags))


def retries_exchange(agreed: bool, attempt: int, retries: int) -> bool:
    """Run a failed exchange again, with a new quorum of the members left, while fewer than
    `retries` (fault_tolerance.exchange_retries) retries were made; `attempt` counts the
    retries made so far (0 for the round's first exchange). Otherwise the round is lost."""
    return not agreed and attempt < retries


def keeps_pending(m: Membership, step: int) -> bool:
    """After a failed exchange at outer `step`, the retried quorum `m` still runs this
    island's round: the federation is at the same step and sent it no state. Otherwise
    (a member committed the round without it, and this island healed from it; or a
    joining island was sent the state only now) the round is planned again from `m`."""
    return m.outer_step == step and not m.healed


@dataclass(frozen=True)
class SegmentRepair:
    """How the survivors finish a reduce-scatter's first phase after members died in it."""

    summers: tuple[tuple[int, ...], ...]  # each segment's parts, in order: the survivor summing each
    sends: tuple[tuple[int, int, int, int], ...]  # (sender, summer, segment, part): what travels again


def segment_repair(alive: Sequence[bool], holds: Sequence[Sequence[bool]]) -> SegmentRepair:
    """The first phase, repaired instead of run again: `alive[j]`, whether member j (by
    replica rank) survived; `holds[k][j]`, whether segment k's summer (member k) holds
    member j's segment k whole (each frame's signature says so), as the survivors agreed
    on it. A live summer keeps what it holds and receives only the live senders' segments
    it lacks (its segment is one part). A dead summer's segment is cut into one part per
    survivor, in replica order, each summed by that survivor, and every survivor sends each
    other survivor its part of that segment: each then sends and receives about 1/N of a
    row more, where one heir of the whole segment would receive a whole row (a phase's
    length, not 1/N of it). So the repaired round sums exactly the survivors' rows, as a
    restart would, sending only the bytes that did not arrive; every survivor computes the
    same plan. The dead members' rows are left out, as in a restart."""
    members = len(alive)
    if len(holds) != members or any(len(row) != members for row in holds):
        raise ValueError("holds must be one row of `members` flags per segment")
    live = tuple(j for j in range(members) if alive[j])
    if not live:
        raise ValueError("no member survived: nothing to repair")
    summers: list[tuple[int, ...]] = []
    sends: list[tuple[int, int, int, int]] = []
    for k in range(members):
        if alive[k]:
            summers.append((k,))
            sends += [(j, k, k, 0) for j in live if j != k and not holds[k][j]]  # its own row is local
            continue
        summers.append(live)
        sends += [(j, summer, k, part) for part, summer in enumerate(live) for j in live if j != summer]
    return SegmentRepair(tuple(summers), tuple(sends))


@dataclass(frozen=True)
class RoundResult:
    """What the exchange and the vote gave (the same on every rank of the island)."""

    committed: bool = False
    participants: int = 0
    total_weight: float = 0.0    # the sum of the weights of the islands that sent progress
    federation_tokens: int = 0   # tokens the federation trained in the round

    def to_values(self) -> list[float]:
        return [float(self.committed), float(self.participants), self.total_weight, float(self.federation_tokens)]

    @classmethod
    def from_values(cls, values: Sequence[float]) -> RoundResult:
        committed, participants, total, tokens = values
        return cls(bool(committed), int(participants), float(total), int(tokens))


def applies_outer_step(result: RoundResult) -> bool:
    """Step the global weights only after a commit, and only if somebody sent progress
    (e.g. not when every island just healed)."""
    return result.committed and result.total_weight > 0


def merges_local(result: RoundResult, reset: bool, alpha: float) -> bool:
    """Streaming DiLoCo's `fragment_update_alpha`: blend the island's own fragment into
    the new global one, unless the round failed or its local progress is void."""
    return result.committed and not reset and alpha > 0


def round_is_up(local_step: int, min_inner_steps: int, max_inner_steps: int, elapsed_s: float,
                step_s: float, round_seconds: float) -> bool:
    """Time pacing: end the round now? At `max_inner_steps`, never before `min_inner_steps`,
    else when the next step would end further past `round_seconds` than this one ends
    before it (the expected overrun is half a step, not one)."""
    if local_step >= max_inner_steps:
        return True
    if local_step < min_inner_steps:
        return False
    return elapsed_s + step_s / 2 >= round_seconds


def aligned_inner_step(peer_inner_step: int, fragment_sync_delay: int) -> int:
    """After healing: the peer's inner step. It sent it at the start of the round, and both
    have since trained the round's `fragment_sync_delay` steps."""
    return peer_inner_step + fragment_sync_delay


def claimed_step(fp: dict) -> int:
    """The outer step a peer claims in its fingerprint or state claim: a whole number >= 0,
    else -1 (a float, a string or a bool claims nothing, and never crashes a comparison)."""
    step = fp.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else -1


def reference_fingerprint(table: Sequence[dict], groups: Sequence[int], me: int) -> dict:
    """The fingerprint this island (`table[me]`) must match to train with the others.

    `groups[k]` numbers the distinct fingerprints (equal numbers: the fields every island
    must agree on are equal). A group of more than half of the members is the reference,
    whatever its members claim about their steps: one dishonest member cannot make the
    honest ones look odd. Without such a majority, an island that has committed a round in
    this process ("established") keeps its own fingerprint and goes on (refusing the
    others' rows); a fresh one follows the largest group with an established member, then
    the old rule: the island furthest ahead, then the lowest island id.
    """
    sizes = {g: groups.count(g) for g in set(groups)}
    largest = max(sizes.values())
    if 2 * largest > len(groups):
        return next(fp for fp, g in zip(table, groups) if sizes[g] == largest)
    if table[me].get("established") is True:
        return table[me]
    tied = [k for k, g in enumerate(groups) if sizes[g] == largest]

    def rank(k: int) -> tuple[bool, int, int]:
        fp = table[k]
        island = fp.get("island")
        island = island if isinstance(island, int) and not isinstance(island, bool) else 1 << 62
        established = any(table[j].get("established") is True for j in tied if groups[j] == groups[k])
        return established, claimed_step(fp), -island

    return table[max(tied, key=rank)]


def bounded_batches(declared: Sequence[float], ratio: float) -> list[float]:
    """Each island's tokens per inner step as the receivers count it: what it declared, but
    at most `ratio` x the median of the other islands' declarations (a claim nobody can
    check, so no island may buy itself a dominating weight by declaring a huge batch).
    Alone, or with `ratio` 0, an island's declaration stands."""
    bounded = []
    for k, value in enumerate(declared):
        others = [d for j, d in enumerate(declared) if j != k and d > 0]
        cap = ratio * statistics.median(others) if others and ratio > 0 else math.inf
        bounded.append(min(value, cap))
    return bounded


def agreed_inner_lr(declared: Sequence[float]) -> list[float]:
    """Each island's inner learning rate as the receivers count it for its norm bound: what
    it declared, but at most the lower median of every island's declaration. An honest
    federation trains with one learning rate, so this changes nothing for it; a member that
    declares a huge one (to buy a larger norm allowance) moves the lower median by at most
    one place: with two islands it is the smaller declaration, the honest island's."""
    positive = sorted(d for d in declared if d > 0 and math.isfinite(d))
    cap = statistics.median_low(positive) if positive else math.inf
    return [min(value, cap) for value in declared]


def capped_shares(values: Sequence[float], share: float) -> list[float]:
    """Each accepted row's weight (or tokens) with no row above `share` of them all: row k
    at most share / (1 - share) times the other rows' together, as they claimed them (so
    one member's claim cannot lower another's cap). `share` 1 leaves them alone; at 0.5
    no row outweighs all the others together. A row alone keeps its value (there is
    nothing to outweigh). The same on every island: a pure function of the judged claims."""
    if share >= 1 or sum(1 for v in values if v > 0) < 2:
        return list(values)
    ratio = share / (1 - share)
    total = sum(values)
    return [min(v, ratio * (total - v)) for v in values]


@dataclass(frozen=True)
class StateClaim:
    """What an island says about its own state at a membership change, in a signed frame of
    its own (membership.exchange_claims): its committed outer step, a digest of all a
    healing island would take of this bridge rank's state (its global chunks, their outer
    optimizer state and under decoupled rounds the stale flag: global_weights.state_digest),
    whether its last round committed (`current`), and its counters. A healing island checks
    the state it received against these."""

    step: int = -1
    digest: str = ""
    current: bool = False
    inner_step: int = 0
    federation_tokens: int = 0


def diverged(claims: Sequence[StateClaim], me: int) -> list[int]:
    """The replica ranks whose committed state differs from the one most members claim for
    this island's own step (members whose last round committed, at that step, with a
    digest): after every commit all of them must hold the same state. A tie keeps this
    island's own digest as the reference. Empty when they agree (or nobody can compare)."""
    if not 0 <= me < len(claims) or not claims[me].digest:
        return []
    step = claims[me].step
    peers = [k for k, c in enumerate(claims) if c.step == step and c.current and c.digest]
    counts: dict[str, int] = {}
    for k in peers:
        counts[claims[k].digest] = counts.get(claims[k].digest, 0) + 1
    if len(counts) < 2:
        return []
    reference = max(counts, key=lambda d: (counts[d], d == claims[me].digest))
    return [k for k in peers if claims[k].digest != reference]


def heal_verdict(offer: StateClaim, claims: Sequence[StateClaim], me: int) -> tuple[Verdict, StateClaim]:
    """May a healing island take `offer` (the state a peer sent, its step the quorum's
    highest), given every member's claim (`claims[me]` its own, before healing)? Returns
    the verdict and, when accepted, the counters to take.

    Supporters are the other members that claim exactly that step and that state (its
    digest covers the weights, the outer optimizer state and the decoupled stale flag).
    Contradicting them are the members whose last round committed (`current`) at a lower
    step (they were in the rounds the offer claims to come after), or at the same step with
    another state. The offer is taken when at least one member supports it and no agreeing
    group of current members outnumbers its supporters: one member claiming a step ahead
    of the others, or serving another state (other weights, or their weights with other
    momentum) than the one its peers at that step hold, is refused as soon as two honest
    islands that trained together are present. The counters taken (inner step,
    federation tokens) are the supporters' lower median, not the source's own: a source
    cannot declare the healing island done.
    """
    supporters = [c for k, c in enumerate(claims) if k != me and c.step == offer.step and c.digest == offer.digest]
    if not supporters:
        return Verdict(False, f"no member vouches for the state it was sent (step {offer.step}, state "
                              f"{offer.digest[:12]}: weights, outer optimizer state and stale flag): not even "
                              "its source claims it"), offer
    groups: dict[tuple[int, str], int] = {}
    for c in claims:
        if c.current and 0 <= c.step <= offer.step and (c.step, c.digest) != (offer.step, offer.digest):
            groups[(c.step, c.digest)] = groups.get((c.step, c.digest), 0) + 1
    if groups and max(groups.values()) > len(supporters):
        (step, digest), count = max(groups.items(), key=lambda item: item[1])
        return Verdict(False, f"{count} member(s) that committed their last round together hold step {step} "
                              f"(state {digest[:12]}), only {len(supporters)} vouch for step {offer.step}"), offer
    taken = StateClaim(offer.step, offer.digest, False,
                       statistics.median_low(c.inner_step for c in supporters),
                       statistics.median_low(c.federation_tokens for c in supporters))
    return Verdict(True), taken
