"""The one place where the trainer meets the federation.

The trainer holds a `Federation` (the Protocol below): `Alone` for an island on its own
(every call does nothing), or `Member` for an island of a federation (the outer loop).
Before it is built, the trainer asks the federation package two things with no branch of
its own: its data shard (`data_shard`) and whether its inner optimizer scales to the
federation's batch (`scales_inner_batch`). It calls
`join` once, `after_step` after every inner step, and asks `done`, `at_round_end`,
`exchange_pending`, `saves_model`; the federation talks back through `IslandHooks`
(metrics events, the outer-step record, catching up with the federation's step, the
learning-rate schedule of a time-paced federation). So the training loop reads the
same with or without a federation, and the federation's rules live here and in
`diloco.py` / `policy.py`, not in the trainer.
"""

from __future__ import annotations

from typing import Any, Protocol

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.diloco import OuterLoop
from archipelago.federation.round_book import OuterReport, report_record


class IslandHooks(Protocol):
    """What the federation may ask of the island's trainer."""

    @property
    def step(self) -> int:
        """The island's inner step count."""

    def event(self, name: str, **fields: Any) -> None:
        """Log a metrics.jsonl event (join, heal, refused, leave)."""

    def outer_step(self, record: dict[str, Any]) -> None:
        """Log one outer step (its metrics.jsonl record and console line)."""

    def catch_up(self, step: int) -> None:
        """Continue at the federation's inner step `step` (after healing from a peer)."""

    def follow_schedule(self, position: float) -> None:
        """Put the learning-rate schedule at `position` inner steps (time-paced rounds)."""


class Federation(Protocol):
    """What the trainer asks of the islands it trains with, whether there are any or not."""

    @property
    def exchange_pending(self) -> bool:
        """An exchange is in flight: the island's state cannot be checkpointed now."""

    @property
    def at_round_end(self) -> bool:
        """The island may stop here (all islands stop at the same outer step)."""

    def join(self, step: int) -> None: ...

    def after_step(self, step: int, tokens: int, compute_s: float) -> None: ...

    def done(self, step: int) -> bool: ...

    def token_budget_or_none(self) -> int | None: ...

    def position(self, step: int) -> float: ...

    def saves_model(self, scope: str) -> bool: ...

    def add_untimed(self, seconds: float) -> None: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def finish_rounds(self) -> None: ...

    def leave(self) -> None: ...

    def shutdown(self) -> None: ...


def data_shard(ft: FaultToleranceConfig) -> tuple[int, int]:
    """(this island's shard, the shards): islands read disjoint sequences of the data; an
    island on its own reads all of it."""
    return (ft.replica_id, ft.group_size) if ft.enable else (0, 1)


def scales_inner_batch(ft: FaultToleranceConfig) -> bool:
    """The inner AdamW normalises by the federation's batch (`adam_federation_batch`; the
    outer loop sets its batch ratio every round). Never for an island on its own."""
    return ft.enable and ft.adam_federation_batch


class Alone:
    """An island on its own: no federation, every call does nothing (a `Federation`)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    @property
    def exchange_pending(self) -> bool:
        """Never: there is no exchange."""
        return False

    @property
    def at_round_end(self) -> bool:
        """Always: there are no rounds."""
        return True

    def join(self, step: int) -> None:
        """Enter the federation (receive its weights, line up with its step)."""

    def after_step(self, step: int, tokens: int, compute_s: float) -> None:
        """After every inner step: maybe end a round (an outer step)."""

    def done(self, step: int) -> bool:
        """Trained enough: `training.steps` inner steps."""
        return step >= self.steps

    def token_budget_or_none(self) -> int | None:
        """The federation's token budget when it, not the step count, ends the run (time pacing)."""
        return None

    def position(self, step: int) -> float:
        """How far the run is, in the unit `done` counts: inner steps, or with a token budget
        the federation's tokens (estimated between outer steps)."""
        return float(step)

    def saves_model(self, scope: str) -> bool:
        """Whether this island writes the model in its checkpoints."""
        return True

    def add_untimed(self, seconds: float) -> None:
        """Count evaluation or checkpoint seconds of the current round."""

    def checkpoint_state(self) -> dict[str, Any]:
        """What the federation adds to the island's checkpoint."""
        return {}

    def finish_rounds(self) -> None:
        """The last inner step is done: an exchange still in flight (decoupled rounds)
        enters now, before the final evaluation and checkpoint."""

    def leave(self) -> None:
        """The run is over: say goodbye (a metrics event with the final global hash)."""

    def shutdown(self) -> None:
        """Release the federation's resources (no collective)."""


class Member(Alone):
    """An island of a federation: the outer loop behind the seam."""

    def __init__(self, outer: OuterLoop, ft: FaultToleranceConfig, steps: int, tokens_per_step: int,
                 ranks: int, hooks: IslandHooks) -> None:
        super().__init__(steps)
        self.outer, self.ft, self.hooks = outer, ft, hooks
        self.tokens_per_step, self.ranks = tokens_per_step, ranks
        self.time_paced = ft.round_pacing == "time"
        # Time pacing: islands run different step counts and stop together, when the
        # federation has trained what `steps` islands of this island's batch would.
        self.token_budget = steps * tokens_per_step * ft.group_size

    @property
    def exchange_pending(self) -> bool:
        return self.outer.exchange_pending

    @property
    def at_round_end(self) -> bool:
        return self.outer.local_step == 0

    def join(self, step: int) -> None:
        self.hooks.event("join", step=step, ranks=self.ranks, island=self.ft.replica_id)
        self.outer.inner_step = step
        members = self.ft.group_size - self.ft.thin_islands  # thin islands join no quorum
        self._report(self.outer.join(members, self.ft.join_wait_ms / 1000))
        self._follow_schedule()

    def after_step(self, step: int, tokens: int, compute_s: float) -> None:
        report = self.outer.after_inner_step(step, tokens, compute_s)
        while self.outer.early_reports:  # a decoupled round end that finished two exchanges
            self._report(self.outer.early_reports.pop(0))
        if report is not None:
            self._report(report)
        self._follow_schedule()

    def finish_rounds(self) -> None:
        report = self.outer.finish_rounds(self.hooks.step)
        if report is not None:
            self._report(report)

    def done(self, step: int) -> bool:
        if self.time_paced:
            return self.outer.federation_tokens >= self.token_budget
        return super().done(step)

    def token_budget_or_none(self) -> int | None:
        return self.token_budget if self.time_paced else None

    def position(self, step: int) -> float:
        return min(float(self.token_budget), self.outer.federation_tokens_estimate()) if self.time_paced else step

    def saves_model(self, scope: str) -> bool:
        return scope == "island" or self.outer.leads

    def add_untimed(self, seconds: float) -> None:
        self.outer.add_untimed(seconds)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"federation": self.outer}

    def leave(self) -> None:
        self.hooks.event("leave", step=self.hooks.step, outer_step=self.outer.outer_step,
                         global_hash=self.outer.global_hash())

    def shutdown(self) -> None:
        self.outer.shutdown()

    def _report(self, report: OuterReport) -> None:
        """Apply a round's outcome to the island: catch up after healing, log it."""
        if report.healed:
            to_step = self.hooks.step if self.time_paced else self.outer.aligned_inner_step()
            self.hooks.event("heal", step=self.hooks.step, outer_step=report.outer_step, to_step=to_step)
            self.hooks.catch_up(to_step)
        refused = {r["island"] for r in report.refused}
        if report.own_refused and self.ft.replica_id not in refused:  # its own guard kept it out
            self.hooks.event("refused", step=self.hooks.step, outer_step=report.outer_step,
                             island=self.ft.replica_id, refused_island=self.ft.replica_id, by="own guard",
                             norm=report.norm, reason=report.own_refused)
        for r in report.refused:  # every receiver refused this island's row (every island logs it)
            self.hooks.event("refused", step=self.hooks.step, outer_step=report.outer_step,
                             island=self.ft.replica_id, refused_island=r["island"], by="receivers",
                             reason=r["reason"])
        self.hooks.outer_step(report_record(report))

    def _follow_schedule(self) -> None:
        """Time pacing: the learning-rate schedule follows the federation's progress, in
        inner steps of one island: estimated federation tokens / (tokens per step x islands)."""
        if self.time_paced:
            self.hooks.follow_schedule(self.outer.federation_tokens_estimate()
                                       / (self.tokens_per_step * self.ft.group_size))
