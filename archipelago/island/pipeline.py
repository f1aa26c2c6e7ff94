"""Pipeline stages inside an island: the model's layers split over ranks, unevenly if asked.

Stage k runs a contiguous run of the transformer's blocks on its own rank; the embedding
sits on the first stage, the final norm and the output projection on the last. Stages are
built by keeping the blocks of the stage and replacing every other part with a
pass-through, not by tracing: the model's own forward runs unchanged on every stage (the
first turns tokens into hidden states, the middle ones pass them through their blocks, the
last turns them into logits), and the parameters keep the model's names ("layers.4.
attention.wq.weight" on whichever stage holds layer 4), so checkpoints and the federation
see the one model.

torch.distributed.pipelining moves activations forward and gradients backward between the
stages (point-to-point sends over the island's process group: gloo on CPU, NCCL on GPUs)
and runs the schedule: GPipe (all micro-batches forward, then all backward), 1F1B (one
forward, one backward in the steady state: at most S micro-batches' activations held) or
interleaved 1F1B (each rank holds V stages, rank r the stages r, r + R, ...: the bubble
shrinks about V-fold for V times the messages; each of a rank's stages is a shallow copy
of its model that shares the parameters and passes through the others' layers).
Each micro-batch's loss is its mean, and the schedule divides gradients by the micro-batch
count, so the step's gradient is the mean over the whole batch, as without a pipeline.

Uneven stages (`stage_layers = "4,2"`) let a faster or larger device take more layers; the
planner (island/plan.py) chooses them from measurements. A stage runs on one rank, or on
several that shard it with FSDP2 (a 2-D mesh of pipeline ranks x data ranks; each data
rank runs its own pipeline on its share of the batch). In a federation the stages'
parameters are laid out as the one model's (federation/layout.py takes each from the ranks
of the stage that holds it), so a pipelined island meets islands split any other way.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from archipelago.config import Config, ConfigError, data_ranks
from archipelago.config.counts import parse_counts
from archipelago.island.device import IslandContext


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a tensor: the local shard of an FSDP (DTensor) one."""
    return t.to_local() if isinstance(t, DTensor) else t


SCHEDULES: dict[str, Any] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                             "interleaved_1f1b": ScheduleInterleaved1F1B}


@dataclass(frozen=True)
class PipelineLayout:
    """How many layers each stage holds, which rank holds it, and how a step is cut into
    micro-batches. Stage k sits on pipeline rank k % ranks (one stage per rank unless
    per_rank > 1); each pipeline rank is `data` island ranks that shard its stages."""

    layers: tuple[int, ...]
    schedule: str
    micro_batches: int
    per_rank: int = 1
    data: int = 1  # ranks per pipeline rank: FSDP shards each stage over them, each reads its own data

    def pipeline_rank(self, rank: int) -> int:
        """Which pipeline rank an island rank is (ranks are pipeline-major: data varies fastest)."""
        return rank // self.data

    @property
    def stages(self) -> int:
        return len(self.layers)

    @property
    def ranks(self) -> int:
        return self.stages // self.per_rank

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.stages, self.ranks))

    def ranges(self) -> Iterator[tuple[int, int]]:
        lo = 0
        for n in self.layers:
            yield lo, lo + n
            lo += n

    def describe(self) -> str:
        where = (lambda k: f" (rank {k % self.ranks})") if self.per_rank > 1 else (lambda k: "")
        return ", ".join(f"stage {k}{where(k)}: layers {lo}-{hi - 1}" for k, (lo, hi) in enumerate(self.ranges()))


def _stage_layers(cfg: Config, n_layers: int, stages: int) -> tuple[int, ...]:
    p = cfg.parallelism
    if p.stage_layers and p.hetero_pipeline_stages:
        raise ConfigError("parallelism.stage_layers and parallelism.hetero_pipeline_stages both set the stages' "
                          "layers; keep one")
    if p.hetero_pipeline_stages:
        tokens = p.hetero_pipeline_stages.split()
        if len(tokens) % 2 or any(t != "1" for t in tokens[::2]):
            raise ConfigError(f"parallelism.hetero_pipeline_stages = {p.hetero_pipeline_stages!r}: write pairs of "
                              "(devices, layers) with one device per stage, e.g. \"1 4 1 2\"")
        text = ",".join(tokens[1::2])
    else:
        text = p.stage_layers
    if not text:
        if n_layers < stages:
            raise ConfigError(f"{stages} pipeline stages exceed the model's {n_layers} layers; each stage needs at "
                              "least one: lower parallelism.pipeline_stages (or stages_per_rank)")
        base, extra = divmod(n_layers, stages)
        return tuple(base + (1 if k < extra else 0) for k in range(stages))
    try:
        layers = parse_counts(text, stages, "parallelism.stage_layers")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if sum(layers) != n_layers:
        raise ConfigError(f"parallelism.stage_layers = {text!r} sums to {sum(layers)} layers; the model has "
                          f"{n_layers}: make the counts sum to {n_layers}")
    return layers


def pipeline_layout(cfg: Config, n_layers: int, ranks: int) -> PipelineLayout | None:
    """The island's pipeline, or None without one (ConfigError naming the fix when the
    settings do not fit the model, the ranks or the batch)."""
    p, t = cfg.parallelism, cfg.training
    if p.pipeline_stages <= 1:
        if p.stage_layers or p.hetero_pipeline_stages or p.stages_per_rank != 1:
            raise ConfigError("parallelism.stage_layers and stages_per_rank need parallelism.pipeline_stages > 1")
        return None
    data = _data_ranks(cfg, ranks)
    if p.micro_batch_size_per_rank or t.micro_batch_size or p.expert_parallel:
        raise ConfigError("a pipelined island cuts its batch with parallelism.pipeline_micro_batches; leave out "
                          "training.micro_batch_size, parallelism.micro_batch_size_per_rank and "
                          "parallelism.expert_parallel")
    if p.auto and (p.stage_layers or p.hetero_pipeline_stages):
        raise ConfigError("parallelism.auto chooses the stages' layers itself: leave out parallelism.stage_layers "
                          "and hetero_pipeline_stages, or drop auto")
    per_rank = _stages_per_rank(cfg)
    layers = _stage_layers(cfg, n_layers, p.pipeline_stages * per_rank)
    micro = p.pipeline_micro_batches or 2 * p.pipeline_stages
    if per_rank > 1 and micro % p.pipeline_stages:
        raise ConfigError(f"parallelism.pipeline_micro_batches = {micro}: interleaved_1f1b takes a multiple of the "
                          f"{p.pipeline_stages} pipeline ranks")
    if micro < p.pipeline_stages:
        raise ConfigError(f"parallelism.pipeline_micro_batches = {micro} is fewer than the {p.pipeline_stages} stages: "
                          "every stage needs a micro-batch in flight; use at least as many micro-batches as stages")
    if t.batch_size % (micro * data):
        per = f" / {data} data ranks" if data > 1 else ""
        raise ConfigError(f"parallelism.pipeline_micro_batches = {micro} does not divide training.batch_size = "
                          f"{t.batch_size}{per}; choose a divisor")
    if per_rank > 1 and data > 1:
        raise ConfigError("interleaved_1f1b runs one rank per pipeline rank: start the island with --nproc "
                          f"{p.pipeline_stages}, or use \"1f1b\" to shard each stage over {data} ranks")
    return PipelineLayout(layers, p.pipeline_schedule, micro, per_rank, data)


def _data_ranks(cfg: Config, ranks: int) -> int:
    """Ranks per pipeline stage: 1, or more that shard the stage with FSDP and read different data."""
    p = cfg.parallelism
    if ranks % p.pipeline_stages:
        raise ConfigError(f"parallelism.pipeline_stages = {p.pipeline_stages} needs a multiple of {p.pipeline_stages} "
                          f"ranks (one per stage, or several sharding each stage); this island has {ranks}: start "
                          f"it with --nproc {p.pipeline_stages} or {2 * p.pipeline_stages}")
    data = data_ranks(cfg, ranks)
    if data > 1 and p.data_parallel != "fsdp":
        raise ConfigError(f"{data} ranks per pipeline stage shard it with FSDP: set parallelism.data_parallel = "
                          "\"fsdp\", or start the island with one rank per stage")
    return data


def _stages_per_rank(cfg: Config) -> int:
    p = cfg.parallelism
    if p.pipeline_schedule == "interleaved_1f1b":
        if p.stages_per_rank < 2:
            raise ConfigError("parallelism.pipeline_schedule = \"interleaved_1f1b\" needs parallelism.stages_per_rank "
                              ">= 2 (the stages each rank interleaves); or use \"1f1b\"")
    elif p.stages_per_rank != 1:
        raise ConfigError(f"parallelism.stages_per_rank = {p.stages_per_rank} needs "
                          "parallelism.pipeline_schedule = \"interleaved_1f1b\"")
    return p.stages_per_rank


class PassThrough(nn.Module):
    """Stands in for a part of the model another stage holds: returns its input."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


def check_pipelinable(model: nn.Module) -> None:
    """Pipelines take transformers whose forward is embedding -> blocks -> norm -> output."""
    parts = ("tok_embeddings", "layers", "norm", "output")
    if not all(isinstance(getattr(model, name, None), nn.Module) for name in parts):
        raise ConfigError(f"{type(model).__name__} cannot be pipelined: pipelines take the llama3 and qwen3 "
                          "families; set parallelism.pipeline_stages = 1")
    if getattr(model, "expert_load", None) is not None:
        raise ConfigError("mixture-of-experts families cannot be pipelined yet (their balancing loss spans every "
                          "layer); set parallelism.pipeline_stages = 1")
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        raise ConfigError("this flavor ties the output to the embedding, which would sit on two stages; choose a "
                          "flavor without tied embeddings or parallelism.pipeline_stages = 1")


def _pass_through_others(model: nn.Module, stages: list[int], layout: PipelineLayout) -> None:
    """Replace, in place, every part of `model` that none of `stages` holds by a pass-through."""
    ranges = list(layout.ranges())
    layers: Any = model.layers
    for k in range(len(layers)):
        if not any(ranges[s][0] <= k < ranges[s][1] for s in stages):
            layers[k] = PassThrough()
    if 0 not in stages:
        model.tok_embeddings = PassThrough()
    if layout.stages - 1 not in stages:
        model.norm = PassThrough()
        model.output = PassThrough()


def keep_stage(model: nn.Module, rank: int, layout: PipelineLayout) -> list[tuple[str, nn.Parameter]]:
    """Replace, in place, every part of `model` that none of `rank`'s stages holds by a pass-through.

    Returns the whole model's (name, parameter) pairs in model order, this rank's own
    parameters and meta placeholders (same shape, no storage) for the others': what the
    federation lays out, so a pipelined island exchanges the one model like any other.
    """
    check_pipelinable(model)
    before = list(model.named_parameters())
    _pass_through_others(model, layout.stages_of(rank), layout)
    kept = {id(p) for p in model.parameters()}
    return [(name, p if id(p) in kept else nn.Parameter(torch.empty_like(p, device="meta"),
                                                       requires_grad=p.requires_grad)) for name, p in before]


def stage_modules(model: nn.Module, rank: int, layout: PipelineLayout) -> list[nn.Module]:
    """The module each of `rank`'s stages runs, in stage order: `model` itself with one stage
    per rank; else, per stage, a shallow copy of `model` (kept by keep_stage) that shares its
    parameters, buffers and hooks and passes through the layers of the rank's other stages.
    Gradients of every copy land on the shared parameters, which the optimizer, the
    checkpoint and the federation see through `model`."""
    if layout.per_rank == 1:
        return [model]
    chunks = []
    for stage in layout.stages_of(rank):
        chunk = copy.copy(model)  # the instance dict is copied; its module dicts must not be shared
        chunk._modules = dict(model._modules)
        chunk.layers = nn.ModuleList(list(model.layers))  # type: ignore[arg-type]
        _pass_through_others(chunk, [stage], layout)
        chunks.append(chunk)
    return chunks


class Pipeline:
    """One stage's share of a pipelined step: runs the schedule, reports the batch's loss."""

    def __init__(self, model: nn.Module, ctx: IslandContext, layout: PipelineLayout,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 group: dist.ProcessGroup | None = None) -> None:
        """`group`: this rank's pipeline ranks (one per stage, the same data rank); the
        island's whole group when each stage has one rank."""
        self.ctx, self.layout = ctx, layout
        # Pipeline rank 0 holds stage 0 (the embedding), the last one the last stage (the output).
        me = layout.pipeline_rank(ctx.rank)
        self.is_first, self.is_last = me == 0, me == layout.ranks - 1
        modules = stage_modules(model, me, layout)
        stages = [PipelineStage(m, k, layout.stages, ctx.device, group=group)
                  for m, k in zip(modules, layout.stages_of(me))]
        # Single-stage schedules take the stage, interleaved ones the rank's list of stages.
        held: Any = stages if layout.per_rank > 1 else stages[0]
        # scale_grads: each micro-batch's loss is its mean, so gradients are divided by
        # the micro-batch count to give the batch's mean (the schedule does it once, after).
        self.schedule = SCHEDULES[layout.schedule](held, n_microbatches=layout.micro_batches,
                                                   loss_fn=loss_fn, scale_grads=True)
        self.eval_schedule = SCHEDULES[layout.schedule](held, n_microbatches=layout.micro_batches)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the whole batch; the batch's mean loss on every rank."""
        losses: list[torch.Tensor] = []
        if self.is_first:
            self.schedule.step(inputs, target=targets if self.is_last else None, losses=losses)
        elif self.is_last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        loss = (torch.stack([x.detach().float() for x in losses]).mean() if losses
                else torch.zeros((), device=self.ctx.device))
        # The last stage of each data rank computed its batch's loss, the others hold 0: the
        # sum over the island's ranks divided by the data ranks is the global batch's mean.
        dist.all_reduce(loss)
        return loss / self.layout.data

    @torch.no_grad()
    def outputs(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's output for `inputs` (forward only), on the last stage; None elsewhere."""
        if self.is_first:
            out = self.eval_schedule.eval(inputs)
        else:
            out = self.eval_schedule.eval()
        return out if self.is_last else None

    @torch.no_grad()
    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm over every stage's gradients (each stage holds only its own)."""
        # Per-parameter norms first, as torch.nn.utils.clip_grad_norm_ takes them, so a
        # pipeline clips exactly as one rank with the whole model would.
        # FSDP inside a stage: each rank holds a distinct shard of its stage's (reduced)
        # gradients, so squares summed over every rank of the island are the global norm's.
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        norms = torch._foreach_norm(grads) if grads else []
        local = sum((n.float() ** 2 for n in norms), torch.zeros((), device=self.ctx.device))
        dist.all_reduce(local)
        norm = local.sqrt()
        if math.isfinite(max_norm):
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm
