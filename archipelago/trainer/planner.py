"""The island's plan as the training loop uses it (`parallelism.auto`,
`parallelism.rebalance_after`): measure every rank at the start and split the batch (or a
pipeline's layers) to their speeds; once during the run, split the batch again from the
run's own step records. Measuring and solving are planning.py's and island/plan.py's;
this is when the loop asks for them, and what it logs.
"""

from __future__ import annotations

import logging

from archipelago.config import Config, ConfigError
from archipelago.island.batches import RankBatches
from archipelago.island.device import IslandContext
from archipelago.island.plan import IslandPlan, RankSpeed
from archipelago.planning import describe_plan, plan_island, profile_lines, rank_batches_of, rank_speeds, rebalanced
from archipelago.tasks import Task

log = logging.getLogger("archipelago.trainer")


class IslandPlanner:
    """The loop's collaborator for the island's plan (see module doc)."""

    def __init__(self, cfg: Config, ctx: IslandContext, task: Task) -> None:
        self.cfg, self.ctx, self.task = cfg, ctx, task
        self.profiled_speeds: list[RankSpeed] | None = None  # set by measured_plan (parallelism.auto)
        self.rebalanced = False  # rebalance_after happens once per session

    def rank_batches(self) -> RankBatches:
        """parallelism.auto: measure every rank and split the batch to their speeds (logged)."""
        p = self.cfg.parallelism
        if p.micro_batch_size_per_rank or self.cfg.training.micro_batch_size:
            raise ConfigError("parallelism.auto chooses the micro-batches itself: leave out "
                              "parallelism.micro_batch_size_per_rank and training.micro_batch_size, or drop auto")
        return rank_batches_of(self.measured_plan())

    def stage_layers(self) -> tuple[int, ...]:
        """parallelism.auto on a pipelined island: measure every rank, give each stage the
        layers its device runs fastest (logged)."""
        plan = self.measured_plan()
        assert plan.stages is not None  # plan_island plans stages when pipeline_stages > 1
        return plan.stages.layers

    def measured_plan(self) -> IslandPlan:
        """parallelism.auto: measure every rank (a collective) and plan; the plan is logged."""
        plan, profiles = plan_island(self.cfg, self.ctx, self.task)
        for line in [*profile_lines(profiles), *describe_plan(plan, profiles).splitlines()]:
            log.info("parallelism.auto: %s", line)
        self.profiled_speeds = rank_speeds(profiles)  # what rebalance_after scales to the run
        return plan

    def rebalance_due(self, step: int, pipelined: bool, records: int) -> bool:
        """parallelism.rebalance_after: the first log step at or after it, with two records to read."""
        after = self.cfg.parallelism.rebalance_after
        return bool(after) and not self.rebalanced and step >= after and not pipelined and records >= 2

    def rebalanced_batches(self, before: RankBatches, idle_history: list[list[float]],
                           strategy: str) -> RankBatches | None:
        """The batch split again from this session's step records (planning.rebalanced), or
        None to keep `before` (logged either way)."""
        self.rebalanced = True
        after = rebalanced(before, idle_history, self.profiled_speeds,
                           fsdp=self.cfg.parallelism.data_parallel == "fsdp")
        if after.uneven_counts != before.uneven_counts and (strategy == "ddp"
                                                            or self.cfg.parallelism.expert_parallel):
            log.info("parallelism.rebalance_after: keeping %s: %s would change whether ranks run as many "
                     "micro-batches, which DDP's buffers and the experts' exchanges fixed at start",
                     before.describe(), after.describe())
            return None
        if after == before:
            log.info("parallelism.rebalance_after: the measured speeds keep the split (%s)", before.describe())
            return None
        return after
