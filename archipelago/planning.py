"""Plan an island of unlike ranks: measure every rank, then split the batch (and, with a
pipeline, the layers) from the measurements (`archipelago plan`, `parallelism.auto`).

Every rank builds the whole model on its own device and times a micro-batch of its share
(island/profile.py); the profiles are gathered inside the island and every rank solves the
same plan from them (island/plan.py), so all ranks agree without another message.
"""

from __future__ import annotations

import logging

from archipelago.config import Config, ConfigError
from archipelago.config.counts import parse_factors
from archipelago.island.batches import RankBatches
from archipelago.island.device import IslandContext, all_gather_objects
from archipelago.island.parallelize import model_blocks
from archipelago.island.plan import (
    BatchSplit,
    IslandPlan,
    PlanError,
    RankSpeed,
    StageCosts,
    split_batch,
    split_layers,
)
from archipelago.island.profile import RankProfile, profile_rank
from archipelago.tasks import Task

log = logging.getLogger("archipelago.planning")


def _slowdown(cfg: Config, ctx: IslandContext) -> float:
    if not cfg.island.rank_slowdown:
        return 1.0
    return parse_factors(cfg.island.rank_slowdown, ctx.world_size, "island.rank_slowdown")[ctx.rank]


def measure_rank(cfg: Config, ctx: IslandContext, task: Task) -> RankProfile:
    """This rank's profile: the whole model on this rank's device, a micro-batch of an even share."""
    built = task.build_model()
    model = built.module
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(f"plan: {built.description} is built on the meta device (1B parameters or more) and "
                          "cannot be timed whole on one rank yet; plan with a smaller flavor of the same family")
    model.to(ctx.device)
    blocks = [parent.get_submodule(name) for parent, name in model_blocks(model)]
    size = max(1, cfg.training.micro_batch_size or cfg.training.batch_size // ctx.world_size)
    inputs, targets = task.train_loader(0, 1, 0, 1, lambda _m: None).next_batch()
    factor = _slowdown(cfg, ctx)
    profile = profile_rank(model, blocks, (inputs[:size], targets[:size]), task.loss, ctx.rank, ctx.device,
                           slowdown=factor)
    if factor > 1:  # the device name says the speed is emulated
        profile = RankProfile(**{**profile.__dict__, "device": f"{profile.device} (EMULATED {factor:g}x slower)"})
    del model
    return profile


def plan_from_profiles(profiles: list[RankProfile], global_batch: int) -> IslandPlan:
    """The batch split for these measured ranks (PlanError naming the fix when none fits)."""
    model_bytes = sum(profiles[0].layer_bytes)
    speeds = [RankSpeed(p.sample_s, p.max_micro_batch(model_bytes)) for p in profiles]
    for p, speed in zip(profiles, speeds):
        if p.activation_bytes > 0 and speed.max_micro_batch < 1:
            raise PlanError(f"rank {p.rank} ({p.device}) cannot hold the model and one sample: it needs "
                            f"{(model_bytes + p.activation_bytes) / 2**30:.1f} GiB of "
                            f"{p.memory_bytes / 2**30:.1f}; shard it (data_parallel = fsdp) or use a smaller model")
    return IslandPlan(split_batch(speeds, global_batch))


def stage_costs(profile: RankProfile, micro_batch: int) -> StageCosts:
    """What a stage on this rank's device would spend per pipeline micro-batch, and hold."""
    return StageCosts(layer_s=tuple(t * micro_batch for t in profile.layer_s),
                      first_extra_s=profile.first_s * micro_batch, last_extra_s=profile.last_s * micro_batch,
                      memory_bytes=profile.memory_bytes,
                      layer_bytes=tuple(b + profile.activation_bytes * micro_batch / len(profile.layer_bytes)
                                        for b in profile.layer_bytes))


def plan_pipeline(profiles: list[RankProfile], global_batch: int, micro_batches: int, schedule: str) -> IslandPlan:
    """Layers per stage (stage k on rank k) for these measured ranks, exactly (island/plan.py)."""
    micro_batch = global_batch // micro_batches
    stages = split_layers([stage_costs(p, micro_batch) for p in profiles])
    # A pipelined island is one data-parallel rank: the whole batch, in the pipeline's micro-batches.
    batch = BatchSplit((micro_batch,), (micro_batches,), (stages.bottleneck_s / micro_batch,))
    return IslandPlan(batch, stages, pipeline_micro_batches=micro_batches, schedule=schedule)


def plan_island(cfg: Config, ctx: IslandContext, task: Task) -> tuple[IslandPlan, list[RankProfile]]:
    """Measure every rank (a collective), then the plan every rank derives the same way: the
    batch split, or with parallelism.pipeline_stages > 1 the layers of each stage."""
    p, batch = cfg.parallelism, cfg.training.batch_size
    if p.pipeline_stages > 1 and (ctx.world_size != p.pipeline_stages or p.pipeline_schedule == "interleaved_1f1b"):
        raise ConfigError(f"plan: pipelines are planned with one rank per stage (--nproc {p.pipeline_stages}) under "
                          "the 1f1b or gpipe schedule; plan that layout, then set parallelism.stage_layers for "
                          "more ranks per stage or the interleaved schedule")
    profiles = all_gather_objects(measure_rank(cfg, ctx, task), ctx)
    try:
        if p.pipeline_stages > 1:
            return plan_pipeline(profiles, batch, p.pipeline_micro_batches or 2 * p.pipeline_stages,
                                 p.pipeline_schedule), profiles
        return plan_from_profiles(profiles, batch), profiles
    except PlanError as exc:
        raise ConfigError(f"plan: {exc}") from exc


def rank_batches_of(plan: IslandPlan) -> RankBatches:
    return RankBatches(plan.batch.micro_batch_size, plan.batch.num_micro_batches)


def profile_lines(profiles: list[RankProfile]) -> list[str]:
    """One line per measured rank, in plain numbers."""
    return [f"rank {p.rank} ({p.device}): {p.sample_s * 1e3:.2f} ms per sample forward and backward "
            f"(micro-batch of {p.micro_batch}); per layer "
            + ", ".join(f"{t * 1e3:.2f}" for t in p.layer_s) + " ms" for p in profiles]
