"""This rank's data: how the island's batch is split over its ranks, the training loader
over the island's shard of the data, and the held-out batches.

The split comes first (the model is built for it: a pipeline's micro-batches, DDP's
buffer broadcast); the loader opens after the optimizer, as it always has, so that a run's
random numbers are drawn in the same order. `resplit` (parallelism.rebalance_after) swaps
the split and reopens the loader at the same position.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from archipelago.config import Config, ConfigError, data_ranks, validate_for_island
from archipelago.federation import data_shard
from archipelago.island.batches import RankBatches, rank_batches
from archipelago.island.device import IslandContext
from archipelago.tasks import Task
from archipelago.trainer.planner import IslandPlanner

log = logging.getLogger("archipelago.trainer")


class IslandData:
    """This rank's batch split, training loader and held-out batches (see module doc)."""

    def __init__(self, cfg: Config, ctx: IslandContext, task: Task, planner: IslandPlanner) -> None:
        self.cfg, self.ctx, self.task = cfg, ctx, task
        self.batches = self.split(planner)
        self.loader: Any = None  # the task's loader (next_batch, state_dict); open_loader() opens it

    def split(self, planner: IslandPlanner) -> RankBatches:
        """Each rank's micro-batch size and count (equal shares unless set per rank)."""
        validate_for_island(self.cfg, self.ctx.world_size)
        batches = rank_batches(self.cfg, self.data_ranks)
        if self.cfg.parallelism.auto and self.cfg.parallelism.pipeline_stages <= 1:  # pipelines: in build_model
            batches = planner.rank_batches()
        if not batches.even or batches.uneven_counts:
            if self.cfg.parallelism.expert_parallel and batches.uneven_counts:
                raise ConfigError("parallelism.expert_parallel exchanges tokens at every forward, so every rank "
                                  "must run as many micro-batches: give parallelism.num_micro_batches_per_rank "
                                  "equal counts (vary the sizes instead)")
            log.info("island batch split: %s (of %d)", batches.describe(), batches.global_batch)
        return batches

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data (a pipeline's stages share each batch)."""
        return data_ranks(self.cfg, self.ctx.world_size)

    @property
    def data_rank(self) -> int:
        return self.ctx.rank % self.data_ranks

    def open_loader(self) -> None:
        """The training loader over this rank's part of the island's shard (islands read
        disjoint sequences); checks first that the held-out split is big enough."""
        t = self.cfg.training
        try:
            if t.val_every:
                self.validation_batches()
            shard, shards = data_shard(self.cfg.fault_tolerance)
            self.loader = self.task.train_loader(self.data_rank, self.data_ranks, shard, shards, log.info,
                                                 None if self.batches.even else list(self.batches.samples))
        except ValueError as exc:  # too little data for seq_len x batch_size
            raise ConfigError(f"data: {exc} (settings: --data.seq_len, --training.batch_size, "
                              "--training.val_batches, --training.val_offset)") from exc

    def validation_batches(self):  # noqa: ANN201 - an iterator of (inputs, targets)
        return self.task.validation_batches(self.data_rank, self.data_ranks)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The island's next batch as this rank reads it, on the island's device."""
        inputs, targets = self.loader.next_batch()
        return inputs.to(self.ctx.device), targets.to(self.ctx.device)

    def micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the global batch, cut into micro-batches for accumulation."""
        inputs, targets = self.loader.next_batch()
        size = self.batches.micro_batch_size[self.ctx.rank]  # checked in split
        dev = self.ctx.device
        return [(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
                for x, y in zip(inputs.split(size), targets.split(size))]

    def resplit(self, batches: RankBatches) -> None:
        """Go on with another split: the loader reopens at the same position (its state does
        not depend on the split), so no sample is skipped or repeated."""
        position = self.loader.state_dict()
        self.batches = batches
        self.open_loader()
        self.loader.load_state_dict(position)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
