"""The run's checkpoints: what a checkpoint holds, when one is written, and where a run
starts (the newest checkpoint, pretrained weights, or its fresh initialisation).

A collaborator of the loop, like torchtitan's checkpointer: it is handed the training
parts it saves (`TrainingParts`) and is asked `resume()` once and `save()` after every
step; it decides whether a save is due. Checkpoints are written by CheckpointManager
(checkpoint/manager.py: DCP, commit markers, signed manifests, pruning).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from archipelago.checkpoint import CheckpointManager, ModelOptimizerState, ObjectState, RNGState
from archipelago.config import Config, ConfigError
from archipelago.federation import Federation
from archipelago.island.device import IslandContext
from archipelago.island.optim import apply_optimizer_config
from archipelago.island.parallelize import ParallelModel
from archipelago.tasks import Task
from archipelago.trainer.island_data import IslandData
from archipelago.trainer.run_files import has_model
from archipelago.trainer.run_metrics import RunMetrics
from archipelago.trainer.state import NonFiniteLossError, Progress

log = logging.getLogger("archipelago.trainer")


@dataclass
class TrainingParts:
    """What a checkpoint holds: the model and optimizer, the schedule, the data position,
    the run's progress and the federation's own state."""

    model: ParallelModel
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    data: IslandData
    progress: Progress
    federation: Federation


class RunCheckpoints:
    """Saves and restores one island's run (see module doc)."""

    def __init__(self, cfg: Config, ctx: IslandContext, run_dir: Path, parts: TrainingParts, task: Task,
                 metrics: RunMetrics, verify_always: bool) -> None:
        self.cfg, self.parts, self.task, self.metrics = cfg, parts, task, metrics
        self.manager = self.build_manager(ctx, run_dir, verify_always)
        self.deferred = False  # a save came due mid-exchange: it is written after the round

    def build_manager(self, ctx: IslandContext, run_dir: Path, verify_always: bool) -> CheckpointManager | None:
        c = self.cfg.checkpoint
        if not c.enable and not c.resume:
            return None
        folder = Path(c.folder) if Path(c.folder).is_absolute() else run_dir / c.folder
        # Manifests are signed with the island's local key (checkpoint/signing.py), not the federation's;
        # a federation run (verify_always) verifies its checkpoints whatever checkpoint.verify says.
        return CheckpointManager(folder, keep=c.keep, rank=ctx.rank, world_size=ctx.world_size,
                                 verify=c.verify or verify_always, accept_unsigned=c.accept_unsigned)

    def state(self, full: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-for-bit.

        `full=False` (checkpoint.scope = "leader" on an island that does not lead) keeps
        only this island's own position: a restart takes the model from a live peer.
        """
        p = self.parts
        own = {
            "data": ObjectState(p.data.state_dict, p.data.load_state_dict),
            "progress": ObjectState(p.progress.state_dict, p.progress.load_state_dict),
            "rng": RNGState(),
        }
        if not full:
            return own
        return {
            "train": ModelOptimizerState(p.model.module, p.optimizer),
            "lr_scheduler": ObjectState(p.lr_scheduler.state_dict, p.lr_scheduler.load_state_dict),
            **own,
            **p.federation.checkpoint_state(),
        }

    def saves_model(self) -> bool:
        """Whether this island writes the model (always, unless checkpoint.scope = "leader")."""
        return self.parts.federation.saves_model(self.cfg.checkpoint.scope)

    def resume(self) -> None:
        """Continue from the newest checkpoint; a fresh run starts from
        checkpoint.initial_load_path when one is set."""
        if self.manager is None or not self.cfg.checkpoint.resume:
            self.load_initial_weights()
            return
        latest = self.manager.latest_path()
        full = latest is None or has_model(latest)
        if not full:
            log.info("the newest checkpoint holds this island's data position only "
                     "(checkpoint.scope = leader): the model comes from a live peer")
        step = self.manager.load_latest(self.state(full))
        if step is not None:
            # The checkpoint restores the optimizer's hyper-parameters too; the config of
            # this run wins, so a resumed run can change lr, betas or weight decay.
            apply_optimizer_config(self.parts.optimizer, self.parts.lr_scheduler, self.cfg.optimizer)
            progress = self.parts.progress
            log.info("resumed from step %d (%s tokens)", progress.step, f"{progress.tokens:,}")
            self.metrics.event("resume", step=progress.step)
        else:
            self.load_initial_weights()

    def load_initial_weights(self) -> None:
        """Pretrained weights (a Hugging Face directory) into the freshly built model. Every
        rank reads the full tensors on CPU and keeps its own shard (FSDP)."""
        folder = self.cfg.checkpoint.initial_load_path
        if not folder:
            return
        state: dict[str, Any] = dict(self.task.initial_weights(folder))
        # Not strict: LoRA adapters are not in a pretrained model (they start at zero); anything else must be.
        result = set_model_state_dict(self.parts.model.module, state,
                                      options=StateDictOptions(full_state_dict=True, strict=False))
        missing = [k for k in result.missing_keys if not k.endswith((".lora_a", ".lora_b"))]
        if missing or result.unexpected_keys:
            raise ConfigError(f"checkpoint.initial_load_path = {folder}: missing {missing[:3]}, unexpected "
                              f"{list(result.unexpected_keys)[:3]}")
        log.info("started from the weights in %s", folder)
        self.metrics.event("initial_load", path=folder)

    def save(self, final: bool = False) -> None:
        """Write a checkpoint if one is due (every checkpoint.interval steps, and the last)."""
        if self.manager is None or not self.cfg.checkpoint.enable:
            return
        step = self.parts.progress.step
        if not (final or step % self.cfg.checkpoint.interval == 0 or self.deferred):
            return
        # Mid-exchange state (an all-reduce in flight) cannot be saved; save after the round.
        self.deferred = self.parts.federation.exchange_pending
        if self.deferred:
            return
        self.check_finite()  # never write a checkpoint of weights that already diverged
        self.parts.model.average_buffers()  # every rank saves the island's one set of BatchNorm statistics
        with self.metrics.untimed():
            self.manager.save(step, self.state(self.saves_model()))

    def check_finite(self) -> None:
        """Stop on a NaN/inf loss seen since the last check (a host sync point), naming the
        last good checkpoint."""
        bad_step = self.metrics.first_nonfinite_step()
        if bad_step is None:
            return
        last = self.manager.latest_step() if self.manager is not None else None
        where = (f"the last good checkpoint is step {last} in {self.manager.folder}; the run "
                 "resumes from it when restarted with the same --job.run_dir"
                 if self.manager is not None and last is not None else "no checkpoint was written before it")
        message = (f"non-finite loss at step {bad_step}: training stopped; {where}. Lower "
                   "--optimizer.lr or --training.max_norm, or check the data.")
        self.metrics.event("nonfinite_loss", step=bad_step, last_checkpoint=last)
        raise NonFiniteLossError(message)
