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


def _reference_scaled_adamw(params, grads_per_step, lr, betas, eps, decay, ratio):
    """The batch-scaled AdamW written out coordinate by coordinate in float64: Adam's moments,
    then the update divided by sqrt(v_hat / N + m_hat^2 (1 - 1/N)) + eps."""
    b1, b2 = betas
    p = [x.double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, start=1):
        for k, g in enumerate(grads):
            g = g.double()
            p[k] *= 1 - lr * decay[k]
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m_hat, v_hat = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
            p[k] -= lr * m_hat / ((v_hat / ratio + m_hat * m_hat * (1 - 1 / ratio)).sqrt() + eps)
    return p


@pytest.mark.parametrize("ratio", [1.0, 2.0, 3.5])
def test_batch_scaled_adamw_follows_its_formula_and_is_adamw_at_ratio_one(ratio):
    from archipelago.island.optim import BatchScaledAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    start = [p.detach().clone() for p in model.parameters()]
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.1)
    opt = build_optimizer(model, cfg, torch.device("cpu"), batch_scaled=True)
    assert isinstance(opt, BatchScaledAdamW)
    opt.batch_ratio = ratio
    grads_per_step = []
    for _ in range(5):
        x = torch.randn(16, 6)
        opt.zero_grad()
        model(x).square().mean().backward()
        grads_per_step.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    decay = [cfg.weight_decay if p.ndim >= 2 else 0.0 for p in model.parameters()]
    want = _reference_scaled_adamw(start, grads_per_step, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, decay, ratio)
    for got, expected in zip(model.parameters(), want):
        torch.testing.assert_close(got.detach().double(), expected, rtol=0, atol=1e-6)
    moved = max(float((p.detach() - s).abs().max()) for p, s in zip(model.parameters(), start))
    assert moved > 0.01  # the comparison can fail
    if ratio == 1.0:  # exactly torch's AdamW
        twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
        for p, s in zip(twin.parameters(), start):
            p.data.copy_(s)
        plain = build_optimizer(twin, cfg, torch.device("cpu"))
        for grads in grads_per_step:
            for p, g in zip(twin.parameters(), grads):
                p.grad = g.clone()
            plain.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b)


def test_batch_scaled_adamw_takes_larger_steps_where_noise_dominates():
    # Pure noise (mean-zero gradients): m_hat^2 << v_hat, so the denominator shrinks towards
    # sqrt(v_hat / N) and the steps grow towards sqrt(N) times AdamW's.
    from archipelago.island.optim import BatchScaledAdamW

    sizes = {}
    for ratio in (1.0, 4.0):
        p = torch.nn.Parameter(torch.zeros(10_000))
        opt = BatchScaledAdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        opt.batch_ratio = ratio
        torch.manual_seed(0)
        for _ in range(50):
            p.grad = torch.randn(10_000)
            before = p.detach().clone()
            opt.step()
        sizes[ratio] = float((p.detach() - before).abs().mean())
    assert 1.5 < sizes[4.0] / sizes[1.0] <= 2.0, sizes


class _Tiny(torch.nn.Module):
    """An embedding, two hidden linear layers, a norm and a head: what each optimizer steps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.up = torch.nn.Linear(6, 12)
        self.down = torch.nn.Linear(12, 6, bias=False)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.down(torch.relu(self.up(self.embed(x))))))


def test_muon_steps_the_hidden_matrices_as_torchs_muon_and_the_rest_as_adamw():
    torch.manual_seed(0)
    model = _Tiny()
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = OptimizerConfig(name="muon", lr=0.01, weight_decay=0.1, muon_momentum=0.9)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    x = torch.randint(0, 11, (4, 5))
    grads = []
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
    # The same three gradients through torch's own optimizers, one per part of the model.
    hidden = ("up.weight", "down.weight")
    plain = {name: torch.nn.Parameter(t.clone()) for name, t in reference.items()}
    muon = torch.optim.Muon([plain[n] for n in hidden], lr=0.01, weight_decay=0.1, momentum=0.9,
                            adjust_lr_fn="match_rms_adamw")
    matrices = [plain[n] for n in ("embed.weight", "head.weight")]
    rest = [plain[n] for n in ("up.bias", "norm.weight", "norm.bias")]
    adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=0.01, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    for step in grads:
        for name, p in plain.items():
            p.grad = step[name]
        muon.step()
        adamw.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), plain[name].detach(), rtol=1e-6, atol=1e-7, msg=name)
    assert set(optimizer.state[model.up.weight]) == {"momentum_buffer", "step"}
    restored = build_optimizer(model, cfg, torch.device("cpu"))
    restored.load_state_dict(optimizer.state_dict())  # AdamW's loading reads every state's step
    kept = restored.state[model.up.weight]["momentum_buffer"]
    assert torch.equal(kept, optimizer.state[model.up.weight]["momentum_buffer"])
    assert set(optimizer.state[model.head.weight]) >= {"exp_avg", "exp_avg_sq"}


def test_muon_is_refused_where_fsdp_shards_its_matrices_and_with_averaged_moments():
    from archipelago.config import ConfigError, load_config, validate_for_island

    base = ["--config", "configs/llama3/federation.toml", "--optimizer.name", "muon"]
    with pytest.raises(ConfigError, match="average_optimizer_state"):
        load_config([*base, "--fault_tolerance.enable"])
    cfg = load_config([*base, "--parallelism.data_parallel", "fsdp", "--training.batch_size", "8"])
    with pytest.raises(ConfigError, match="FSDP shards them"):
        validate_for_island(cfg, 2)
    validate_for_island(load_config([*base, "--parallelism.data_parallel", "ddp", "--training.batch_size", "8"]), 2)
