"""LoRA: low-rank adapters on a model's linear layers, for fine-tuning.

`add_lora` turns each targeted nn.Linear into a `LoRALinear` in place: the same `weight`
(and `bias`), now frozen, plus two trainable matrices `lora_a` [rank, in] and `lora_b`
[out, rank], with y = x W^T + b + (alpha / rank) dropout(x) A^T B^T. `lora_b` starts at zero,
so the adapted model starts as the base model. Parameter names of the base model do not
change (a Hugging Face import or a checkpoint of the base loads as it is); every other
parameter of the model is frozen too, so the optimizer and the federation, which take the
parameters that require gradients, see the adapters only. `merge_lora` folds the adapters
into the weights for export.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Linear):
    """nn.Linear with a low-rank adapter (see the module docstring)."""

    rank: int
    scale: float

    def init_lora(self, rank: int, alpha: float, dropout: float) -> None:
        self.rank, self.scale, self.lora_dropout = rank, alpha / rank, dropout
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = self.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        if device.type != "meta":
            self.reset_lora()

    def reset_lora(self) -> None:
        """A as nn.Linear initialises its weight (Kaiming uniform), B at zero."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.dropout(x, self.lora_dropout, self.training) @ self.lora_a.t().to(x.dtype)
        return super().forward(x) + (update @ self.lora_b.t().to(x.dtype)) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scale * (self.lora_b @ self.lora_a)


def add_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float = 0.0) -> int:
    """Adapters on every nn.Linear whose name (last part) is in `targets`; freezes everything
    else. Returns the number of adapted layers (ValueError when none matched)."""
    if rank <= 0:
        raise ValueError(f"lora.rank = {rank}: must be positive")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name.rsplit(".", 1)[-1] in targets:
            module.__class__ = LoRALinear  # same weight and bias, now with adapters
            lora_layer: LoRALinear = module  # type: ignore[assignment]
            lora_layer.init_lora(rank, alpha, dropout)
            adapted += 1
    if not adapted:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m) in (nn.Linear, LoRALinear)})
        raise ValueError(f"lora.targets = {','.join(targets)} matched no linear layer; this model's are "
                         f"{', '.join(names)}")
    return adapted


def reset_adapters(model: nn.Module, seed: int) -> None:
    """Initialise every adapter from `seed` (after the model's own init, which does not know them)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.reset_lora()


@torch.no_grad()
def merge_lora(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` (the model's state dict) with each adapted weight replaced by W + scale B A and
    the adapter tensors left out: the state of a plain model with the same outputs."""
    merged = {k: v for k, v in state.items() if not k.endswith((".lora_a", ".lora_b"))}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            a, b = state[f"{name}.lora_a"], state[f"{name}.lora_b"]
            merged[f"{name}.weight"] = state[f"{name}.weight"] + module.scale * (b @ a)
    return merged
