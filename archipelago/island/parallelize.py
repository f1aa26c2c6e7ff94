"""Apply parallelism to a single-device model from the outside.

The model files know nothing about ranks; this module wraps the model's blocks
(`model.layers`) for activation checkpointing, compilation and FSDP2 sharding, or the
whole model for DDP. Order matters and follows the usual recipe: checkpoint wrapper
first, then compile, then shard, so each FSDP unit is one (compiled) block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from archipelago.island.device import IslandContext

if TYPE_CHECKING:  # annotations only: island/ applies parallelism to any model of this shape
    from archipelago.models import Transformer


def compute_dtype(mixed_precision: str, device: torch.device) -> torch.dtype:
    """bf16 on accelerators when `auto`; fp32 on CPU, where bf16 matmuls are slower."""
    if mixed_precision == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float32


def _wrap_blocks(model: Transformer, activation_checkpointing: bool, compile_blocks: bool) -> None:
    for name, block in list(model.layers.named_children()):
        if activation_checkpointing:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if compile_blocks:
            block.compile()
        model.layers.register_module(name, block)


def _shard(model: Transformer, ctx: IslandContext, dtype: torch.dtype) -> None:
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp_shard",))
    # Gradients are reduced in fp32 even when compute is bf16: the reduction over many
    # ranks is where bf16 rounding would accumulate.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers.children():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


class ParallelModel:
    """The model as the trainer sees it: the wrapped module plus how to run it."""

    def __init__(self, module: nn.Module, inner: Transformer, ctx: IslandContext,
                 dtype: torch.dtype, strategy: str) -> None:
        # What forward/backward and the optimizer use: the model, or its FSDP / DDP wrapper
        # (typed Any: the wrappers' methods come from classes mixed in at run time).
        self.module: Any = module
        self.inner = inner            # the unwrapped model (args, flops, num_params)
        self.ctx = ctx
        self.dtype = dtype
        self.strategy = strategy      # "single", "fsdp" or "ddp"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast where FSDP's mixed-precision policy does not already cast."""
        if self.dtype == torch.float32 or self.strategy == "fsdp":
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.dtype)

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip the gradient reduction on all but the last micro-batch of an accumulation."""
        if self.strategy == "fsdp":
            self.module.set_requires_gradient_sync(enabled)
            yield
        elif self.strategy == "ddp" and not enabled:
            with self.module.no_sync():
                yield
        else:
            yield


def _materialize(model: Transformer, device: torch.device, seed: int) -> None:
    """Allocate a meta-device model's (local) storage on `device` and initialise it."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        model.init_weights(seed=seed)
    else:
        model.to(device)


def parallelize(model: Transformer, ctx: IslandContext, data_parallel: str, mixed_precision: str,
                activation_checkpointing: bool = False, compile_blocks: bool = False,
                seed: int = 0) -> ParallelModel:
    """Wrap a model for this island and put it on the island's device.

    `model` is either initialised (on CPU) or still on the meta device; a meta model
    is materialised here, after sharding under FSDP so that each rank only ever
    allocates its own shard, and before wrapping under DDP, which broadcasts
    rank 0's weights at construction.
    """
    dtype = compute_dtype(mixed_precision, ctx.device)
    on_meta = any(p.is_meta for p in model.parameters())
    _wrap_blocks(model, activation_checkpointing, compile_blocks)
    if ctx.world_size == 1:
        _materialize(model, ctx.device, seed)
        return ParallelModel(model, model, ctx, dtype, "single")
    if data_parallel == "ddp":
        _materialize(model, ctx.device, seed)
        ddp = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type != "cpu" else None)
        return ParallelModel(ddp, model, ctx, dtype, "ddp")
    if not on_meta:
        model.to(ctx.device)
    _shard(model, ctx, dtype)
    if on_meta:  # only now, so each rank allocates just its own shard
        _materialize(model, ctx.device, seed)
    return ParallelModel(model, model, ctx, dtype, "fsdp")
