"""`archipelago simulate`: a federation of N islands on a simulated clock, without training.

Islands of given speeds, links and failure rates run rounds as the platform does, with the
platform's own decisions: the round pacing (`policy.round_is_up`), the join (`policy.
part_in_round`: a restarted island heals, then sends weight 0 for a round), the weights
(`outer_core.contribution_weight`), the quorum's minimum (`policy.must_wait`), the exchange's path
and bytes (`exchange.round_received`: the codec's payload sizes, framing and reduce-scatter
choice). What it leaves out: the training itself (no model, no loss), streaming
fragments' overlap, stragglers' jitter (each island's step time is constant) and the
lighthouse's own latency.

A round, as the simulator runs it:

1. The islands up at its start form the quorum (too few: wait for the next to come back).
2. Each trains: `sync_steps` inner steps, or under time pacing until `round_is_up`;
   a returning island first downloads the global state from a peer (heal).
3. The exchange starts when the last island arrives; it takes, over each island's link,
   the bytes that island receives, plus one latency per phase (every phase is an
   all-to-all of the members' own rows: each sends to every other directly), the slowest
   island deciding.
4. An island that fails before the exchange leaves the quorum: the others wait for the
   lighthouse to notice (`detect_s`) if it was still due, and commit without it. A
   failure during the exchange loses the round for every island (no commit).
5. Committed: every contributing island's tokens enter the outer step.

Scenario files are TOML: `[simulation]` (horizon, seed, model size), `[fault_tolerance]`
(the same keys as a run file's, validated the same way) and `[[islands]]` groups (count,
step time, tokens per step, link, failure rate). See docs/scale.md.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from archipelago.config.errors import ConfigError
from archipelago.config.loading import read_toml, section_from_table
from archipelago.config.schema import FaultToleranceConfig
from archipelago.config.validate import fault_tolerance_problems
from archipelago.federation.auto_codec import auto_target_s, choose_round, moments_received, moments_row_bytes
from archipelago.federation.codecs import build_codec, round_fraction
from archipelago.federation.exchange import Framing, round_received, two_phase
from archipelago.federation.outer_core import contribution_weight
from archipelago.federation.policy import Membership, must_wait, part_in_round, round_is_up

# Codec sizes are linear in the model's size; measured on a chunk this large and scaled
# (a top-k codec of the whole model would allocate its error-feedback buffer).
CODEC_SAMPLE_VALUES = 2 ** 20


@dataclass
class SimulationSettings:
    """[simulation]: what is simulated and for how long."""

    hours: float = 24.0
    """Simulated wall-clock time."""
    seed: int = 0
    """Seed of the failure times."""
    params: int = 1_000_000_000
    """Model parameters: the values of every pseudo-gradient (and of the state a healing island downloads)."""
    detect_s: float = 30.0
    """Seconds before the others stop waiting on an island that died before the exchange
    (the lighthouse's heartbeat timeout)."""
    repair: Literal["restart", "segment"] = "restart"
    """How a round's exchange goes on after a member died in it (with `exchange_retries`):
    `restart`, the platform's: the others run the whole exchange again without it; `segment`,
    a design measured here before it is built: only the dead member's segment of a two-phase
    exchange is sent again."""


@dataclass
class IslandGroup:
    """[[islands]]: `count` alike islands."""

    count: int = 1
    """Islands in this group."""
    step_s: float = 1.0
    """Seconds per inner step."""
    tokens_per_step: int = 65536
    """Tokens per inner step (the island's whole batch)."""
    bandwidth_mbit: float = 1000.0
    """The island's WAN link, Mbit/s each way."""
    latency_ms: float = 50.0
    """One-way latency to the other islands."""
    mtbf_hours: float = 0.0
    """Mean time between failures of one island, hours (0: never fails)."""
    restart_s: float = 300.0
    """From a failure to the island's processes running again (then it heals and joins)."""


@dataclass
class Scenario:
    settings: SimulationSettings
    ft: FaultToleranceConfig
    groups: list[IslandGroup]

    @property
    def islands(self) -> list[IslandGroup]:
        """One entry per island, in id order."""
        return [g for g in self.groups for _ in range(g.count)]


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario TOML file (ConfigError naming the key and the fix)."""
    raw = read_toml(path)
    return scenario_from_dict(raw, str(path))


def scenario_from_dict(raw: dict[str, Any], source: str = "scenario") -> Scenario:
    known = {"simulation", "fault_tolerance", "islands"}
    for name in raw:
        if name not in known:
            raise ConfigError(f"{source}: unknown section [{name}]; a scenario has {', '.join(sorted(known))}")
    settings = section_from_table(SimulationSettings, raw.get("simulation", {}), f"{source}: simulation")
    ft = section_from_table(FaultToleranceConfig, raw.get("fault_tolerance", {}), f"{source}: fault_tolerance")
    tables = raw.get("islands", [])
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{source}: no islands; add at least one [[islands]] table (count, step_s, ...)")
    groups = [section_from_table(IslandGroup, t, f"{source}: islands[{k}]") for k, t in enumerate(tables)]
    scenario = Scenario(settings, replace(ft, enable=True, group_size=sum(g.count for g in groups)), groups)
    _validate(scenario, source)
    return scenario


def _validate(s: Scenario, source: str) -> None:
    if s.settings.hours <= 0 or s.settings.params <= 0:
        raise ConfigError(f"{source}: simulation.hours and simulation.params must be > 0")
    for k, g in enumerate(s.groups):
        if g.count < 1 or g.step_s <= 0 or g.tokens_per_step <= 0 or g.bandwidth_mbit <= 0:
            raise ConfigError(f"{source}: islands[{k}]: count, step_s, tokens_per_step and bandwidth_mbit "
                              "must be > 0")
        if g.mtbf_hours < 0 or g.restart_s < 0 or g.latency_ms < 0:
            raise ConfigError(f"{source}: islands[{k}]: mtbf_hours, restart_s and latency_ms must be >= 0")
    if s.ft.min_replica_size > len(s.islands):
        raise ConfigError(f"{source}: fault_tolerance.min_replica_size {s.ft.min_replica_size} is more than the "
                          f"{len(s.islands)} islands: lower it or add islands")
    problems = fault_tolerance_problems(s.ft)  # the run files' rules for the section
    if problems:
        raise ConfigError(f"{source}:\n  - " + "\n  - ".join(problems))


@dataclass
class IslandStats:
    compute_s: float = 0.0      # inner steps whose progress entered a committed outer step
    wasted_s: float = 0.0       # inner steps trained and then lost (a failed round, a failure)
    down_s: float = 0.0         # down after a failure, until its processes run again
    heal_s: float = 0.0         # downloading the global state
    tokens: int = 0             # committed
    received: int = 0           # bytes from other islands
    failures: int = 0


@dataclass
class Report:
    hours: float
    rounds: int
    committed: int
    failed_rounds: int
    tokens: int
    ideal_tokens: float
    islands: list[IslandStats] = field(default_factory=list)
    ended_s: float = 0.0   # when the last round ended (past the horizon: a round started before it runs out)
    joined_s: float = 0.0  # when the first round (the join) ended
    staleness: list[int] = field(default_factory=list)  # decoupled rounds: of each contribution that entered
    dropped: int = 0       # decoupled rounds: contributions left out as staler than max_staleness
    thin: int = 0          # decoupled rounds: islands whose rows a member carries (their link is too thin)

    @property
    def goodput(self) -> float:
        """Committed tokens / the tokens every island would train never stopping."""
        return self.tokens / self.ideal_tokens if self.ideal_tokens else 0.0

    def utilisation(self, k: int) -> float:
        return self.islands[k].compute_s / (self.hours * 3600)

    def summary(self) -> dict[str, Any]:
        util = [self.utilisation(k) for k in range(len(self.islands))]
        return {"islands": len(self.islands), "hours": self.hours, "rounds": self.rounds,
                "outer_steps": self.committed, "outer_steps_per_hour": self.committed / self.hours,
                "failed_rounds": self.failed_rounds, "goodput": self.goodput,
                "utilisation_mean": sum(util) / len(util), "utilisation_min": min(util),
                "utilisation_max": max(util), "tokens": self.tokens,
                "received_per_island_gb": sum(s.received for s in self.islands) / len(self.islands) / 1e9,
                "failures": sum(s.failures for s in self.islands),
                "lost_to_failures_island_h": sum(s.down_s + s.heal_s + s.wasted_s for s in self.islands) / 3600,
                "staleness_mean": statistics.fmean(self.staleness) if self.staleness else 0.0,
                "staleness_max": max(self.staleness, default=0), "dropped_stale": self.dropped,
                "thin_islands": self.thin}


def round_steps(ft: FaultToleranceConfig, step_s: float) -> int:
    """Inner steps an island of `step_s` seconds per step trains in one round."""
    if ft.round_pacing == "steps":
        return ft.sync_steps
    steps = 0
    while not round_is_up(steps, ft.min_inner_steps, ft.max_inner_steps, steps * step_s, step_s, ft.round_seconds):
        steps += 1
    return steps


def exchange_bytes(ft: FaultToleranceConfig, params: int, participants: int) -> int:
    """Bytes one island receives in a round's exchange of `participants` islands: the
    codec's rows (exchange.round_received), scaled from a sample chunk, plus the averaged
    moments' rows when the config sends them."""
    sample = min(params, CODEC_SAMPLE_VALUES)
    received = round_received(build_codec(ft, sample), participants, Framing()) * params / sample
    received += moments_received(moments_row_bytes(ft, params), participants, Framing())
    return int(received)


def exchange_phases(ft: FaultToleranceConfig, params: int, participants: int) -> int:
    """The latencies a round's exchange of `participants` islands waits: one per phase,
    each an all-to-all in which every island sends to every other at once (exchange.
    gather_start), not a ring: the rows' all-gather (1), or a reduce-scatter and the sums'
    all-gather (2), plus the averaged moments' all-gather when the config sends them."""
    if participants < 2:
        return 0
    phases = 2 if two_phase(build_codec(ft, min(params, CODEC_SAMPLE_VALUES)), participants) else 1
    return phases + (1 if moments_row_bytes(ft, params) else 0)


class Simulation:
    """One scenario's run (`run()`); `fail_at` replaces random failures by given ones:
    (island, seconds) pairs."""

    def __init__(self, scenario: Scenario, fail_at: list[tuple[int, float]] | None = None) -> None:
        self.s, self.ft = scenario, scenario.ft
        self.islands = scenario.islands
        self.rng = random.Random(scenario.settings.seed)
        self.stats = [IslandStats() for _ in self.islands]
        self.up_at = [0.0] * len(self.islands)      # when its processes run (again)
        self.joined = [False] * len(self.islands)   # holds the global state (else heals first)
        self.failures: list[tuple[float, int]] = []
        if fail_at is None:
            for k in range(len(self.islands)):
                self._schedule_failure(k, 0.0)
        else:
            self.failures = [(t, k) for k, t in fail_at]
        heapq.heapify(self.failures)
        self.steps = {g.step_s: round_steps(self.ft, g.step_s) for g in self.islands}
        self.joined_s = 0.0
        self._auto: dict[int, FaultToleranceConfig] = {}  # codec = "auto": the choice per island count
        # Bytes an island receives per exchange, and the latencies it waits, per island count
        # and the round's top-k fraction (topk_early_rounds send another).
        self._received: dict[tuple[int, float], int] = {}
        self._phases: dict[tuple[int, float], int] = {}
        self.outer = 0  # outer steps applied before the round being simulated
        self.codecs_used: dict[str, int] = {}  # rounds per codec

    def _schedule_failure(self, k: int, after: float) -> None:
        mtbf = self.islands[k].mtbf_hours
        if mtbf > 0:
            heapq.heappush(self.failures, (after + self.rng.expovariate(1 / (mtbf * 3600)), k))

    def _fail(self, k: int, at: float) -> None:
        g, stats = self.islands[k], self.stats[k]
        stats.failures += 1
        stats.down_s += g.restart_s
        self.up_at[k], self.joined[k] = at + g.restart_s, False
        self._schedule_failure(k, at + g.restart_s)

    def _failures_until(self, end: float) -> list[tuple[float, int]]:
        out = []
        while self.failures and self.failures[0][0] < end:
            out.append(heapq.heappop(self.failures))
        return out

    def run(self) -> Report:
        horizon = self.s.settings.hours * 3600
        t, rounds, committed, outer = 0.0, 0, 0, 0
        while t < horizon:
            for at, k in self._failures_until(t):  # failures of islands waiting for a round
                self._fail(k, max(at, self.up_at[k]))
            live = [k for k in range(len(self.islands)) if self.up_at[k] <= t]
            # A new federation waits for all its islands (as the join does), later for the quorum's minimum.
            m = Membership(outer_step=outer, participants=len(live))
            assembling = t < self.ft.join_wait_ms / 1000  # then the join goes on with whoever is there
            if must_wait(m, len(self.islands) if assembling else 1) or len(live) < max(self.ft.min_replica_size, 1):
                later = min((u for u in self.up_at if u > t), default=horizon)
                t = min(later, self.ft.join_wait_ms / 1000) if assembling else later
                continue
            t, ok = self._round(t, live, outer)
            if rounds == 0:
                self.joined_s = t
            rounds += 1
            committed += ok
            outer += ok
        ideal = sum(horizon / g.step_s * g.tokens_per_step for g in self.islands)
        return Report(self.s.settings.hours, rounds, committed, rounds - committed,
                      sum(s.tokens for s in self.stats), ideal, self.stats, ended_s=t, joined_s=self.joined_s)

    def _round(self, start: float, live: list[int], outer: int) -> tuple[float, bool]:
        """One round from `start` with the islands `live`; returns (its end, committed)."""
        arrive, parts, began = {}, {}, {}
        self.outer = outer
        for k in live:
            g, joining = self.islands[k], not self.joined[k]
            # A joining island trains nothing this round: it heals from a peer (a running
            # federation's state), then takes part in the exchange with weight 0.
            heal = self._heal_s(k) if joining and outer > 0 else 0.0
            self.stats[k].heal_s += heal
            parts[k] = part_in_round(Membership(outer_step=outer, healed=heal > 0, participants=len(live)), joining, 1)
            began[k] = start + heal
            arrive[k] = began[k] + (0.0 if joining else self.steps[g.step_s] * g.step_s)
        detect = self.s.settings.detect_s
        # The failures up to the latest this round can end (each retry of its exchange may
        # add a detection and a whole exchange); those after its real end go back.
        attempts = self.ft.exchange_retries + 2
        latest = max(arrive.values()) + detect + attempts * (detect + self._exchange_s(len(live)))
        candidates = self._gone(live, latest)
        # Gone before its exchange: it leaves the quorum, and the others wait for the
        # lighthouse to notice (detect_s) unless they were still training by then.
        early = {k: at for k, at in candidates.items() if at < arrive[k]}
        members = [k for k in live if k not in early]
        exchange_start = max([arrive[k] for k in members] + [at + detect for at in early.values()] + [start])
        end, inside, lost = self._exchange(exchange_start, members, {k: at for k, at in candidates.items()
                                                                     if k not in early})
        for k, at in candidates.items():
            if k not in early and k not in inside:  # after this round: a failure of a later one
                heapq.heappush(self.failures, (at, k))
        gone = {**early, **inside}
        lost = lost or len(members) - len(inside) < max(self.ft.min_replica_size, 1)
        received = self.received(len(members))
        codec = self.round_ft(len(members)).codec
        self.codecs_used[codec] = self.codecs_used.get(codec, 0) + 1
        for k in live:
            trained = max(0.0, min(arrive[k], gone.get(k, arrive[k])) - began[k])
            self._account(k, parts[k].contributes and not lost and k not in gone, trained,
                          received if k in members else 0)
        for k, at in gone.items():
            self._fail(k, at)
        for k in members:
            self.joined[k] = k not in gone
        return end, not lost

    def _exchange(self, start: float, members: list[int], failing: dict[int, float],
                  duration: Callable[[list[int]], float] | None = None) -> tuple[float, dict[int, float], bool]:
        """The exchange of `members` from `start` (lasting `duration(members)`, by default
        `_exchange_s`), with the members' failure times `failing`: (its end, the members that
        died in it, lost). A member that dies in it fails the collective for all. With
        `exchange_retries` the others re-form the quorum once the lighthouse has dropped it
        (detect_s) and run the exchange again without it, keeping their pseudo-gradients
        (`repair = "restart"`, what the platform does), or only re-send the dead member's
        segment of a two-phase exchange (`repair = "segment"`, a design the simulator
        measures before it is built); past the retries (or with none) the round is lost."""
        detect, retries = self.s.settings.detect_s, self.ft.exchange_retries
        length = duration or (lambda alive: self._exchange_s(len(alive)))
        alive = list(members)
        end = start + length(alive)
        inside: dict[int, float] = {}
        for at, k in sorted((at, k) for k, at in failing.items()):
            if at >= end:
                break
            inside[k] = at
            alive.remove(k)
            if len(inside) > retries or len(alive) < max(self.ft.min_replica_size, 1):
                return max(end, at + detect), inside, True
            if self.s.settings.repair == "segment":
                end = max(end, at + detect) + 2 * length(alive) / max(len(alive), 1)
            else:
                start = max(start, at + detect)
                end = start + length(alive)
        return end, inside, False

    def _gone(self, live: list[int], until: float) -> dict[int, float]:
        """The live islands that fail before `until`, with when; the failures of islands
        waiting for a round are applied at once."""
        gone: dict[int, float] = {}
        for at, k in self._failures_until(until):
            if k in live and k not in gone:
                gone[k] = at
            elif k not in live:
                self._fail(k, max(at, self.up_at[k]))
        return gone

    def _account(self, k: int, counts: bool, trained_s: float, received: int) -> None:
        """An island's round: its compute counts (its weight enters a committed outer
        step) or is wasted; the bytes it received."""
        g, stats = self.islands[k], self.stats[k]
        stats.received += received
        tokens = round(trained_s / g.step_s) * g.tokens_per_step
        weight = contribution_weight("tokens", tokens, counts)
        if weight > 0:
            stats.compute_s += trained_s
            stats.tokens += int(weight)
        else:
            stats.wasted_s += trained_s

    def _heal_s(self, k: int) -> float:
        """Downloading the global weights (and the outer momentum, if any) from a peer."""
        g = self.islands[k]
        state = 4 * self.s.settings.params * (2 if self.ft.outer_momentum > 0 else 1)
        return state * 8 / (g.bandwidth_mbit * 1e6) + g.latency_ms / 1e3

    def round_ft(self, participants: int) -> FaultToleranceConfig:
        """The config with this round's codec: with codec = "auto", what the islands would
        choose (auto_codec.choose_round: the codec, and whether averaged moments ride) from
        the slowest link and the lower median round, as the islands agree on them
        (auto_codec.agree_on_link)."""
        if self.ft.codec != "auto":
            fraction = round_fraction(self.ft, self.outer)
            return self.ft if fraction == self.ft.topk_fraction else replace(self.ft, topk_fraction=fraction)
        if participants not in self._auto:
            link = min(g.bandwidth_mbit for g in self.islands) * 1e6
            round_s = statistics.median_low(self.steps[g.step_s] * g.step_s for g in self.islands)
            target = auto_target_s(replace(self.ft, fragment_sync_delay=0), round_s)  # no overlap here
            sample = build_codec(self.ft, min(self.s.settings.params, CODEC_SAMPLE_VALUES))
            scale = self.s.settings.params / sample.numel
            name, carried = choose_round(sample, participants, link / scale, target, Framing(),
                                         moments_row_bytes(self.ft, sample.numel))
            self._auto[participants] = replace(self.ft, codec=name,  # type: ignore[arg-type]
                                               average_optimizer_state=carried)
        return self._auto[participants]

    def received(self, participants: int) -> int:
        """Bytes one island receives in an exchange of `participants` islands (exchange_bytes,
        with this round's codec; the same for every round of that many islands and top-k
        fraction)."""
        key = (participants, round_fraction(self.ft, self.outer))
        if key not in self._received:
            self._received[key] = exchange_bytes(self.round_ft(participants), self.s.settings.params, participants)
        return self._received[key]

    def _exchange_s(self, participants: int, over: list[int] | None = None) -> float:
        """An exchange of `participants` islands: each island's received bytes over its link,
        the slowest of the islands `over` (default: all of them) deciding, plus a latency per
        phase (`exchange_phases`)."""
        if participants < 2:
            return 0.0
        links = [self.islands[k] for k in over] if over is not None else self.islands
        slowest = min(g.bandwidth_mbit for g in links) * 1e6
        latency = max(g.latency_ms for g in links) / 1e3
        key = (participants, round_fraction(self.ft, self.outer))
        if key not in self._phases:
            self._phases[key] = exchange_phases(self.round_ft(participants), self.s.settings.params, participants)
        return self.received(participants) * 8 / slowest + self._phases[key] * latency


def format_report(report: Report, groups: list[IslandGroup]) -> str:
    """A table per group of alike islands, then the federation's figures."""
    s = report.summary()
    lines = ["| islands | step s | link Mbit/s | MTBF h | utilisation | received GB | failures |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    k = 0
    for g in groups:
        members = list(range(k, k + g.count))
        k += g.count
        util = sum(report.utilisation(j) for j in members) / len(members)
        gb = sum(report.islands[j].received for j in members) / len(members) / 1e9
        fails = sum(report.islands[j].failures for j in members)
        lines.append(f"| {g.count} | {g.step_s:g} | {g.bandwidth_mbit:g} | {g.mtbf_hours:g} | {util:.1%} "
                     f"| {gb:,.1f} | {fails} |")
    lines += ["", f"goodput {s['goodput']:.1%} of every island training non-stop; utilisation "
                  f"{s['utilisation_mean']:.1%} (min {s['utilisation_min']:.1%}); {s['outer_steps']} outer steps "
                  f"({s['outer_steps_per_hour']:.1f} per hour), {s['failed_rounds']} rounds lost; "
                  f"{s['failures']} failures cost {s['lost_to_failures_island_h']:.1f} island-hours "
                  f"(down, healing, discarded rounds)"]
    if report.staleness:
        lines.append(f"decoupled: contributions entered {s['staleness_mean']:.2f} outer steps stale on average "
                     f"(at most {s['staleness_max']}), {s['dropped_stale']} left out as too stale; "
                     f"{s['thin_islands']} thin-link island(s) sent their rows through a member")
    return "\n".join(lines)


def scaled(scenario: Scenario, islands: int) -> Scenario:
    """The scenario with its groups' counts scaled to `islands` in all (at least 1 each)."""
    if islands < len(scenario.groups):
        raise ConfigError(f"--islands {islands}: the scenario has {len(scenario.groups)} groups of islands, "
                          "one island each at least")
    total = sum(g.count for g in scenario.groups)
    shares = [g.count * islands / total for g in scenario.groups]
    counts = [max(1, math.floor(x)) for x in shares]
    by_remainder = sorted(range(len(shares)), key=lambda j: shares[j] - math.floor(shares[j]), reverse=True)
    turn = 0
    while sum(counts) < islands:  # largest remainders first
        counts[by_remainder[turn % len(counts)]] += 1
        turn += 1
    while sum(counts) > islands:  # the ones added for groups below one island: from the largest
        counts[max(range(len(counts)), key=lambda j: counts[j])] -= 1
    groups = [replace(g, count=c) for g, c in zip(scenario.groups, counts)]
    ft = replace(scenario.ft, group_size=sum(g.count for g in groups),
                 min_replica_size=min(scenario.ft.min_replica_size, islands))
    return Scenario(scenario.settings, ft, groups)
