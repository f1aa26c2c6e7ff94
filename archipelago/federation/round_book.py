"""What one island counts of the round in progress, and the record a round leaves.

The outer loop (diloco.OuterLoop) asks this part three things: count an inner step
(`RoundBook.count_step`), is a time-paced round up (`RoundBook.time_is_up`), and write
the round's record (`RoundBook.close`, an `OuterReport`, logged as an `outer_step` event).
The federation's own counts (its step, its tokens) stay with the outer loop: they are
checkpointed and handed to healing islands; these counters start again every round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.policy import round_is_up


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
    weight: float = 0.0           # this island's weight in the average (0: sent no progress)
    federation_tokens: int = 0    # tokens trained by the whole federation, after this round
    norm: float | None = None     # norm of this island's pseudo-gradient (None: not checked)
    own_refused: str | None = None  # why this island's pseudo-gradient was kept out (its own guard or the receivers)
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
    repaired: int = 0             # of those retries, how many the segment repair finished (exchange_repair)
    carried: int = 0              # a thin island's rows this island's committed row carried in (carries)
    # Time pacing: the seconds from the round's start at each inner step's end, what
    # round_is_up decided on (this rank's clock), so that a recorded run can be replayed.
    pacing_elapsed_s: list[float] | None = None


def report_record(report: OuterReport) -> dict[str, Any]:
    record = asdict(report)
    if record["pacing_elapsed_s"] is None:  # steps-paced rounds: nothing to replay
        del record["pacing_elapsed_s"]
    return record


class RoundBook:
    """This island's counters of the round in progress and the time-pacing clock.

    `island_max` combines a value over the island's ranks (a tiny all-reduce): every rank
    of an island must end a time-paced round at the same inner step.
    """

    def __init__(self, ft: FaultToleranceConfig, fragments: int,
                 island_max: Callable[[list[float]], list[float]]) -> None:
        self.ft, self.island_max = ft, island_max
        self.tokens = 0                        # this island's tokens since the last exchange
        self.fragment_tokens = [0] * fragments  # ... since each fragment's last exchange
        self.steps, self.compute_s, self.untimed_s = 0, 0.0, 0.0
        self.elapsed: list[float] = []         # time pacing: seconds from the round's start at each step's end
        self.start = self.last_step_end = time.monotonic()

    def count_step(self, tokens: int, compute_s: float) -> None:
        """One inner step of `tokens` tokens and `compute_s` seconds."""
        self.tokens += tokens
        self.fragment_tokens = [t + tokens for t in self.fragment_tokens]
        self.steps += 1
        self.compute_s += compute_s

    def add_untimed(self, seconds: float) -> None:
        """Count evaluation or checkpoint seconds of this round (reported as `untimed_s`)."""
        self.untimed_s += seconds

    def take_tokens(self, fragment: int) -> tuple[int, int]:
        """(tokens since the last exchange, since the fragment's last one); both start again."""
        taken = self.tokens, self.fragment_tokens[fragment]
        self.tokens, self.fragment_tokens[fragment] = 0, 0
        return taken

    def forget_fragments(self) -> None:
        """A healed island's progress is gone: no fragment carries tokens any more."""
        self.fragment_tokens = [0] * len(self.fragment_tokens)

    def time_is_up(self, local_step: int) -> bool:
        """Time pacing: end the round now? (policy.round_is_up; all ranks must agree)"""
        now = time.monotonic()
        step_s, self.last_step_end = now - self.last_step_end, now
        self.elapsed.append(now - self.start)
        ft = self.ft
        up = round_is_up(local_step, ft.min_inner_steps, ft.max_inner_steps, now - self.start,
                         step_s, ft.round_seconds)
        if local_step >= ft.max_inner_steps or local_step < ft.min_inner_steps:
            return up  # decided by step counts alone: the same on every rank
        # Clocks differ between ranks: a tiny all-reduce per inner step (multi-rank islands only).
        return self.island_max([float(up)])[0] > 0

    def half_elapsed(self) -> bool:
        """Time pacing: half of `round_seconds` has passed (agreed over the island's ranks)."""
        half = time.monotonic() - self.start >= self.ft.round_seconds / 2
        return self.island_max([float(half)])[0] > 0

    def start_clock(self) -> None:
        """A round starts now (time pacing measures its seconds from here)."""
        self.start = self.last_step_end = time.monotonic()

    def blocked(self) -> None:
        """The island blocked outside an inner step: that is not the next step's length."""
        self.last_step_end = time.monotonic()

    def close(self, **fields: Any) -> OuterReport:
        """The round's record (`fields`: what the outer loop knows of it, plus this round's
        counters); the counters start again."""
        report = OuterReport(**fields, inner_steps=self.steps, compute_s=self.compute_s, untimed_s=self.untimed_s,
                             pacing_elapsed_s=self.elapsed if self.ft.round_pacing == "time" else None)
        self.steps, self.compute_s, self.untimed_s = 0, 0.0, 0.0
        self.elapsed = []
        return report
