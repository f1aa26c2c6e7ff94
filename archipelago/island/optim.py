"""The inner optimizer and its learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from archipelago.config import LRSchedulerConfig, OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (the default) or SGD, with weight decay on matrices only (norm gains and
    biases are not decayed)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernels exist for accelerators; on CPU the foreach path is the fast one.
    fused = device.type in ("cuda", "xpu")
    foreach = None if fused else True
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused, foreach=foreach)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused,
                             foreach=foreach)


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based).

    Linear warmup over `warmup_steps` (starting at 1/(warmup+1), never at 0, so the
    first step already learns), then cosine or linear decay to `min_lr_ratio` at the
    last step.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.decay == "none":
        return 1.0
    span = max(total_steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    if cfg.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                       cfg: LRSchedulerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_factor`; its state (last step) goes into the checkpoint."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg))


def apply_optimizer_config(optimizer: torch.optim.Optimizer,
                           scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimizerConfig) -> None:
    """Make a restored optimizer and schedule follow `cfg` (loading restores the old values).

    Group 0 holds the decayed matrices and group 1 the rest (see build_adamw). The
    schedule keeps its position; its peak becomes `cfg.lr`, and the current learning
    rate is recomputed from it, so the next step already uses the new settings.
    """
    decays = [cfg.weight_decay, 0.0]
    for group, decay in zip(optimizer.param_groups, decays):
        group.update(weight_decay=decay, initial_lr=cfg.lr)
        if isinstance(optimizer, torch.optim.SGD):
            group.update(momentum=cfg.momentum)
        else:
            group.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    set_schedule_position(scheduler, scheduler.last_epoch)


def set_schedule_position(scheduler: torch.optim.lr_scheduler.LambdaLR, step: float) -> None:
    """Put the schedule at step `step` (may be fractional) and set the learning rates from it.

    A time-paced federation places its islands on the schedule by the federation's
    progress rather than by counting each island's own steps.
    """
    scheduler.last_epoch = int(step)  # (a float position is fine for lr_lambdas: lr_factor takes any number)
    groups = scheduler.optimizer.param_groups
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)  # type: ignore[arg-type,operator]
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
