"""Emulations and injected faults, for tests, demos and benchmarks (never a real condition):
`island.slowdown` (every inner step waits (slowdown - 1) x its compute time),
`island.rank_slowdown` (one rank's model slower, unit by unit: island/emulation.py), and the
trainer's faults from ARCHIPELAGO_FAULT (config/faults.py: crash, error or nan-loss at an
inner step).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from archipelago.config import Config, ConfigError
from archipelago.config.counts import parse_factors
from archipelago.config.faults import TRAINER_KINDS, faults_from_env
from archipelago.island.device import IslandContext
from archipelago.island.emulation import SlowDevice
from archipelago.island.parallelize import ParallelModel

log = logging.getLogger("archipelago.trainer")


class Drills:
    """One rank's emulations and injected faults (see module doc)."""

    def __init__(self, cfg: Config, ctx: IslandContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.faults = faults_from_env(TRAINER_KINDS, ctx.rank)

    @functools.cached_property
    def rank_slowdown(self) -> float:
        """This rank's island.rank_slowdown factor (1 = its real speed)."""
        text = self.cfg.island.rank_slowdown
        if not text:
            return 1.0
        try:
            return parse_factors(text, self.ctx.world_size, "island.rank_slowdown")[self.ctx.rank]
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def slow_device(self, model: ParallelModel) -> SlowDevice:
        """island.rank_slowdown: this rank's model made that many times slower, unit by unit
        (a factor of 1 adds nothing)."""
        return SlowDevice(model.inner, self.rank_slowdown, self.ctx.device)

    def warn(self) -> None:
        """Say loudly that the run is slowed on purpose (at the start of training)."""
        if self.cfg.island.slowdown > 1:
            log.warning("island.slowdown = %g: EMULATED slow island, each inner step waits %g x its "
                        "compute time (an experiment setting, not a real speed)",
                        self.cfg.island.slowdown, self.cfg.island.slowdown - 1)
        if self.rank_slowdown > 1:
            log.warning("island.rank_slowdown: EMULATED slow rank %d, each forward and backward waits %g x its "
                        "time (an experiment setting, not a real speed)", self.ctx.rank, self.rank_slowdown - 1)

    def emulate_slowdown(self, compute_s: float) -> None:
        """island.slowdown: wait (slowdown - 1) x the step's compute time (an emulation)."""
        factor = self.cfg.island.slowdown
        if factor <= 1:
            return
        if self.ctx.device.type == "cuda":  # a CPU-GPU sync point; only under emulation
            torch.cuda.synchronize(self.ctx.device)
        time.sleep((factor - 1) * compute_s)

    def inject(self, step: int) -> bool:
        """The faults due at inner step `step`: crash (SIGKILL) or error (raise) here; True
        when the next logged loss is to be poisoned (nan-loss)."""
        poison = False
        for fault in self.faults:
            if fault.at != step:
                continue
            if fault.kind == "crash":
                log.warning("ARCHIPELAGO_FAULT: crashing at step %d", step)
                os.kill(os.getpid(), 9)
            if fault.kind == "error":
                raise RuntimeError(f"ARCHIPELAGO_FAULT: injected failure at step {step}")
            poison = True  # nan-loss
        return poison
