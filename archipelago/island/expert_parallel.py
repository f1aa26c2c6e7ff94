"""Expert parallelism inside an island: each rank holds a slice of every MoE layer's experts.

`shard_experts` replaces each expert tensor (stacked on dim 0, one row per expert) by a
DTensor sharded on dim 0 over the island's ranks, so rank r keeps experts
[r E/W, (r+1) E/W): checkpoints (DCP), the optimizer, gradient clipping and the bridge to
other islands see them as they see FSDP2's shards. FSDP then leaves them alone
(`ignored_params`). Each layer's forward dispatches tokens instead of gathering weights:

1. every rank sorts its (token, expert) assignments by expert and tells each rank how many
   rows it will send to each of that rank's experts (an all-to-all of counts);
2. an all-to-all sends the rows to the ranks holding their experts, which run them through
   their local experts in one batched matmul per projection (`Experts.grouped`);
3. a second all-to-all brings the results back, where they are weighted and summed.

Both all-to-alls carry gradients. Each expert's gradient is the sum over the ranks whose
tokens it served; it is divided by the rank count so that, like FSDP's averaged gradients,
an island of W ranks trains as one rank with the whole batch would.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

EXPERT_TENSORS = ("gate_up", "gate_up_bias", "down", "down_bias")


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN401
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN401
        return grad * ctx.scale, None


def _expert_modules(model: nn.Module) -> list[Any]:
    """Stacked experts (gpt_oss, qwen3_moe): modules with `gate_up` and `down` parameters, biases optional."""
    return [m for m in model.modules()
            if all(isinstance(getattr(m, n, None), nn.Parameter) for n in ("gate_up", "down"))]


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Give every rank its slice of each MoE layer's experts (see the module docstring);
    returns the new expert parameters, for FSDP to ignore. ValueError when the model has no
    experts or their count does not divide over the ranks."""
    world, rank = mesh.size(), mesh.get_local_rank()
    layers = _expert_modules(model)
    if not layers:
        raise ValueError("parallelism.expert_parallel: this model has no experts (a mixture-of-experts family "
                         "such as gpt_oss has)")
    sharded: set[nn.Parameter] = set()
    for experts in layers:
        count = experts.gate_up.shape[0]
        if count % world:
            raise ValueError(f"parallelism.expert_parallel: {count} experts do not divide over {world} ranks; "
                             "use a rank count that divides the number of experts")
        if experts.gate_up.is_meta:
            raise ValueError("parallelism.expert_parallel: models initialised on the meta device (1B parameters "
                             "or more) are not supported yet; train without expert_parallel")
        per_rank = count // world
        for name in (n for n in EXPERT_TENSORS if isinstance(getattr(experts, n, None), nn.Parameter)):
            local = getattr(experts, name).detach()[rank * per_rank:(rank + 1) * per_rank].clone()
            param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
            setattr(experts, name, param)
            sharded.add(param)
        experts.forward = types.MethodType(_dispatching_forward, experts)
        experts.expert_group = (mesh.get_group(), world, rank, per_rank)
    return sharded


def _dispatching_forward(self: Any, x: torch.Tensor, experts: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """Experts.forward with the experts spread over the ranks (steps 1-3 of the module docstring)."""
    group, world, rank, per_rank = self.expert_group
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    send = torch.bincount(flat, minlength=world * per_rank)  # rows for each expert, all ranks' experts
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [source rank, my local expert]
    # A CPU-GPU sync point: the all-to-all needs its split sizes on the host.
    send_splits = send.view(world, per_rank).sum(1).tolist()
    recv_splits = received.view(world, per_rank).sum(1).tolist()
    rows = all_to_all_single_autograd(x[order // k].contiguous(), recv_splits, send_splits, group)
    local_expert = torch.arange(per_rank, device=x.device).repeat(world).repeat_interleave(received)
    regroup = local_expert.argsort(stable=True)  # rows arrive by source rank; group them by expert
    held = (getattr(self, name, None) for name in EXPERT_TENSORS)  # an absent bias stays None
    params = tuple(None if p is None else _ScaleGrad.apply(p.to_local(), 1.0 / world).to(x.dtype) for p in held)
    out = self.grouped(rows[regroup], local_expert[regroup], params)[regroup.argsort()]  # back to arrival order
    back = all_to_all_single_autograd(out, send_splits, recv_splits, group)
    back = back * weights.reshape(-1)[order, None].to(back.dtype)
    return x.new_zeros(x.shape).index_add_(0, order // k, back)
