"""Apply parallelism to a single-device model from the outside.

The model files know nothing about ranks; this module wraps the model's blocks (a
transformer's `model.layers`, a ResNet's four stages) for activation checkpointing,
compilation and FSDP2 sharding, or the whole model for DDP. Order matters and follows the
usual recipe: checkpoint wrapper first, then compile, then shard, so each FSDP unit is one
(compiled) block.

BatchNorm's running statistics are buffers, which neither FSDP nor the optimizer touches:
under FSDP each rank would keep statistics of its own micro-batches. `average_buffers`
averages them over the island's ranks (before every evaluation and checkpoint), so an
island holds one set; DDP already broadcasts rank 0's at every forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from archipelago.island.device import IslandContext, all_reduce_
from archipelago.island.expert_parallel import shard_experts
from archipelago.island.pipeline import Pipeline, PipelineLayout, keep_stage


def compute_dtype(mixed_precision: str, device: torch.device) -> torch.dtype:
    """bf16 on accelerators when `auto`; fp32 on CPU, where bf16 matmuls are slower."""
    if mixed_precision == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float32


RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")


def model_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, name) of each unit parallelism wraps: a transformer's blocks, or a
    ResNet's stages (a whole stage per FSDP unit: its blocks are small)."""
    own = getattr(model, "parallel_blocks", None)
    if callable(own):  # a model that says where its blocks are (the hf family)
        return own()
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.Module):
        return [(layers, name) for name, _ in layers.named_children()]
    if all(isinstance(getattr(model, n, None), nn.Module) for n in RESNET_STAGES):
        return [(model, n) for n in RESNET_STAGES]
    raise TypeError(f"{type(model).__name__}: parallelize knows transformer blocks (`layers`) and ResNet "
                    "stages; say in island/parallelize.py where this model's blocks are")


def wrap_blocks(model: nn.Module, activation_checkpointing: bool, compile_blocks: bool) -> None:
    """Each block checkpointed (its names gain `_checkpoint_wrapped_module.`) and/or compiled, in place."""
    for parent, name in model_blocks(model):
        block = parent.get_submodule(name)
        if activation_checkpointing:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if compile_blocks:
            block.compile()
        parent.register_module(name, block)


def _shard(model: nn.Module, ctx: IslandContext, dtype: torch.dtype, expert_parallel: bool = False) -> None:
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp_shard",))
    # Experts spread over the ranks are already sharded: FSDP leaves them alone.
    _shard_blocks(model, mesh, dtype, shard_experts(model, mesh) if expert_parallel else set())


def _shard_blocks(model: nn.Module, mesh: DeviceMesh, dtype: torch.dtype, ignored: set[nn.Parameter]) -> None:
    """FSDP2 over `mesh`: each block that holds parameters (a pipeline stage's pass-throughs
    for other stages' blocks hold none), then the rest of the model."""
    # Gradients are reduced in fp32 even when compute is bf16: the reduction over many
    # ranks is where bf16 rounding would accumulate.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for parent, name in model_blocks(model):
        block = parent.get_submodule(name)
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)


class ParallelModel:
    """The model as the trainer sees it: the wrapped module plus how to run it."""

    def __init__(self, module: nn.Module, inner: nn.Module, ctx: IslandContext,
                 dtype: torch.dtype, strategy: str) -> None:
        # What forward/backward and the optimizer use: the model, or its FSDP / DDP wrapper
        # (typed Any: the wrappers' methods come from classes mixed in at run time).
        self.module: Any = module
        self.inner = inner            # the unwrapped model (args, flops, num_params)
        self.ctx = ctx
        self.dtype = dtype
        self.strategy = strategy      # "single", "fsdp", "ddp" or "pipeline"
        self.pipeline: Pipeline | None = None  # this rank's stage and schedule, when pipelined
        # A pipeline stage's view of the whole model for the federation (others' on meta).
        self.whole_model_parameters: list[tuple[str, nn.Parameter]] | None = None

    def federation_parameters(self) -> nn.Module | list[tuple[str, nn.Parameter]]:
        """What the federation lays out: the model, or a stage's view of the whole model."""
        return self.inner if self.whole_model_parameters is None else self.whole_model_parameters

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast where FSDP's mixed-precision policy does not already cast."""
        if self.dtype == torch.float32 or self.strategy == "fsdp":
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.dtype)

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool, keep_gathered: bool = False) -> Iterator[None]:
        """Skip the gradient reduction on all but the last micro-batch of an accumulation.

        `keep_gathered` (FSDP, when ranks take unequal shares): FSDP gathers a block's
        parameters at every forward, a collective every rank must join, so a rank with 4
        micro-batches beside one with 2 would wait forever at its third, and ranks of unlike
        micro-batches would wait for each other at every block of every one. Kept gathered
        from the first forward until the last backward, each block is gathered once and
        reduced once per step on every rank, however many micro-batches each runs; it costs
        the memory of the unsharded blocks for the whole step.
        """
        if self.strategy == "fsdp":
            self.module.set_requires_gradient_sync(enabled)
            if keep_gathered:  # the root keeps its parameters gathered after forward anyway
                for unit in self._fsdp_units():
                    if unit is not self.module:
                        unit.set_reshard_after_forward(enabled, recurse=False)
                    unit.set_reshard_after_backward(enabled, recurse=False)
            yield
        elif self.strategy == "ddp" and not enabled:
            with self.module.no_sync():
                yield
        else:
            yield

    def _fsdp_units(self) -> list[Any]:
        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    @torch.no_grad()
    def average_buffers(self) -> None:
        """Average BatchNorm running statistics over the island's ranks (a collective when
        the model has any; every rank holds the same model, so all take the same branch)."""
        if self.ctx.world_size == 1:
            return
        stats = [t for m in self.inner.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and m.track_running_stats for t in (m.running_mean, m.running_var) if t is not None]
        if not stats:
            return
        flat = torch.cat([t.reshape(-1).float() for t in stats])
        all_reduce_(flat, self.ctx, op="avg")
        offset = 0
        for t in stats:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device model's (local) storage on `device` and initialise it."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        model.init_weights(seed=seed)  # type: ignore[operator]  # every model family has init_weights(seed)
    else:
        model.to(device)


def _pipelined(model: nn.Module, ctx: IslandContext, dtype: torch.dtype, layout: PipelineLayout,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], seed: int,
               activation_checkpointing: bool, compile_blocks: bool) -> ParallelModel:
    # Materialised whole, then cut: every stage starts from the one model's weights (a
    # meta-initialised model is allocated whole on each stage's device for a moment).
    _materialize(model, ctx.device, seed)
    whole = keep_stage(model, layout.pipeline_rank(ctx.rank), layout)
    wrap_blocks(model, activation_checkpointing, compile_blocks)
    group = None
    if layout.data > 1:  # FSDP inside each stage: a 2-D mesh, pipeline ranks x data ranks
        mesh = init_device_mesh(ctx.device.type, (layout.ranks, layout.data), mesh_dim_names=("pp", "dp"))
        _shard_blocks(model, mesh["dp"], dtype, ignored=set())
        group = mesh["pp"].get_group()
        sharded = dict(model.named_parameters())  # FSDP put DTensor parameters in place
        whole = [(name, sharded.get(name, p)) for name, p in whole]
    parallel = ParallelModel(model, model, ctx, dtype, "pipeline")
    parallel.whole_model_parameters = whole
    parallel.pipeline = Pipeline(model, ctx, layout, loss_fn, group)
    return parallel


def parallelize(model: nn.Module, ctx: IslandContext, data_parallel: str, mixed_precision: str,
                activation_checkpointing: bool = False, compile_blocks: bool = False,
                seed: int = 0, expert_parallel: bool = False, broadcast_buffers: bool = True,
                pipeline: PipelineLayout | None = None,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> ParallelModel:
    """Wrap a model for this island and put it on the island's device.

    `model` is either initialised (on CPU) or still on the meta device; a meta model
    is materialised here, after sharding under FSDP so that each rank only ever
    allocates its own shard, and before wrapping under DDP, which broadcasts
    rank 0's weights at construction. With `pipeline`, this rank keeps its stage of the
    model (island/pipeline.py) and `loss_fn` is what the last stage computes.
    `broadcast_buffers=False` stops DDP's broadcast of buffers at every forward (a
    collective), for ranks that run different numbers of forwards per step; BatchNorm
    statistics are then averaged by `average_buffers`.
    """
    dtype = compute_dtype(mixed_precision, ctx.device)
    if pipeline is not None:
        assert loss_fn is not None, "a pipeline computes the loss on its last stage: pass loss_fn"
        return _pipelined(model, ctx, dtype, pipeline, loss_fn, seed, activation_checkpointing, compile_blocks)
    on_meta = any(p.is_meta for p in model.parameters())
    wrap_blocks(model, activation_checkpointing, compile_blocks)
    if ctx.world_size == 1:
        _materialize(model, ctx.device, seed)
        return ParallelModel(model, model, ctx, dtype, "single")
    if data_parallel == "ddp":
        _materialize(model, ctx.device, seed)
        ddp = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type != "cpu" else None,
                                      broadcast_buffers=broadcast_buffers)
        return ParallelModel(ddp, model, ctx, dtype, "ddp")
    if not on_meta:
        model.to(ctx.device)
    _shard(model, ctx, dtype, expert_parallel)
    if on_meta:  # only now, so each rank allocates just its own shard
        _materialize(model, ctx.device, seed)
    return ParallelModel(model, model, ctx, dtype, "fsdp")
