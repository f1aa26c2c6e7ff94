"""The held-out evaluation of one island: the task's validation metrics over the same
held-out batches every time, summed over the island's ranks."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from archipelago.island.device import IslandContext, all_reduce_
from archipelago.island.parallelize import ParallelModel
from archipelago.tasks import Task


@torch.no_grad()
def evaluate(model: ParallelModel, ctx: IslandContext, task: Task,
             batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """The task's validation metrics (`val_loss`, and `val_accuracy` for images) over
    `batches`; every rank yields as many batches, so the collective below runs on all."""
    model.average_buffers()  # BatchNorm: one set of running statistics per island
    model.module.eval()
    sums: torch.Tensor | None = None
    for inputs, targets in batches:
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        with model.autocast():
            outputs = model_outputs(model, inputs)
        # [loss, count, ...] padded to 3 (what the image task sums); zeros on pipeline
        # stages without the output, so the island's sum is the last stage's.
        batch = (torch.zeros(3, dtype=torch.float64, device=ctx.device) if outputs is None else
                 torch.nn.functional.pad(task.eval_sums(outputs, targets), (0, 1)).narrow(0, 0, 3))
        sums = batch if sums is None else sums + batch
    model.module.train()
    if sums is None:  # every rank yields as many batches, so all take this branch together
        return task.eval_metrics(torch.zeros(3, dtype=torch.float64))
    all_reduce_(sums, ctx)
    return task.eval_metrics(sums)


def model_outputs(model: ParallelModel, inputs: torch.Tensor) -> torch.Tensor | None:
    """The model's outputs (forward only); None on pipeline stages before the last."""
    if model.pipeline is not None:
        return model.pipeline.outputs(inputs)
    return model.module(inputs)
