"""Each rank's share of the island's batch: micro-batch size and count, per rank.

Alike ranks take `batch_size / ranks` samples each, in micro-batches of
`training.micro_batch_size`. Unlike ranks (a faster GPU beside a slower one) take shares in
proportion to their speed: `parallelism.micro_batch_size_per_rank = "6,2"` with
`num_micro_batches_per_rank = "4,4"` gives rank 0 24 samples and rank 1 8 of a batch of 32.

Every sample must weigh the same in the gradient, whichever rank computed it. The island's
gradient reduction averages over ranks (FSDP's reduce-scatter, DDP's all-reduce), so a rank
whose mean micro-batch loss is scaled by `ranks x micro-batch samples / global batch`
contributes exactly its samples' share of the global batch's mean loss:
sum over ranks of (1/ranks) x ranks x n_r / B x mean_r = sum of n_r x mean_r / B. Weighting
each rank's *mean* equally instead (what a plain average does) would give rank 1's 8
samples as much weight as rank 0's 24.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from archipelago.config import Config, ConfigError
from archipelago.config.counts import parse_counts, parse_factors
from archipelago.island.parallelize import ParallelModel


@dataclass(frozen=True)
class RankBatches:
    """Micro-batch size and count of every rank of the island, per optimizer step."""

    micro_batch_size: tuple[int, ...]
    num_micro_batches: tuple[int, ...]

    @property
    def samples(self) -> tuple[int, ...]:
        """Samples each rank computes per step."""
        return tuple(size * count for size, count in zip(self.micro_batch_size, self.num_micro_batches))

    @property
    def global_batch(self) -> int:
        return sum(self.samples)

    @property
    def even(self) -> bool:
        """Every rank takes the same share (the loaders' default split applies)."""
        return len(set(self.samples)) == 1

    @property
    def uneven_counts(self) -> bool:
        """Ranks run different numbers of forward passes per step; FSDP must then keep the
        parameters gathered through the accumulation (see ParallelModel.gradient_sync)."""
        return len(set(self.num_micro_batches)) > 1

    @property
    def keeps_gathered(self) -> bool:
        """FSDP keeps the parameters gathered through the accumulation: wherever shares or
        counts differ. Ranks then meet at each block only in the first forward and the last
        backward, and run their other micro-batches each at its own pace, instead of meeting
        at every block of every micro-batch (the planner's step model, island/plan.py)."""
        return self.uneven_counts or not self.even

    def loss_weight(self, micro_batch_samples: int) -> float:
        """What a micro-batch's mean loss is multiplied by before backward (module docstring)."""
        return len(self.samples) * micro_batch_samples / self.global_batch

    def describe(self) -> str:
        return ", ".join(f"rank {r}: {size} x {count} = {size * count}" for r, (size, count)
                         in enumerate(zip(self.micro_batch_size, self.num_micro_batches)))


def check_rank_slowdown(cfg: Config, ranks: int) -> None:
    """island.rank_slowdown has one factor >= 1 per rank of the island (ConfigError naming the form)."""
    if cfg.island.rank_slowdown:
        try:
            parse_factors(cfg.island.rank_slowdown, ranks, "island.rank_slowdown")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def rank_batches(cfg: Config, ranks: int) -> RankBatches:
    """The island's split of `training.batch_size` over `ranks` data-parallel ranks
    (ConfigError naming the fix when the settings do not add up)."""
    p, t = cfg.parallelism, cfg.training
    if not p.micro_batch_size_per_rank:
        if p.num_micro_batches_per_rank:
            raise ConfigError("parallelism.num_micro_batches_per_rank needs parallelism.micro_batch_size_per_rank "
                              "(the size of each rank's micro-batches); set both, or neither")
        per_rank = t.batch_size // ranks
        size = t.micro_batch_size or per_rank
        return RankBatches((size,) * ranks, (per_rank // size,) * ranks)
    try:
        sizes = parse_counts(p.micro_batch_size_per_rank, ranks, "parallelism.micro_batch_size_per_rank")
        counts = (parse_counts(p.num_micro_batches_per_rank, ranks, "parallelism.num_micro_batches_per_rank")
                  if p.num_micro_batches_per_rank else (1,) * ranks)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if t.micro_batch_size:
        raise ConfigError("training.micro_batch_size and parallelism.micro_batch_size_per_rank both set the "
                          "micro-batch size; keep one (set training.micro_batch_size = 0)")
    split = RankBatches(sizes, counts)
    if split.global_batch != t.batch_size:
        raise ConfigError(f"per-rank micro-batches ({split.describe()}) sum to {split.global_batch} samples, not "
                          f"training.batch_size = {t.batch_size}; change the sizes or counts, or set "
                          f"--training.batch_size {split.global_batch}")
    return split


class Objective(Protocol):
    """What forward_backward needs of the task (tasks.Task has all three)."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def auxiliary_loss(self, model: nn.Module) -> torch.Tensor | None: ...

    def step_metrics(self, outputs: torch.Tensor, targets: torch.Tensor,
                     model: nn.Module) -> dict[str, torch.Tensor]: ...


def forward_backward(model: ParallelModel, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     split: RankBatches, objective: Objective) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Accumulate this rank's gradients over its micro-batches, each sample weighted as one
    of the island's global batch; the gradient reduction runs with the last backward.

    Returns the rank's weighted loss and metrics: averaged over the island's ranks they are
    the global batch's means (no host sync here).
    """
    total = torch.zeros((), device=model.ctx.device)
    extra: dict[str, torch.Tensor] = {}
    for i, (inputs, targets) in enumerate(micro_batches):
        with model.gradient_sync(i == len(micro_batches) - 1, split.keeps_gathered), model.autocast():
            outputs = model.module(inputs)
            loss = objective.loss(outputs, targets)
        weight = split.loss_weight(len(inputs))  # 1 / micro-batches when shares are equal
        total += loss.detach() * weight
        aux = objective.auxiliary_loss(model.inner)  # e.g. the experts' balancing loss
        ((loss if aux is None else loss + aux) * weight).backward()
        for name, value in objective.step_metrics(outputs.detach(), targets, model.inner).items():
            extra[name] = extra.get(name, 0) + value * weight
    return total, extra
