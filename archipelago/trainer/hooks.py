"""The trainer as the federation sees it: the `IslandHooks` the seam talks back through."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from archipelago.island.optim import set_schedule_position
from archipelago.trainer.run_metrics import RunMetrics
from archipelago.trainer.state import Progress


class Trained(Protocol):
    """What the hooks reach of the trainer (loop.Trainer)."""

    progress: Progress
    metrics: RunMetrics
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR

    def catch_up(self, step: int) -> None: ...


class TrainerHooks:
    """The trainer as the federation sees it (federation.seam.IslandHooks)."""

    def __init__(self, trainer: Trained) -> None:
        self.trainer = trainer

    @property
    def step(self) -> int:
        return self.trainer.progress.step

    def event(self, name: str, **fields: Any) -> None:
        self.trainer.metrics.event(name, **fields)

    def outer_step(self, record: dict[str, Any]) -> None:
        self.trainer.metrics.outer_step(record)

    def catch_up(self, step: int) -> None:
        self.trainer.catch_up(step)

    def follow_schedule(self, position: float) -> None:
        set_schedule_position(self.trainer.lr_scheduler, position)
