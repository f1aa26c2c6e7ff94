"""The inner optimizer and its learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from archipelago.config import LRSchedulerConfig, OptimizerConfig


class BatchScaledAdamW(torch.optim.AdamW):
    """AdamW whose update is normalised by the second moment of a batch `batch_ratio` times
    larger than the one it sees: an island of a federation steps as if it held the
    federation's combined batch (docs/quality.md, "Each island's AdamW as the federation's").

    Adam divides by sqrt(v), v an estimate of E[g^2] = mu^2 + sigma^2/B for a batch of B. An
    island's gradient comes from its own batch, N times smaller than the federation's, so
    where noise dominates a coordinate its denominator is up to sqrt(N) larger than DDP's on
    the combined batch, and the islands' averaged update smaller. With m^2 estimating mu^2,
    v/N + m^2 (1 - 1/N) estimates mu^2 + sigma^2/(N B), the combined batch's second moment
    (both bias-corrected; m^2 also carries the first moment's own noise, so it errs towards
    the plain denominator). With batch_ratio 1 this is torch's AdamW, unchanged.

    The state (step, exp_avg, exp_avg_sq) is AdamW's: checkpoints and averaged moments are
    the same. Costs two temporaries per parameter in the step (no fused kernel).
    """

    batch_ratio: float = 1.0

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001,ANN201 - torch's signature
        if self.batch_ratio <= 1.0:
            return super().step(closure)
        loss = closure() if closure is not None else None
        n = self.batch_ratio
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)  # AdamW's own state
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
            torch._foreach_add_(steps, 1)
            t = float(steps[0])  # every parameter of a group steps together; a host copy on accelerators
            torch._foreach_mul_(params, 1 - lr * decay)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            first = torch._foreach_div(exp_avgs, 1 - beta1 ** t)
            denominator = torch._foreach_mul(exp_avg_sqs, 1 / ((1 - beta2 ** t) * n))
            torch._foreach_addcmul_(denominator, first, first, 1 - 1 / n)
            torch._foreach_sqrt_(denominator)
            torch._foreach_add_(denominator, eps)
            torch._foreach_addcdiv_(params, first, denominator, -lr)
        return loss


class MuonAdamW(torch.optim.AdamW):
    """Muon for the hidden matrices, AdamW for everything else (embeddings, the output
    head, norm gains, biases, convolutions, stacked experts), in one optimizer with one
    learning-rate schedule (`optimizer.name = "muon"`; MuLoCo's inner optimizer).

    A group with `muon` set takes torch's Muon update (`torch.optim.Muon`: Nesterov
    momentum, orthogonalised by Newton-Schulz iterations, decoupled weight decay) with its
    step scaled to AdamW's RMS (`adjust_lr_fn = "match_rms_adamw"`), so the AdamW learning
    rate serves both; its state is a `momentum_buffer` and a `step` count. The other groups are AdamW's,
    state and all. Muon needs whole matrices: an FSDP island of several ranks (which
    shards them) is refused at the start (config/validate.py).
    """

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001,ANN201 - torch's signature
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, muon

        loss = closure() if closure is not None else None
        everything = self.param_groups
        for group in everything:
            if not group.get("muon"):
                continue
            params = [p for p in group["params"] if p.grad is not None]
            buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
            for p in params:  # counted as AdamW counts (whose loading reads every state's step)
                self.state[p]["step"] = self.state[p].get("step", torch.zeros((), dtype=torch.float32)) + 1
            if params:
                muon(params, [p.grad for p in params], buffers, lr=group["lr"], weight_decay=group["weight_decay"],
                     momentum=group["momentum"], nesterov=True, ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C),
                     ns_steps=5, eps=EPS, adjust_lr_fn="match_rms_adamw", has_complex=False)
        self.param_groups = [group for group in everything if not group.get("muon")]
        try:  # AdamW's own step over the other groups
            super().step()
        finally:
            self.param_groups = everything
        return loss


def muon_matrices(model: nn.Module) -> set[int]:
    """The ids of the parameters Muon steps: the weights of the model's linear layers but
    the last one (the output head, in every family) and any embedding's (a tied head)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {id(m.weight) for m in linears[:-1] if m.weight.ndim == 2 and id(m.weight) not in embedded}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device,
                    batch_scaled: bool = False) -> torch.optim.Optimizer:
    """AdamW (the default), SGD, or Muon with AdamW (`MuonAdamW`), with weight decay on
    matrices only (norm gains and biases are not decayed). `batch_scaled`: AdamW as
    `BatchScaledAdamW` (its `batch_ratio` set by the federation)."""
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
    if cfg.name == "muon":
        hidden = muon_matrices(model)
        groups = [{"params": [p for p in decay if id(p) in hidden], "weight_decay": cfg.weight_decay, "muon": True,
                   "momentum": cfg.muon_momentum},
                  {"params": no_decay, "weight_decay": 0.0, "muon": False},
                  {"params": [p for p in decay if id(p) not in hidden], "weight_decay": cfg.weight_decay,
                   "muon": False, "decayed": True}]
        return MuonAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused, foreach=foreach)
    adamw = BatchScaledAdamW if batch_scaled else torch.optim.AdamW
    return adamw(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused, foreach=foreach)


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

    Group 0 holds the decayed matrices (Muon's under MuonAdamW) and group 1 the rest (see
    build_optimizer; MuonAdamW's group 2, AdamW's decayed matrices, says `decayed`). The
    schedule keeps its position; its peak becomes `cfg.lr`, and the current learning
    rate is recomputed from it, so the next step already uses the new settings.
    """
    for index, group in enumerate(optimizer.param_groups):
        decayed = group.get("decayed", index == 0)  # MuonAdamW's third group: AdamW's decayed matrices
        group.update(weight_decay=cfg.weight_decay if decayed else 0.0, initial_lr=cfg.lr)
        if isinstance(optimizer, torch.optim.SGD):
            group.update(momentum=cfg.momentum)
        elif group.get("muon"):
            group.update(momentum=cfg.muon_momentum)
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
