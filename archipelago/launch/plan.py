"""`archipelago plan` on one rank: measure, solve, and (rank 0) print and write the plan."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from archipelago.config import Config
from archipelago.island.device import close_island, init_island
from archipelago.island.plan import to_toml
from archipelago.planning import describe_plan, plan_island, profile_lines
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
        fragment = to_toml(plan)
        Path(out).write_text(fragment)
        flags = " ".join(f"--parallelism.{key} {value.strip(chr(34))}"
                         for key, value in (line.split(" = ") for line in fragment.splitlines()[1:]))
        print("\n".join(["measured:", *profile_lines(profiles), "", "plan:",
                         describe_plan(plan, profiles), "",
                         f"written to {out}; train with it: archipelago train ... {flags}"]))
        sys.stdout.flush()
    return 0
