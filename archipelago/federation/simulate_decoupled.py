"""`archipelago simulate` for `fault_tolerance.round_mode = "decoupled"`: islands that never wait.

The synchronous round (simulate.py) makes every island wait for the round's exchange, which
lasts as long as the slowest link, and a failure inside it costs the round (or, with
`exchange_retries`, a detection and a new exchange). In decoupled rounds, as the quality
simulator (archipelago/simulated_rounds.py `Decoupled`) trains them:

1. Rounds start every R seconds (`round_seconds` under time pacing; `sync_steps` inner
   steps of the median island under step pacing). At each start every island that is up
   hands off its pseudo-gradient (the tokens it trained since its last hand-off) and
   trains on at once: its exchange overlaps its next interval. Unless the members'
   exchange takes at most `overlap_threshold` of R: then they wait for it, as in a
   synchronous round, and the next round starts R after it ends.
2. The islands whose exchange in such a round fits in R ("members") run it together:
   the exchange's bytes (`exchange.round_received` for that many members) over the slowest
   member's link, plus a latency per phase. A member that dies in it is dropped and the
   others run it again after `detect_s` (`exchange_retries` times at most; then the round's
   contributions are lost). The outer step is applied when the exchange ends.
3. An island whose link cannot carry a round's exchange in R ("thin") stays out of the
   members' exchange: every C rounds it uploads its row (the codec's payload) to a member,
   which carries it into the next round's exchange, and downloads the global weights in
   bf16; C is the smallest number of rounds its link needs for both. It trains throughout.
   With `arrival_steps` N, each member applies that outer step N of its inner steps into
   the next round instead of at its end, idling there until the exchange ends if it has
   not, and trains on from it: its next contribution holds the idle seconds less, and
   starts from that outer step (not stale).
4. A contribution's staleness is the number of outer steps applied between the global
   weights it started from (its previous hand-off, or the start of its heal) and the one it
   enters; one staler than `max_staleness` is left out (`OuterCore`'s rule: outer_core.py).
5. A failure loses the island's progress since its last hand-off, and its contribution in
   flight if the exchange (or its upload) had not ended; it is down `restart_s`, then heals
   (downloads the global state) and trains on.

Goodput counts the tokens of the contributions that entered an outer step (undiscounted);
the staleness of each is reported beside it. Left out, as in simulate.py: the training
itself, step-time jitter, the lighthouse's latency; and here also the bytes a member spends
carrying thin islands' rows, and the quorum each round's exchange needs (one per round).
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

from archipelago.federation.codecs import build_codec
from archipelago.federation.exchange import Framing
from archipelago.federation.outer_core import staleness_discount
from archipelago.federation.simulate import CODEC_SAMPLE_VALUES, Report, Scenario, Simulation


@dataclass
class _Contribution:
    island: int
    tokens: int
    seconds: float          # the inner-step seconds it holds
    base_s: float           # when the island took the global weights it started from
    ready_s: float          # when it can enter (its round's exchange ends; a thin island's upload is done)
    lost: bool = False
    placed: bool = True     # in a round's exchange (a thin island's row: once a member carries it)


class DecoupledSimulation(Simulation):
    """One scenario's run in decoupled rounds (see the module docstring)."""

    def __init__(self, scenario: Scenario, fail_at: list[tuple[int, float]] | None = None) -> None:
        super().__init__(scenario, fail_at)
        intervals = [self.steps[g.step_s] * g.step_s for g in self.islands]
        self.period = (self.ft.round_seconds if self.ft.round_pacing == "time"
                       else statistics.median(intervals))
        self.thin = self._thin_islands()
        self.members = [k for k in range(len(self.islands)) if k not in self.thin]
        self.row_bytes = self._row_bytes()
        self.cycle = {k: max(1, math.ceil(self._thin_link_s(k) / self.period)) for k in self.thin}
        # A short exchange (overlap_threshold of the round) is waited for, as in a synchronous
        # round: its contributions enter fresh; a longer one overlaps the next round.
        limit = self.ft.overlap_threshold * self.period
        self.waits = limit > 0 and self._member_exchange_s(self.members) <= limit

    # ---- who exchanges how --------------------------------------------------------

    def _member_exchange_s(self, members: list[int]) -> float:
        """The members' exchange, over the slowest member's link."""
        return self._exchange_s(len(members), members)

    def _thin_islands(self) -> set[int]:
        """Islands whose link cannot carry the members' exchange within a round."""
        thin: set[int] = set()
        while True:
            members = [k for k in range(len(self.islands)) if k not in thin]
            if len(members) < 2:
                return thin
            count = len(members)
            slow = {k for k in members if self._exchange_s(count, [k]) > self.period}
            if not slow or len(members) - len(slow) < 1:
                return thin
            thin |= slow

    def _row_bytes(self) -> float:
        """One island's row (the codec's payload and framing), scaled to the model."""
        params = self.s.settings.params
        sample = build_codec(self.round_ft(len(self.members) or 1), min(params, CODEC_SAMPLE_VALUES))
        return Framing().row_bytes(sample.payload_bytes()) * params / sample.numel

    def _thin_link_s(self, k: int) -> float:
        """A thin island's upload of its row and download of the global weights in bf16."""
        g = self.islands[k]
        return (self.row_bytes + 2 * self.s.settings.params) * 8 / (g.bandwidth_mbit * 1e6) + 2 * g.latency_ms / 1e3

    # ---- the run ------------------------------------------------------------------

    def run(self) -> Report:
        horizon = self.s.settings.hours * 3600
        n = len(self.islands)
        since = [0.0] * n        # trains since (its last hand-off, or its heal's end)
        base = [0.0] * n         # took the global weights it trains on at
        handoffs = [0] * n       # hand-offs since it (re)started (thin islands' cycles)
        contributions: list[_Contribution] = []
        step_ends: list[float] = []
        rounds = lost_rounds = 0
        self.by_island: list[list[_Contribution]] = [[] for _ in range(n)]
        unplaced: list[_Contribution] = []  # thin islands' rows not yet in a round
        t = self.period
        while t <= horizon:
            for at, k in self._failures_until(t):
                self._down(k, at, since, base, handoffs)
            live = [k for k in range(n) if self.up_at[k] <= t and since[k] < t]
            mine: list[_Contribution] = []
            for k in live:
                if k in self.thin and (handoffs[k] + 1) % self.cycle[k]:
                    handoffs[k] += 1
                    continue
                handoffs[k] += 1
                c = self._hand_off(k, t, since, base)
                contributions.append(c)
                self.by_island[k].append(c)
                (unplaced if k in self.thin else mine).append(c)
            members = [c.island for c in mine]
            if members:
                rounds += 1
                end, dead, lost = self._run_exchange(t, members)
                carried = [c for c in unplaced if not c.lost and c.ready_s <= t]
                unplaced = [c for c in unplaced if not c.lost and c.ready_s > t]
                for c in mine + carried:
                    c.lost, c.ready_s, c.placed = c.lost or lost or c.island in dead, end, True
                lost_rounds += lost
                if not lost:
                    step_ends.append(end)
                for k in members:
                    self.stats[k].received += self.received(len(members))
                if self.waits:  # a short exchange is waited for: the members go on from its result
                    for k in members:
                        since[k] = base[k] = max(since[k], end)
                    t = end
                elif self.ft.arrival_steps:
                    self._arrive(t, end, lost, members, since, base)
            t += self.period
        return self._report(contributions, sorted(step_ends), rounds, lost_rounds, horizon)

    def _hand_off(self, k: int, t: float, since: list[float], base: list[float]) -> _Contribution:
        g = self.islands[k]
        seconds = math.floor((t - since[k]) / g.step_s + 1e-9) * g.step_s  # whole steps (not lost to rounding)
        c = _Contribution(k, round(seconds / g.step_s) * g.tokens_per_step, seconds, base[k], t)
        if k in self.thin:
            c.ready_s = t + self.row_bytes * 8 / (g.bandwidth_mbit * 1e6)  # its upload
            c.placed = False
            self.stats[k].received += 2 * self.s.settings.params
        since[k], base[k] = t, t
        return c

    def _arrive(self, t: float, end: float, lost: bool, members: list[int], since: list[float],
                base: list[float]) -> None:
        """`arrival_steps`: each member applies the exchange handed off at `t` that many of its
        inner steps later, idle until `end` if it is still travelling (its next contribution
        holds those seconds less), and trains on from its outer step (unless it was lost)."""
        for k in members:
            arrival = t + self.ft.arrival_steps * self.islands[k].step_s
            since[k] += max(0.0, end - arrival)
            if not lost:
                base[k] = end

    def _run_exchange(self, start: float, members: list[int]) -> tuple[float, set[int], bool]:
        """The members' exchange from `start` (Simulation._exchange over their own links):
        (its end, members that died in it, lost). Failures are only looked at here, not
        taken: each island's own failure is applied when the clock reaches it."""
        group = set(members)
        failing: dict[int, float] = {}
        for at, k in self.failures:
            if k in group and at >= start and at < failing.get(k, math.inf):
                failing[k] = at
        end, dead, lost = self._exchange(start, members, failing, self._member_exchange_s)
        return end, set(dead), lost

    def _down(self, k: int, at: float, since: list[float], base: list[float], handoffs: list[int]) -> None:
        """Island k fails at `at`: its progress since its hand-off is lost, and its contribution
        still in flight (its round's exchange, or its upload, not over); then restart and heal."""
        at = max(at, self.up_at[k])
        self.stats[k].wasted_s += max(0.0, at - since[k])
        for c in reversed(self.by_island[k]):
            if c.ready_s <= at:
                break
            c.lost = True
        self._fail(k, at)
        heal = self._heal_s(k)
        self.stats[k].heal_s += heal
        base[k] = self.up_at[k]
        self.up_at[k] += heal
        since[k] = self.up_at[k]
        handoffs[k] = 0

    def _report(self, contributions: list[_Contribution], step_ends: list[float], rounds: int, lost: int,
                horizon: float) -> Report:
        staleness, dropped = [], 0
        for c in contributions:
            if c.lost or not c.placed:  # lost, or a thin island's row no round carried before the end
                self.stats[c.island].wasted_s += c.seconds
                continue
            s = bisect.bisect_left(step_ends, c.ready_s) - bisect.bisect_right(step_ends, c.base_s)
            if staleness_discount(max(s, 0), self.ft.staleness_exponent, self.ft.max_staleness) == 0:
                dropped += 1
                self.stats[c.island].wasted_s += c.seconds
                continue
            staleness.append(max(s, 0))
            self.stats[c.island].compute_s += c.seconds
            self.stats[c.island].tokens += c.tokens
        ideal = sum(horizon / g.step_s * g.tokens_per_step for g in self.islands)
        return Report(self.s.settings.hours, rounds, len(step_ends), lost, sum(s.tokens for s in self.stats),
                      ideal, self.stats, ended_s=step_ends[-1] if step_ends else 0.0, staleness=staleness,
                      dropped=dropped, thin=len(self.thin))

