"""The outer loops between the quality simulator's islands (quality_simulator.py), in lockstep:
`Outer`, the platform's synchronous rounds (and streaming fragments), and `Decoupled`, its
decoupled rounds (hand-offs, staleness, `arrival_steps`, thin islands carried by a member).
Both drive the platform's collective-free `OuterCore`; `decoded_row` and `as_received` give each row
and each sum as the platform's receivers decode them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from archipelago.config import Config
from archipelago.federation.codecs import Codec, build_codec, effective_codec, schedule_round
from archipelago.federation.exchange import Framing, summed_as_received
from archipelago.federation.inner_state import WIRE_DTYPES
from archipelago.federation.outer_core import Carried, OuterCore


class Island(Protocol):
    """What the outer loops read and write of a simulated island (quality_simulator._Island)."""

    fragments: list[list[torch.nn.Parameter]]
    fragment_tokens: list[int]
    codecs: list[Codec]
    optimizer: Any

    def flat(self, fragment: int) -> torch.Tensor: ...

    def write(self, fragment: int, flat: torch.Tensor) -> None: ...

    def moments(self, fragment: int) -> list[torch.Tensor]: ...

    def write_moments(self, fragment: int, flats: list[torch.Tensor]) -> None: ...


def decoded_row(island: Island, fragment: int, pseudo: torch.Tensor, codec_name: str) -> tuple[torch.Tensor, int]:
    """The pseudo-gradient as every receiver decodes it, and its row's bytes (tokens and
    weight, then the payload)."""
    payload = 4 * pseudo.numel()
    if codec_name != "fp32":
        codec = island.codecs[fragment]
        pseudo = codec.decode(codec.encode(pseudo))
        payload = codec.payload_bytes()
    return pseudo, Framing().row_bytes(payload)


def as_received(codec_name: str, island: Island, fragment: int, total: torch.Tensor,
                 participants: int) -> torch.Tensor:
    """An exchange's weighted sum as every island receives it (`exchange.summed_as_received`:
    the reduce-scatter rounds each summed segment again)."""
    if codec_name == "fp32":
        return total
    return summed_as_received(island.codecs[fragment], total, participants)


class Outer:
    """The outer loop between the simulated islands (OuterLoop's semantics, in lockstep)."""

    def __init__(self, cfg: Config, islands: Sequence[Island]) -> None:
        self.ft, self.islands = cfg.fault_tolerance, islands
        n = len(islands[0].fragments)
        self.core = OuterCore(self.ft, [islands[0].flat(f) for f in range(n)])
        self.globals = self.core.globals
        self.codec = effective_codec(self.ft)
        if self.codec == "auto":
            raise ValueError("codec = \"auto\" chooses by the link between islands, which this in-process "
                             "simulator has none of: give the codec to compare (fp32, bf16, int8 or topk)")
        for island in islands:
            island.codecs = [build_codec(self.ft, g.numel()) for g in self.globals]
        self.per_fragment = self.ft.sync_steps // n
        # The platform's join round is outer step 1 (it synchronises fragment 0, with nothing
        # in it), so its first round of training synchronises fragment 1 % fragments: count it.
        self.local_step, self.step = 0, 1
        self.pending: tuple[int, torch.Tensor, float] = (0, torch.zeros(0), 0.0)  # set by prepare()
        self.pending_moments: list[torch.Tensor] = []  # average_optimizer_state: weighted sums
        self.round_tokens: list[int] = []  # each island's tokens in the round prepare() took
        self.bytes_sent = 0

    def after_inner_step(self, tokens: Sequence[int]) -> None:
        """One tick of the round's clock, `tokens[i]` trained by island i in it."""
        for island, trained in zip(self.islands, tokens):
            island.fragment_tokens = [t + trained for t in island.fragment_tokens]
        self.local_step += 1
        length = self.round_length()
        if self.local_step == length - self.ft.fragment_sync_delay:
            self.prepare()
        if self.local_step == length:
            self.local_step = 0
            self.perform()

    def round_length(self) -> int:
        """Inner steps in the current round (bench/outer_sweep.py's experiments vary it)."""
        return self.per_fragment

    def prepare(self) -> None:
        """Each island's weighted pseudo-gradient, encoded and decoded, summed in island order."""
        fragment = self.core.fragment(self.step)
        values, weights, self.round_tokens = [], [], []
        for island in self.islands:
            schedule_round(island.codecs[fragment], self.ft, self.step)  # the platform's step: the join's is 0
            pseudo = self.core.pseudo_gradient(fragment, island.flat(fragment))
            weight, _ = self.core.weight(island.fragment_tokens[fragment], contributes=True)
            self.round_tokens.append(island.fragment_tokens[fragment])
            island.fragment_tokens[fragment] = 0
            decoded, sent = decoded_row(island, fragment, pseudo, self.codec)
            self.bytes_sent += sent
            values.append(decoded)
            weights.append(weight)
            if self.ft.average_optimizer_state:  # rounded to the wire's type, as every receiver sees them
                wire = WIRE_DTYPES[self.ft.moments_dtype]
                moments = [m.to(wire).float() * weight for m in island.moments(fragment)]
                self.pending_moments = (moments if island is self.islands[0] else
                                        [a + b for a, b in zip(self.pending_moments, moments)])
                size = torch.finfo(wire).bits // 8 * sum(m.numel() for m in moments)
                self.bytes_sent += Framing().row_bytes(size)  # their row
        total = as_received(self.codec, self.islands[0], fragment, self.core.merge(values, weights), len(self.islands))
        self.pending = (fragment, total, sum(weights))

    @torch.no_grad()
    def perform(self) -> None:
        fragment, total, weights = self.pending
        self.core.apply(fragment, total, weights)
        self.step += 1
        for island in self.islands:
            held = island.codecs[fragment].release_residue() if self.ft.topk_keep_residue else None  # type: ignore[attr-defined]
            island.write(fragment, self.core.island_weights(fragment, island.flat(fragment), held))
        if self.ft.average_optimizer_state and weights > 0:
            for island in self.islands:
                island.write_moments(fragment, [m / weights for m in self.pending_moments])
        if self.ft.adam_federation_batch:  # the federation's tokens per own token, as the platform's
            for island, own in zip(self.islands, self.round_tokens):
                if own:
                    island.optimizer.batch_ratio = max(1.0, sum(self.round_tokens) / own)


@dataclass(eq=False)  # compared by identity (its tensors have no truth value)
class HandOff:
    """A pseudo-gradient handed off and not yet entered (decoupled rounds); a thin island's
    upload until the member carrying it folds it into its own row (`carried`)."""

    entry: int          # the round boundary at which it enters an outer step (an upload: reaches its carrier)
    island: int
    values: torch.Tensor
    tokens: float
    base_step: int      # the outer steps applied when the island took its base weights
    raw: torch.Tensor   # its pseudo-gradient before the codec (the island's own progress)
    carried: list[HandOff] = field(default_factory=list)  # thin islands' uploads folded into this row
    own: bool = True    # False: a row sent only to carry uploads (the end of the run)


class Decoupled:
    """Decoupled rounds between the simulated islands (fault_tolerance.round_mode = "decoupled").

    At every round boundary (each `sync_steps` ticks), in this order: each island whose cycle
    ends hands off its pseudo-gradient (its base weights - its weights), to enter `delays[i]`
    boundaries later (0: at once, as in a synchronous round; 1: the exchange overlaps the next
    round); the contributions due enter one outer step, each discounted by its staleness (the
    outer steps applied since its base); the islands that handed off continue from the new
    global weights minus their own pseudo-gradients still in flight (`OuterCore.rebased`:
    their own progress is not lost while it travels; `eager` False drops it until it
    enters). With every delay 0 this is the synchronous round, bit for bit. With
    `arrival_steps` N > 0 an overlapping exchange (delay 1) enters N inner steps into the next
    round instead, and the islands whose rows entered move to the new global weights plus
    their progress since the hand-off: their next rows start from that outer step.

    A thin island (delay d > 1) is no member of the exchange: every d rounds it uploads its
    row (encoded with its own codec) to a member, the first island with delay 0 or 1, where it
    arrives d rounds later (its link's time); that member folds every upload that has arrived
    into its next row (`OuterCore.fold`, each upload discounted by its own staleness) before
    encoding it, so the upload enters d rounds after it was handed off with a carrier that
    waits for its exchange (delay 0), d + 1 with one whose exchange overlaps the next round.
    At the end of the run uploads still travelling go in one last row of their carrier. The
    quality simulator leaves out that a thin island's download of the global weights also
    takes time (the scale simulator charges it).
    """

    def __init__(self, cfg: Config, islands: Sequence[Island], delays: Sequence[int], eager: bool = True) -> None:
        self.ft, self.islands, self.delays, self.eager = cfg.fault_tolerance, islands, list(delays), eager
        self.arrival = self.ft.arrival_steps
        if not 0 <= self.arrival < self.ft.sync_steps:
            raise ValueError(f"arrival_steps {self.arrival}: from 0 (the next round's end) to sync_steps - 1")
        if len(islands[0].fragments) != 1:
            raise ValueError("decoupled rounds synchronise the whole model at once: num_fragments = 1")
        if self.ft.average_optimizer_state or self.ft.adam_federation_batch:
            raise ValueError("decoupled rounds exchange pseudo-gradients only: set average_optimizer_state and "
                             "adam_federation_batch to false (compare against a synchronous run without them)")
        members = [k for k, d in enumerate(self.delays) if d <= 1]
        if not members:
            raise ValueError("every island has a thin link (delay > 1): at least one member must carry their rows")
        self.carrier = members[0]
        self.core = OuterCore(self.ft, [islands[0].flat(0)])
        self.codec = effective_codec(self.ft)
        if self.codec == "auto":
            raise ValueError("codec = \"auto\" needs links between islands: give the codec to compare")
        for island in islands:
            island.codecs = [build_codec(self.ft, self.core.globals[0].numel())]
        self.bases = [self.core.globals[0].detach().clone() for _ in islands]  # the weights each started from
        self.base_steps = [0] * len(islands)
        self.tokens = [0] * len(islands)
        self.in_flight: list[HandOff] = []
        self.uploads: list[HandOff] = []  # thin islands' rows not yet folded into a member's
        self.local_step, self.boundary, self.step, self.bytes_sent = 0, 0, 0, 0
        self.staleness: list[int] = []  # of every contribution that entered
        self.dropped = 0                # contributions staler than max_staleness

    def after_inner_step(self, tokens: Sequence[int]) -> None:
        for k, trained in enumerate(tokens):
            self.tokens[k] += trained
        self.local_step += 1
        if self.local_step == self.arrival:
            self.arrive()
        if self.local_step == self.ft.sync_steps:
            self.local_step = 0
            self.round_boundary()

    def arrive(self) -> None:
        """`arrival_steps` inner steps into a round: the members' rows handed off at its start enter
        now, and each island whose own row entered moves to the new global weights plus its
        progress since the hand-off (its next row starts from this outer step)."""
        due = [h for h in self.in_flight if h.entry == self.boundary + 1]
        if not due:
            return
        self.boundary += 1  # enter_due takes the rows due at a boundary
        self.enter_due()
        self.boundary -= 1
        for k in sorted({h.island for h in due if h.own}):
            new = self.core.rebased(0, self.own_in_flight(k))
            self.islands[k].write(0, self.islands[k].flat(0) - self.bases[k] + new)
            self.bases[k], self.base_steps[k] = new.clone(), self.step

    def round_boundary(self) -> None:
        self.boundary += 1
        handing = [k for k, d in enumerate(self.delays) if self.boundary % max(d, 1) == 0]
        for k in handing:
            if self.delays[k] > 1:
                self.upload(k)
        for k in handing:  # waited for: enters now
            if self.delays[k] == 0:
                self.hand_off(k)
        self.enter_due()
        for k in handing:  # overlaps the next round; its staleness is known once this step is
            if self.delays[k] == 1:
                self.hand_off(k)
        for k in handing:  # the new global weights, plus its own progress not in them yet
            weights = self.core.rebased(0, self.own_in_flight(k) if self.eager else [])
            self.islands[k].write(0, weights)
            self.bases[k] = weights.clone()
            self.base_steps[k] = self.step

    def upload(self, k: int) -> None:
        """A thin island's row, encoded with its own codec, on its way to its carrier."""
        pseudo = self.core.pseudo_gradient(0, self.islands[k].flat(0), base=self.bases[k])
        values, sent = decoded_row(self.islands[k], 0, pseudo, self.codec)
        self.bytes_sent += sent
        self.uploads.append(HandOff(self.boundary + self.delays[k], k, values, self.tokens[k],
                                     self.base_steps[k], pseudo))
        self.tokens[k] = 0

    def hand_off(self, k: int, own: bool = True) -> None:
        """A member's row, with the uploads that reached it folded in, into the exchange."""
        pseudo = (self.core.pseudo_gradient(0, self.islands[k].flat(0), base=self.bases[k]) if own
                  else torch.zeros_like(self.core.globals[0].detach()))
        tokens, base_step = (self.tokens[k], self.base_steps[k]) if own else (0, self.step)
        arrived = [u for u in self.uploads if k == self.carrier and (not own or u.entry <= self.boundary)]
        self.uploads = [u for u in self.uploads if u not in arrived]
        row, folded = self.core.fold(pseudo, tokens, self.step - base_step, [self.carried(u) for u in arrived])
        values, sent = decoded_row(self.islands[k], 0, row, self.codec)
        self.bytes_sent += sent
        entry = self.boundary + (min(self.delays[k], 1) if own else 1)
        self.in_flight.append(HandOff(entry, k, values, folded, base_step, pseudo, arrived, own))
        if own:
            self.tokens[k] = 0

    def carried(self, upload: HandOff) -> Carried:
        """An upload as its carrier folds it in now (its staleness when the row enters)."""
        return Carried(upload.values, upload.tokens, self.step - upload.base_step)

    def carry_the_rest(self) -> None:
        """Uploads still travelling at the end go in one last row of their carrier."""
        if self.uploads:
            self.hand_off(self.carrier, own=False)

    def own_in_flight(self, k: int) -> list[torch.Tensor]:
        """Island k's pseudo-gradients that have not entered yet (handed off, uploaded, carried)."""
        rows = [h for h in self.in_flight if h.island == k and h.own] + [u for u in self.uploads if u.island == k]
        rows += [c for h in self.in_flight for c in h.carried if c.island == k]
        return [h.raw for h in rows]

    def finish(self) -> None:
        """The end of the run (the platform's `OuterLoop.finish_rounds`): the uploads still
        travelling are carried in, everything in flight enters one outer step, and every
        island takes the global weights."""
        self.carry_the_rest()
        self.enter_due(everything=True)
        for island in self.islands:
            island.write(0, self.core.globals[0].detach().clone())

    def enter_due(self, everything: bool = False) -> None:
        due = sorted((h for h in self.in_flight if everything or h.entry == self.boundary), key=lambda h: h.island)
        self.in_flight = [h for h in self.in_flight if not (everything or h.entry == self.boundary)]
        values, weights, divisor = [], [], 0.0
        for h in due:
            weight, undiscounted = self.core.weight(h.tokens, True, staleness=self.step - h.base_step)
            self.count_entered(h, entered=weight > 0)
            if not weight:
                continue
            values.append(h.values)
            weights.append(weight)
            divisor += undiscounted
        if not values:
            return
        members = sum(d <= 1 for d in self.delays)  # a thin island's row is carried by a member
        total = as_received(self.codec, self.islands[0], 0, self.core.merge(values, weights), members)
        if self.core.apply(0, total, divisor):
            self.step += 1

    def count_entered(self, h: HandOff, entered: bool) -> None:
        """Record the staleness of each contribution in `h` (its own, those it carried), or
        count it dropped."""
        rows = ([h] if h.own else []) + h.carried
        for row in rows:
            staleness = self.step - row.base_step
            if entered and self.core.discount(staleness) > 0 and (row.tokens > 0 or row is h):
                self.staleness.append(staleness)
            else:
                self.dropped += 1


def decoupled_delays(link_ticks: Sequence[int], round_ticks: int, threshold: float) -> tuple[list[int], int]:
    """Decoupled rounds in ticks: (each island's hand-off delay in rounds, the ticks every
    island waits after a round). Islands whose exchange fits in a round are members: when
    the slowest member's exchange takes at most `threshold` of the round they wait for it
    (delay 0, as a synchronous round), else it overlaps the next round (delay 1). A thin
    island's exchange spans ceil(ticks / round) rounds (its delay and its cycle)."""
    members = [t for t in link_ticks if t <= round_ticks]
    slowest = max(members, default=0)
    waits = threshold > 0 and slowest <= threshold * round_ticks  # 0: always overlap
    delays = [(0 if waits else 1) if t <= round_ticks else math.ceil(t / round_ticks) for t in link_ticks]
    return delays, slowest if waits else 0
