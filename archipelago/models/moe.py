"""What the mixture-of-experts families share: dropless batched experts and the balancing loss.

`grouped_experts` runs rows (token copies, sorted by expert) through stacked expert FFNs: the
rows are placed in one [experts, capacity, width] buffer, capacity being the busiest
expert's row count, so nothing is dropped, and each projection is one batched matmul over
all experts instead of a loop. `balancing_loss` is the Switch-Transformer load-balancing
loss. gpt_oss and qwen3_moe (and expert parallelism, island/expert_parallel.py) use both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_experts(rows: torch.Tensor, expert_of: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    activation: Callable[[torch.Tensor], torch.Tensor], gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row i through expert expert_of[i] (rows sorted by expert): activation(row gate_up[e]
    + bias) down[e] + bias, for gate_up [E, D, 2F] and down [E, F, D] (these experts' or a
    slice of them)."""
    experts = gate_up.shape[0]
    counts = torch.bincount(expert_of, minlength=experts)
    slot = torch.arange(rows.shape[0], device=rows.device) - (counts.cumsum(0) - counts)[expert_of]
    # One CPU-GPU sync: the buffer's capacity is the busiest expert's load (dropless).
    buffer = rows.new_zeros(experts, int(counts.max()) if rows.shape[0] else 0, rows.shape[1])
    buffer[expert_of, slot] = rows
    hidden = buffer @ gate_up if gate_up_bias is None else torch.baddbmm(gate_up_bias[:, None, :], buffer, gate_up)
    hidden = activation(hidden)
    out = hidden @ down if down_bias is None else torch.baddbmm(down_bias[:, None, :], hidden, down)
    return out[expert_of, slot]


def balancing_loss(logits: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, tokens per expert) for router logits [N, E] and the chosen experts [N, k]:
    experts x sum over experts of (share of the assignments) x (mean router probability);
    1 when the router's probabilities are uniform."""
    experts = logits.shape[-1]
    load = torch.bincount(chosen.reshape(-1), minlength=experts).detach()
    fraction = F.one_hot(chosen, experts).float().mean(dim=(0, 1))
    return experts * (fraction * torch.softmax(logits.float(), dim=-1).mean(0)).sum(), load
