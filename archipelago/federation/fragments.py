"""Fragments of the model and the outer optimizer of their global chunks.

`split_fragments` cuts the model into the contiguous pieces streaming DiLoCo synchronises
one at a time; each fragment's global weights (a flat chunk on a bridge rank) get their
own outer optimizer, whose state is saved and sent to healing peers as plain tensors.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from archipelago.config.schema import FaultToleranceConfig

NamedParameters = Sequence[tuple[str, nn.Parameter]]


def named_parameters(model: nn.Module | NamedParameters) -> list[tuple[str, nn.Parameter]]:
    """The model's (name, parameter) pairs in model order; a pipeline stage passes the whole
    model's, with meta placeholders for the parameters other stages hold."""
    return list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)


def split_fragments(model: nn.Module | NamedParameters, n: int) -> list[list[nn.Parameter]]:
    """The parameters that train (all of them, or only the LoRA adapters), in model order,
    cut into `n` contiguous fragments by layer: a transformer block (`layers.N.`) or a
    ResNet residual block (`layerS.B.`).

    Parameters before the first layer (embeddings, a ResNet's stem) go to the first
    fragment and those after the last (final norm, output, classifier) to the last, as
    torchtitan's fragmenting does.
    """
    named = [(name, p) for name, p in named_parameters(model) if p.requires_grad]  # LoRA: adapters only
    layer_of = _layer_indices([name for name, _ in named])
    count = max([i for i in layer_of if i is not None], default=-1) + 1
    if n > max(count, 1):
        raise ValueError(f"fault_tolerance.num_fragments = {n} exceeds the model's {count} layers")
    fragments: list[list[nn.Parameter]] = [[] for _ in range(n)]
    seen_layer = False
    for (_, p), layer in zip(named, layer_of):
        if layer is None:
            fragments[n - 1 if seen_layer else 0].append(p)
        else:
            seen_layer = True
            fragments[min(layer * n // count, n - 1)].append(p)
    return fragments


# A transformer's blocks (`layers.3.attention...`) or a ResNet's residual blocks, numbered
# within four stages (`layer2.1.conv1.weight`, torchvision's names).
_LAYER = re.compile(r"(?:^|\.)(?:layers\.(\d+)|layer(\d+)\.(\d+))\.")


def _layer_indices(names: list[str]) -> list[int | None]:
    """Each name's layer, numbered 0, 1, ... in the order layers first appear (None: not
    inside a layer)."""
    order: dict[tuple[int, ...], int] = {}
    indices: list[int | None] = []
    for name in names:
        match = _LAYER.search(name)
        if match is None:
            indices.append(None)
            continue
        key = (int(match.group(1)),) if match.group(1) is not None else (int(match.group(2)), int(match.group(3)))
        indices.append(order.setdefault(key, len(order)))
    return indices


def build_outer_optimizer(ft: FaultToleranceConfig, param: torch.Tensor) -> torch.optim.Optimizer:
    """The outer optimizer of one fragment's global chunk (elementwise, so a chunk is enough)."""
    if ft.semi_sync_method == "local_sgd":  # global <- global - mean(global - local) = mean(local)
        opt: torch.optim.Optimizer = torch.optim.SGD([param], lr=1.0)
    elif ft.outer_optimizer == "adamw":
        opt = torch.optim.AdamW([param], lr=ft.outer_lr, betas=(ft.outer_momentum, 0.999),
                                weight_decay=0.0)
    else:
        opt = torch.optim.SGD([param], lr=ft.outer_lr, momentum=ft.outer_momentum,
                              nesterov=ft.outer_nesterov and ft.outer_momentum > 0)
    _materialize(opt, param)
    return opt


def _materialize(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Create the optimizer state before the first step, so checkpoints and healing peers
    always carry it. A zero momentum buffer gives exactly SGD's first step (0*m + g)."""
    state = opt.state[param]
    if isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] > 0:
        state["momentum_buffer"] = torch.zeros_like(param)
    elif isinstance(opt, torch.optim.AdamW):
        state.update(step=torch.zeros((), dtype=torch.float32),
                     exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))


def tensor_state(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in opt.state[param].items() if isinstance(v, torch.Tensor)}


def load_tensor_state(opt: torch.optim.Optimizer, param: nn.Parameter, state: dict[str, Any]) -> None:
    with torch.no_grad():
        param.copy_(state["global"].to(param.device))
        for key, value in state["outer"].items():
            opt.state[param][key].copy_(value.to(opt.state[param][key].device))
