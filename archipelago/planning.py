"""Plan an island of unlike ranks: measure every rank, then split the batch (and, with a
pipeline, the layers) from the measurements (`archipelago plan`, `parallelism.auto`).

Every rank builds the whole model on its own device and times a micro-batch of its share
(island/profile.py); the profiles are gathered inside the island and every rank solves the
same plan from them (island/plan.py), so all ranks agree without another message.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from archipelago.config import Config, ConfigError, data_ranks
from archipelago.config.counts import parse_factors
from archipelago.island.batches import RankBatches, rank_batches
from archipelago.island.device import IslandContext, all_gather_objects
from archipelago.island.parallelize import model_blocks
from archipelago.island.plan import (
    BatchSplit,
    IslandPlan,
    PlanError,
    RankSpeed,
    StageCosts,
    calibrate,
    explain,
    split_batch,
    split_layers,
)
from archipelago.island.profile import RankProfile, candidate_sizes, measure_sizes, profile_rank
from archipelago.metrics.islands import finite, is_step_record, island_records
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
    # The data-parallel split also chooses each rank's micro-batch size, from times at several
    # (a few seconds more on a CPU); not where the user fixed the size or a pipeline cuts the batch.
    # The share is timed again there, without profile_rank's block hooks (a device sync per
    # block on a GPU), so that every size is timed alike.
    if not cfg.training.micro_batch_size and cfg.parallelism.pipeline_stages <= 1:
        cap = profile.max_micro_batch(sum(profile.layer_bytes))
        sizes = candidate_sizes(size, cap)
        profile = replace(profile, sample_s_by_size=measure_sizes(model, (inputs, targets), task.loss, ctx.device,
                                                                  sizes, slowdown=factor))
    if factor > 1:  # the device name says the speed is emulated
        profile = replace(profile, device=f"{profile.device} (EMULATED {factor:g}x slower)")
    del model
    return profile


def rank_speeds(profiles: list[RankProfile]) -> list[RankSpeed]:
    """Each measured rank as the batch split sees it: time per sample (by size) and its memory's cap."""
    model_bytes = sum(profiles[0].layer_bytes)
    return [RankSpeed(p.sample_s, p.max_micro_batch(model_bytes), p.sample_s_by_size) for p in profiles]


def plan_from_profiles(profiles: list[RankProfile], global_batch: int, fsdp: bool = False) -> IslandPlan:
    """The batch split for these measured ranks (PlanError naming the fix when none fits);
    `fsdp`: by the step model of ranks that meet at every block (island/plan.py)."""
    model_bytes = sum(profiles[0].layer_bytes)
    speeds = rank_speeds(profiles)
    for p, speed in zip(profiles, speeds):
        if p.activation_bytes > 0 and speed.max_micro_batch < 1:
            raise PlanError(f"rank {p.rank} ({p.device}) cannot hold the model and one sample: it needs "
                            f"{(model_bytes + p.activation_bytes) / 2**30:.1f} GiB of "
                            f"{p.memory_bytes / 2**30:.1f}; shard it (data_parallel = fsdp) or use a smaller model")
    return IslandPlan(split_batch(speeds, global_batch, fsdp=fsdp))


def stage_costs(profile: RankProfile, micro_batch: int, shards: int = 1) -> StageCosts:
    """What a stage on this rank's device would spend per pipeline micro-batch, and hold
    (its weights and optimizer state split over `shards` FSDP ranks)."""
    return StageCosts(layer_s=tuple(t * micro_batch for t in profile.layer_s),
                      first_extra_s=profile.first_s * micro_batch, last_extra_s=profile.last_s * micro_batch,
                      memory_bytes=profile.memory_bytes,
                      layer_bytes=tuple(b / shards + profile.activation_bytes * micro_batch / len(profile.layer_bytes)
                                        for b in profile.layer_bytes))


def _slowest_of(costs: list[StageCosts]) -> StageCosts:
    """A stage sharded over several ranks (FSDP): they meet at every block, so each layer
    takes the slowest rank's time, and the stage fits where its smallest device does."""
    return StageCosts(layer_s=tuple(map(max, zip(*(c.layer_s for c in costs)))),
                      first_extra_s=max(c.first_extra_s for c in costs),
                      last_extra_s=max(c.last_extra_s for c in costs),
                      memory_bytes=min(c.memory_bytes for c in costs),
                      layer_bytes=tuple(map(max, zip(*(c.layer_bytes for c in costs)))))


def plan_pipeline(profiles: list[RankProfile], global_batch: int, micro_batches: int, schedule: str,
                  data: int = 1, stages_per_rank: int = 1) -> IslandPlan:
    """Layers per stage for these measured ranks, exactly (island/plan.py). Ranks are
    pipeline-major: pipeline rank r is island ranks r x data .. r x data + data - 1, each
    running the stage on its own share (global_batch / data, cut into micro_batches); stage k
    sits on pipeline rank k % R (R = len(profiles) / data). Interleaved, the contiguous split
    of the V x R stages minimises the slowest stage, each costed on its rank's device."""
    micro_batch = global_batch // (micro_batches * data)
    ranks = len(profiles) // data
    per_rank = [_slowest_of([stage_costs(p, micro_batch, data) for p in profiles[r * data:(r + 1) * data]])
                for r in range(ranks)]
    stages = split_layers([per_rank[k % ranks] for k in range(ranks * stages_per_rank)])
    plan = IslandPlan(BatchSplit((), (), ()), stages, micro_batches, schedule, stages_per_rank)
    # Each data rank is one pipeline: its share of the batch, in the pipeline's micro-batches.
    sample_s = plan.step_s / (micro_batch * micro_batches)
    batch = BatchSplit((micro_batch,) * data, (micro_batches,) * data, (sample_s,) * data)
    return replace(plan, batch=batch)


def describe_plan(plan: IslandPlan, profiles: list[RankProfile]) -> str:
    """explain() with the measured devices' names: per rank, and per stage the device of its
    pipeline rank (with several ranks per stage or stages per rank, "pipeline rank r: ...")."""
    if plan.stages is None:
        return explain(plan, [p.device for p in profiles])
    data = len(plan.batch.samples)
    ranks = len(profiles) // data
    stage_names = []
    for k in range(len(plan.stages.layers)):
        r = k % ranks
        devices = " + ".join(sorted({p.device for p in profiles[r * data:(r + 1) * data]}))
        stage_names.append(devices if data == 1 and ranks == len(plan.stages.layers) else
                           f"pipeline rank {r}: {devices}")
    return explain(plan, [f"data rank {j}'s pipeline" for j in range(data)], stage_names)


def plan_island(cfg: Config, ctx: IslandContext, task: Task) -> tuple[IslandPlan, list[RankProfile]]:
    """Measure every rank (a collective), then the plan every rank derives the same way: the
    batch split, or with parallelism.pipeline_stages > 1 the layers of each stage."""
    p, batch = cfg.parallelism, cfg.training.batch_size
    profiles = all_gather_objects(measure_rank(cfg, ctx, task), ctx)
    try:
        if p.pipeline_stages > 1:
            return plan_pipeline(profiles, batch, p.pipeline_micro_batches or 2 * p.pipeline_stages,
                                 p.pipeline_schedule, data=data_ranks(cfg, ctx.world_size),
                                 stages_per_rank=p.stages_per_rank), profiles
        return plan_from_profiles(profiles, batch, fsdp=p.data_parallel == "fsdp"), profiles
    except PlanError as exc:
        raise ConfigError(f"plan: {exc}") from exc


def run_measurements(run_dir: Path) -> tuple[list[float], float]:
    """Each rank's median idle share of a step and the median step time, from a training
    run's step records (RUN_DIR/metrics.jsonl). A record's window runs from the record before
    it in the same session, so each session's first (which also holds the warm-up:
    allocations, first touches) is left out; a window's step time is its tokens per step
    over its tokens/s."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        raise PlanError(f"{run_dir} has no metrics.jsonl: give the run directory of a training run "
                        "(its job.run_dir)")
    records = [r for r in island_records(run_dir) if is_step_record(r) and _idle_shares(r.get("rank_idle"))
               and all(finite(r.get(k)) for k in ("tokens_per_s", "tokens", "elapsed_s", "time"))]
    idle, step_s = [], []
    for before, record in zip(records, records[1:]):
        steps, tokens = record["step"] - before["step"], record["tokens"] - before["tokens"]
        if _same_session(before, record) and steps > 0 and tokens > 0 and record["tokens_per_s"] > 0:
            idle.append(record["rank_idle"])
            step_s.append(tokens / steps / record["tokens_per_s"])
    if not idle:
        raise PlanError(f"{run_dir}/metrics.jsonl has fewer than two step records with each rank's idle share "
                        "(rank_idle): CPU islands of two or more ranks write it at every log step; train for more "
                        "steps or log more often (--metrics.log_every)")
    if len({len(shares) for shares in idle}) > 1:
        raise PlanError(f"{run_dir}/metrics.jsonl mixes islands of different sizes; re-plan from one run")
    return [statistics.median(column) for column in zip(*idle)], statistics.median(step_s)


@dataclass(frozen=True)
class Replan:
    """A plan re-made from a run: the split it ran, what it measured, the speeds and the plan."""

    plan: IslandPlan
    ran: RankBatches
    idle: list[float]
    step_s: float
    speeds: tuple[RankSpeed, ...]


def _same_session(before: dict, record: dict) -> bool:
    """Both records from one session of the run: its clock (elapsed_s, which a resumed
    session starts again) advanced as the wall clock (time) did between them."""
    session, wall = record["elapsed_s"] - before["elapsed_s"], record["time"] - before["time"]
    return session > 0 and abs(wall - session) <= max(1.0, 0.05 * wall)


def _idle_shares(value: object) -> bool:
    """A record's rank_idle as the trainer writes it: a list of shares in [0, 1]."""
    return isinstance(value, list) and bool(value) and all(finite(x) and 0 <= x <= 1 for x in value)


def plan_from_run(cfg: Config, run_dir: Path) -> Replan:
    """Re-plan the batch split from what a training run measured (island/plan.py calibrate):
    `cfg` holds the options that run trained with, so its split is known. The shares are
    chosen as for ranks that meet at the step's end (an FSDP island's micro-batch sizes need
    times at several sizes, which a profile gives and a run does not)."""
    if cfg.parallelism.pipeline_stages > 1:
        raise PlanError("re-planning from a run splits the batch over data-parallel ranks; a pipeline's stages "
                        "are planned from a profile (archipelago plan without --from-run)")
    if cfg.parallelism.auto:
        raise PlanError("the run chose its split at start (parallelism.auto); give that split's options instead "
                        "(its log's 'island batch split' line: --parallelism.micro_batch_size_per_rank and "
                        "--parallelism.num_micro_batches_per_rank)")
    idle, step_s = run_measurements(run_dir)
    try:
        ran = rank_batches(cfg, len(idle))
    except ConfigError as exc:
        raise PlanError(f"the options given do not describe the run's {len(idle)} ranks ({exc}); give the "
                        "options the run trained with") from exc
    speeds = calibrate(ran.micro_batch_size, ran.num_micro_batches, idle, step_s)
    # Shares only: a run times each rank at one micro-batch size, and FSDP's step model
    # (which favours small micro-batches) needs times at several; its prediction still applies.
    batch = split_batch(speeds, ran.global_batch)
    return Replan(IslandPlan(replace(batch, fsdp=cfg.parallelism.data_parallel == "fsdp")), ran, idle, step_s,
                  speeds)


def rebalanced(ran: RankBatches, idle_history: list[list[float]], profiled: list[RankSpeed] | None = None,
               fsdp: bool = False) -> RankBatches:
    """The split a run's own step records call for (parallelism.rebalance_after): each rank's
    median idle share over the records after the first (its warm-up), calibrated as
    `plan --from-run` does, or with the `profiled` speeds parallelism.auto measured, each
    rank's profile scaled to the run (micro-batch sizes chosen again too, by the step model of
    `fsdp` islands where it applies). Every rank computes the same from the same all-reduced
    shares (the split does not depend on the step time, which differs a little between ranks)."""
    shares = [statistics.median(column) for column in zip(*idle_history[1:])]
    speeds = calibrate(ran.micro_batch_size, ran.num_micro_batches, shares, 1.0, profiled)
    batch = split_batch(speeds, ran.global_batch, fsdp=fsdp and profiled is not None)
    return RankBatches(batch.micro_batch_size, batch.num_micro_batches)


def rank_batches_of(plan: IslandPlan) -> RankBatches:
    return RankBatches(plan.batch.micro_batch_size, plan.batch.num_micro_batches)


def profile_lines(profiles: list[RankProfile]) -> list[str]:
    """One line per measured rank, in plain numbers."""
    return [f"rank {p.rank} ({p.device}): {p.sample_s * 1e3:.2f} ms per sample forward and backward "
            f"(micro-batch of {p.micro_batch}); per layer "
            + ", ".join(f"{t * 1e3:.2f}" for t in p.layer_s) + " ms" + _by_size(p) for p in profiles]


def _by_size(profile: RankProfile) -> str:
    if not profile.sample_s_by_size:
        return ""
    return "; per sample at micro-batches of " + ", ".join(
        f"{size}: {t * 1e3:.2f}" for size, t in profile.sample_s_by_size) + " ms"
