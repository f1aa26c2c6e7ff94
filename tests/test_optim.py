"""Learning-rate schedule and optimizer groups against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from archipelago.config import LRSchedulerConfig, OptimizerConfig
from archipelago.island.optim import build_lr_scheduler, build_optimizer, lr_factor


def test_warmup_is_linear_and_never_zero():
    cfg = LRSchedulerConfig(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, 100, cfg) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lr_factor(4, 100, cfg) == pytest.approx(1.0)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_ends_at_min_ratio_and_passes_the_midpoint(decay):
    cfg = LRSchedulerConfig(warmup_steps=10, decay=decay, min_lr_ratio=0.1)
    total = 111  # decay spans steps 10..110: 100 steps, midpoint at 60
    assert lr_factor(110, total, cfg) == pytest.approx(0.1)
    mid = 0.5 * (1 + math.cos(math.pi * 0.5)) if decay == "cosine" else 0.5
    assert lr_factor(60, total, cfg) == pytest.approx(0.1 + 0.9 * mid)


def test_no_decay_holds_the_peak():
    cfg = LRSchedulerConfig(warmup_steps=0, decay="none", min_lr_ratio=0.1)
    assert lr_factor(0, 10, cfg) == lr_factor(9, 10, cfg) == 1.0


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, OptimizerConfig(lr=0.5), torch.device("cpu"))
    sched = build_lr_scheduler(opt, 20, LRSchedulerConfig(warmup_steps=4))
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2, 0.3])


def test_weight_decay_applies_to_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), torch.device("cpu"))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and [p.ndim for p in decayed["params"]] == [2]
    assert plain["weight_decay"] == 0.0 and all(p.ndim == 1 for p in plain["params"])
