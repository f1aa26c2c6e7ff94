"""`archipelago plan`: measure the ranks and solve (one rank of the island each), or re-plan
from what a training run measured (`--from-run`, one process); print and write the plan."""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from pathlib import Path

from archipelago.config import Config, ConfigError, load_run_config
from archipelago.island.device import close_island, init_island
from archipelago.island.plan import IslandPlan, PlanError, explain, to_toml
from archipelago.planning import describe_plan, plan_from_run, plan_island, profile_lines
from archipelago.tasks import build_task

log = logging.getLogger("archipelago.plan")


def plan_here(cfg: Config, out: str) -> int:
    """Run as one rank of the island being planned; returns the exit code."""
    ctx = init_island(cfg.training.device)
    try:
        task = build_task(cfg)
        task.prepare(log.info if ctx.is_leader else log.debug)
        plan, profiles = plan_island(cfg, ctx, task)
    finally:
        close_island()
    if ctx.is_leader:
        _write(plan, out, ["measured:", *profile_lines(profiles), "", "plan:", describe_plan(plan, profiles)])
    return 0


def replan_here(cfg: Config, run_dir: str, out: str) -> int:
    """Re-plan the batch split from a run's step records (planning.plan_from_run), with the
    settings that run wrote to RUN_DIR/config.json (the options given where it has none);
    a split given in the options replaces the saved one (a run that chose its own with
    parallelism.auto saved only `auto`)."""
    saved = Path(run_dir) / "config.json"
    if saved.is_file():
        given = cfg.parallelism
        cfg = load_run_config(saved)
        if given.micro_batch_size_per_rank:
            cfg.parallelism = replace(cfg.parallelism, auto=False,
                                      micro_batch_size_per_rank=given.micro_batch_size_per_rank,
                                      num_micro_batches_per_rank=given.num_micro_batches_per_rank)
    try:
        replanned = plan_from_run(cfg, Path(run_dir))
    except PlanError as exc:
        raise ConfigError(f"plan --from-run: {exc}") from exc
    lines = [f"measured in {run_dir}: a step of {replanned.step_s * 1e3:.1f} ms (median of its step records)"]
    for r, (size, count, share, speed) in enumerate(zip(replanned.ran.micro_batch_size,
                                                         replanned.ran.num_micro_batches, replanned.idle,
                                                         replanned.speeds)):
        lines.append(f"  rank {r}: {size} x {count} samples, idle {share:.0%}, "
                     f"{speed.sample_s * 1e3:.2f} ms per sample")
    names = ["measured in the run"] * len(replanned.idle)
    _write(replanned.plan, out, [*lines, "", "plan:", explain(replanned.plan, names)])
    return 0


def _write(plan: IslandPlan, out: str, lines: list[str]) -> None:
    """Write the plan's TOML fragment to `out`; print `lines` and how to train with it."""
    fragment = to_toml(plan)
    Path(out).write_text(fragment)
    flags = " ".join(f"--parallelism.{key} {value.strip(chr(34))}"
                     for key, value in (line.split(" = ") for line in fragment.splitlines()[1:]))
    print("\n".join([*lines, "", f"written to {out}; train with it: archipelago train ... {flags}"]))
    sys.stdout.flush()
