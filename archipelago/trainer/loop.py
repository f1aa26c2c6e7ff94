"""The training loop of one island.

`Trainer.__init__` builds each part through a small `build_*` hook, in dependency
order; a variant overrides one hook instead of copying the constructor. What depends on
the kind of data (text or images: data, model, loaders, loss, metrics) comes from the
task (`build_task`, archipelago/tasks.py). `train()` reads top to bottom: resume,
then step / log / validate / checkpoint until `training.steps`, then summarise.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from archipelago.checkpoint import CheckpointManager, ModelOptimizerState, ObjectState, RNGState
from archipelago.config import Config, ConfigError, advice, config_to_dict, data_ranks, validate_for_island
from archipelago.federation import Federation, build_federation, data_shard, scales_inner_batch
from archipelago.federation.trust import FederationKey, dashboard_tag, load_key
from archipelago.island.batches import RankBatches, forward_backward, rank_batches
from archipelago.island.device import IslandContext, all_reduce_, barrier, broadcast_object, close_island, init_island
from archipelago.island.emulation import SlowDevice
from archipelago.island.optim import apply_optimizer_config, build_lr_scheduler, build_optimizer
from archipelago.island.parallelize import ParallelModel, parallelize
from archipelago.island.pipeline import check_pipelinable, pipeline_layout
from archipelago.metrics import (
    write_json_atomic,
)
from archipelago.metrics.push import RecordPusher
from archipelago.tasks import Task, TaskModel, build_task
from archipelago.trainer.drills import Drills
from archipelago.trainer.hooks import TrainerHooks
from archipelago.trainer.planner import IslandPlanner
from archipelago.trainer.run_files import has_model, log_to_file, resume_mismatch, stop_logging_to_file
from archipelago.trainer.run_metrics import RunMetrics
from archipelago.trainer.state import NonFiniteLossError, Progress, StepResult

log = logging.getLogger("archipelago.trainer")


class Trainer:
    """Trains one model on one island; see the module docstring."""

    model_info: TaskModel  # what build_model built: parameter count and FLOPs per token, for metrics

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ctx = self.build_island()
        self.run_dir = self.build_run_dir()
        self.task = self.build_task()
        self.build_dataset()
        self.drills = Drills(cfg, self.ctx)  # emulated slowness and injected faults (tests, demos)
        self.planner = IslandPlanner(cfg, self.ctx, self.task)  # parallelism.auto, rebalance_after
        self.batches = self.build_rank_batches()
        self.model = self.build_model()
        self.slow_device = self.build_slow_device()
        self.optimizer = self.build_optimizer()
        self.lr_scheduler = self.build_lr_scheduler()
        self.train_loader = self.build_train_loader()
        self.progress = Progress()
        self.federation = self.build_federation()
        self.checkpointer = self.build_checkpointer()
        self.metrics = self.build_metrics()

    # ---- build hooks ---------------------------------------------------------------

    def build_island(self) -> IslandContext:
        ctx = init_island(self.cfg.training.device)
        torch.manual_seed(self.cfg.training.seed)
        return ctx

    def build_run_dir(self) -> Path:
        """The run directory: --job.run_dir, or a new timestamped folder chosen by rank 0."""
        job = self.cfg.job
        chosen = job.run_dir or f"runs/{job.name}-{datetime.now():%Y%m%d-%H%M%S}"
        run_dir = Path(str(broadcast_object(chosen, self.ctx)))
        problem = None
        if self.ctx.is_leader:
            problem = resume_mismatch(run_dir / "config.json", self.cfg)
            if problem is None:
                run_dir.mkdir(parents=True, exist_ok=True)
                write_json_atomic(run_dir / "config.json", config_to_dict(self.cfg))
                log_to_file(run_dir / "train.log")
        problem = broadcast_object(problem, self.ctx)
        if problem is not None:
            raise ConfigError(str(problem))
        return run_dir

    def build_task(self) -> Task:
        """Language modelling or image classification, by the model family (tasks.py)."""
        return build_task(self.cfg)

    def build_dataset(self) -> None:
        """The task's data for this rank: prepared once per machine, found in the cache after.

        Every rank prepares; the cache's file lock lets the first rank of each node build
        the files while the others wait and then find them cached. No collective runs
        meanwhile, so a long tokenizer training cannot hit the process-group timeout, and
        nodes need not share a filesystem for the cache.
        """
        self.task.prepare(log.info if self.ctx.is_leader else log.debug)

    def build_rank_batches(self) -> RankBatches:
        """Each rank's micro-batch size and count (equal shares unless set per rank)."""
        validate_for_island(self.cfg, self.ctx.world_size)
        batches = rank_batches(self.cfg, self.data_ranks)
        if self.cfg.parallelism.auto and self.cfg.parallelism.pipeline_stages <= 1:  # pipelines: in build_model
            batches = self.planner.rank_batches()
        if not batches.even or batches.uneven_counts:
            if self.cfg.parallelism.expert_parallel and batches.uneven_counts:
                raise ConfigError("parallelism.expert_parallel exchanges tokens at every forward, so every rank "
                                  "must run as many micro-batches: give parallelism.num_micro_batches_per_rank "
                                  "equal counts (vary the sizes instead)")
            log.info("island batch split: %s (of %d)", batches.describe(), batches.global_batch)
        return batches

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data (a pipeline's stages share each batch)."""
        return data_ranks(self.cfg, self.ctx.world_size)

    @property
    def data_rank(self) -> int:
        return self.ctx.rank % self.data_ranks

    def build_model(self) -> ParallelModel:
        t = self.cfg.training
        built = self.task.build_model()
        p = self.cfg.parallelism
        layout = pipeline_layout(self.cfg, len(getattr(built.module, "layers", ())), self.ctx.world_size)
        if layout is not None:
            check_pipelinable(built.module)
            if p.auto:
                layout = replace(layout, layers=self.planner.stage_layers())
            log.info("pipeline of %d stages (%s), %s schedule, %d micro-batches per step%s", layout.stages,
                     layout.describe(), layout.schedule, layout.micro_batches,
                     f", {layout.data} data ranks per stage (FSDP)" if layout.data > 1 else "")
        try:
            parallel = parallelize(built.module, self.ctx, p.data_parallel, t.mixed_precision,
                                   t.activation_checkpointing, t.compile, seed=t.seed,
                                   expert_parallel=p.expert_parallel,
                                   broadcast_buffers=not self.batches.uneven_counts,
                                   pipeline=layout, loss_fn=self.task.loss)
        except ValueError as exc:  # e.g. experts that do not divide over the ranks
            raise ConfigError(str(exc)) from exc
        self.model_info = built  # parameter count and FLOPs per token, for metrics
        log.info("model %s: %s parameters, %s FLOPs/token, %s on %d x %s (%s)", built.description,
                 f"{built.num_params:,}", f"{built.flops_per_token:,}",
                 parallel.strategy, self.ctx.world_size, self.ctx.device.type, parallel.dtype)
        return parallel

    def build_slow_device(self) -> SlowDevice:
        """island.rank_slowdown: this rank's model made that many times slower, unit by unit
        (an emulation for tests and benchmarks; a factor of 1 adds nothing)."""
        return self.drills.slow_device(self.model)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model.module, self.cfg.optimizer, self.ctx.device,
                               batch_scaled=scales_inner_batch(self.cfg.fault_tolerance))

    def build_lr_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return build_lr_scheduler(self.optimizer, self.cfg.training.steps, self.cfg.lr_scheduler)

    def build_train_loader(self):  # noqa: ANN201 - the task's loader (next_batch, state_dict)
        t = self.cfg.training
        try:
            if t.val_every:  # checks the held-out split is big enough, before any step
                self.validation_batches()
            shard, shards = data_shard(self.cfg.fault_tolerance)  # islands read disjoint sequences
            return self.task.train_loader(self.data_rank, self.data_ranks, shard, shards, log.info,
                                          None if self.batches.even else list(self.batches.samples))
        except ValueError as exc:  # too little data for seq_len x batch_size
            raise ConfigError(f"data: {exc} (settings: --data.seq_len, --training.batch_size, "
                              "--training.val_batches, --training.val_offset)") from exc

    def validation_batches(self):  # noqa: ANN201 - an iterator of (inputs, targets)
        return self.task.validation_batches(self.data_rank, self.data_ranks)

    def build_federation(self) -> Federation:
        """The seam to the other islands: `Alone` when fault_tolerance is off, else a
        federation member that has joined the lighthouse (it talks back through TrainerHooks)."""
        return build_federation(self.cfg.fault_tolerance, self.cfg.training.steps,
                                self.model.federation_parameters(), f"{self.cfg.model.name}/{self.cfg.model.flavor}",
                                self.ctx.rank, self.ctx.world_size, self.tokens_per_step, TrainerHooks(self),
                                self.optimizer, self.federation_key, self.cfg.federation_security.insecure)

    @functools.cached_property
    def federation_key(self) -> FederationKey | None:
        """The federation key (`[federation_security]`), read once, when a part first needs it."""
        return load_key(self.cfg.federation_security.key_file)

    def build_checkpointer(self) -> CheckpointManager | None:
        c = self.cfg.checkpoint
        if not c.enable and not c.resume:
            return None
        folder = Path(c.folder) if Path(c.folder).is_absolute() else self.run_dir / c.folder
        # Manifests are signed with the island's local key (checkpoint/signing.py), not the federation's;
        # a federation run still verifies its checkpoints whatever checkpoint.verify says, as before.
        return CheckpointManager(folder, keep=c.keep, rank=self.ctx.rank, world_size=self.ctx.world_size,
                                 verify=c.verify or self.federation_key is not None,
                                 accept_unsigned=c.accept_unsigned)

    def build_metrics(self) -> RunMetrics:
        return RunMetrics(self.cfg, self.ctx, self.run_dir, self.model, self.model_info.flops_per_token,
                          self.tokens_per_step, self.task.unit, emulated_s=lambda: self.slow_device.slept_s,
                          pusher=self.build_dashboard_pusher())

    def build_dashboard_pusher(self) -> RecordPusher | None:
        """metrics.dashboard: the island's leader pushes its records there, tagged with the
        federation key when there is one (the dashboard refuses untagged pushes then)."""
        url = self.cfg.metrics.dashboard
        if not url or not self.ctx.is_leader:
            return None
        island = self.cfg.fault_tolerance.replica_id
        key = self.federation_key
        sign = None if key is None else (lambda body: dashboard_tag(key, island, body))
        info = {"ranks": self.ctx.world_size, "device": self.ctx.device.type, "job": self.cfg.job.name,
                "model": f"{self.cfg.model.name}/{self.cfg.model.flavor}"}
        return RecordPusher(url, island, info, sign)

    # ---- state ---------------------------------------------------------------------

    def checkpoint_state(self, full: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs to continue bit-for-bit.

        `full=False` (checkpoint.scope = "leader" on an island that does not lead) keeps
        only this island's own position: a restart takes the model from a live peer.
        """
        own = {
            "data": ObjectState(self.train_loader.state_dict, self.train_loader.load_state_dict),
            "progress": ObjectState(self.progress.state_dict, self.progress.load_state_dict),
            "rng": RNGState(),
        }
        if not full:
            return own
        return {
            "train": ModelOptimizerState(self.model.module, self.optimizer),
            "lr_scheduler": ObjectState(self.lr_scheduler.state_dict, self.lr_scheduler.load_state_dict),
            **own,
            **self.federation.checkpoint_state(),
        }

    def saves_model(self) -> bool:
        """Whether this island writes the model (always, unless checkpoint.scope = "leader")."""
        return self.federation.saves_model(self.cfg.checkpoint.scope)

    def resume(self) -> None:
        """Continue from the newest checkpoint; a fresh run starts from
        checkpoint.initial_load_path when one is set."""
        if self.checkpointer is None or not self.cfg.checkpoint.resume:
            self.load_initial_weights()
            return
        latest = self.checkpointer.latest_path()
        full = latest is None or has_model(latest)
        if not full:
            log.info("the newest checkpoint holds this island's data position only "
                     "(checkpoint.scope = leader): the model comes from a live peer")
        step = self.checkpointer.load_latest(self.checkpoint_state(full))
        if step is not None:
            # The checkpoint restores the optimizer's hyper-parameters too; the config of
            # this run wins, so a resumed run can change lr, betas or weight decay.
            apply_optimizer_config(self.optimizer, self.lr_scheduler, self.cfg.optimizer)
            log.info("resumed from step %d (%s tokens)", self.progress.step, f"{self.progress.tokens:,}")
            self.metrics.event("resume", step=self.progress.step)
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
        result = set_model_state_dict(self.model.module, state,
                                      options=StateDictOptions(full_state_dict=True, strict=False))
        missing = [k for k in result.missing_keys if not k.endswith((".lora_a", ".lora_b"))]
        if missing or result.unexpected_keys:
            raise ConfigError(f"checkpoint.initial_load_path = {folder}: missing {missing[:3]}, unexpected "
                              f"{list(result.unexpected_keys)[:3]}")
        log.info("started from the weights in %s", folder)
        self.metrics.event("initial_load", path=folder)

    def save_checkpoint(self, final: bool = False) -> None:
        if self.checkpointer is None or not self.cfg.checkpoint.enable:
            return
        step = self.progress.step
        due = final or step % self.cfg.checkpoint.interval == 0 or self._checkpoint_deferred
        if not due:
            return
        # Mid-exchange state (an all-reduce in flight) cannot be saved; save after the round.
        self._checkpoint_deferred = self.federation.exchange_pending
        if self._checkpoint_deferred:
            return
        self.check_finite()  # never write a checkpoint of weights that already diverged
        self.model.average_buffers()  # every rank saves the island's one set of BatchNorm statistics
        with self.metrics.untimed():
            self.checkpointer.save(step, self.checkpoint_state(self.saves_model()))

    # ---- the loop ------------------------------------------------------------------

    _checkpoint_deferred = False

    def train(self) -> dict[str, Any]:
        """Train to `training.steps` and return the summary (also written to summary.json)."""
        self.resume()
        self.metrics.start(self.progress, token_budget=self.federation.token_budget_or_none())
        if self.progress.step == 0 and self.cfg.training.val_every:
            validation = self.evaluate()
            self.progress.record_validation(validation)
            self.metrics.log_validation(0, validation)  # the "before" of the curve
        elif self.done():
            log.info("already trained to step %d of %d: nothing to do", self.progress.step,
                     self.cfg.training.steps)
        self.warn_about_settings()
        if not self.done():
            self.join_federation()
            if self.done():  # caught up to the federation's end: its weights are this island's result
                self.finish_after_catch_up()
        self._started = time.monotonic()
        final = self.done()
        while not final:
            started = time.perf_counter()
            result = self.train_step()
            self.drills.emulate_slowdown(time.perf_counter() - started)
            self.progress.step += 1
            self.progress.tokens += self.tokens_per_step
            self.progress.wall_s = self.metrics.wall_s()
            self.metrics.poison_next_loss |= self.drills.inject(self.progress.step)
            self.after_inner_step(time.perf_counter() - started)
            final = self.done()  # once per step: the time budget must not flip between uses
            if final:
                self.federation.finish_rounds()
            self.after_step(result, final=final)
        return self.finish()

    def warn_about_settings(self) -> None:
        """Settings that run but are emulations or known to train worse (config.advice)."""
        if self.cfg.island.slowdown > 1:
            log.warning("island.slowdown = %g: EMULATED slow island, each inner step waits %g x its "
                        "compute time (an experiment setting, not a real speed)",
                        self.cfg.island.slowdown, self.cfg.island.slowdown - 1)
        if self.drills.rank_slowdown > 1:
            log.warning("island.rank_slowdown: EMULATED slow rank %d, each forward and backward waits %g x its "
                        "time (an experiment setting, not a real speed)", self.ctx.rank, self.drills.rank_slowdown - 1)
        if self.ctx.is_leader:
            for message in advice(self.cfg):
                log.warning("%s", message)

    def finish_after_catch_up(self) -> None:
        """Evaluate and save the global weights an island received at the very end. In
        decoupled rounds that overlap, a joiner has also started the members' last exchange
        with them (sending nothing): it finishes it first, as they do, so that it ends on
        the same global weights."""
        self.federation.finish_rounds()
        if self.cfg.training.val_every:
            validation = self.evaluate()
            self.progress.record_validation(validation)
            self.metrics.log_validation(self.progress.step, validation)
        self.save_checkpoint(final=True)

    def done(self) -> bool:
        """Trained enough? `training.steps` inner steps; in a time-paced federation, the
        outer step where the federation has trained as many tokens (the seam decides)."""
        return self.out_of_time() or self.federation.done(self.progress.step)

    _started = float("inf")  # monotonic time of joining (or of the first step); set in train()

    def out_of_time(self) -> bool:
        """training.time_budget_s is spent; a federation island stops only right after an
        outer step, which all islands finish together, so they stop at the same one."""
        budget = self.cfg.training.time_budget_s
        if not budget or not self.federation.at_round_end:
            return False
        spent = float(time.monotonic() - self._started >= budget)
        if self.ctx.world_size > 1:  # ranks' clocks differ: all must stop at the same step
            spent = float(all_reduce_(torch.tensor(spent, device=self.ctx.device), self.ctx, op="max"))
        return spent > 0

    def join_federation(self) -> None:
        """Enter the federation with a round of our own: receive the global weights (from a
        peer if the federation is running) and line up with its step count."""
        self.federation.join(self.progress.step)

    def after_inner_step(self, compute_s: float) -> None:
        """The federation's turn after every inner step (a round ends every sync_steps /
        num_fragments steps, or after round_seconds under time pacing)."""
        self.federation.after_step(self.progress.step, self.tokens_per_step, compute_s)

    def catch_up(self, step: int) -> None:
        """After healing from a peer, continue at the federation's inner step.

        The island now holds the federation's weights; keeping its own (older) step
        count would make it train past the others and finish alone. Its data position
        stays its own: islands read disjoint sequences whatever the step.
        """
        jump = step - self.progress.step
        if jump <= 0:
            return
        log.info("catching up with the federation: inner step %d -> %d", self.progress.step, step)
        self.metrics.event("catch_up", step=self.progress.step, to_step=step)
        with warnings.catch_warnings():  # stepping the schedule without optimizer steps is intended
            warnings.simplefilter("ignore")
            for _ in range(jump):
                self.lr_scheduler.step()
        self.progress.step = step

    @property
    def tokens_per_step(self) -> int:
        """Tokens (text) or images this island trains on per step (the federation's unit of work)."""
        return self.cfg.training.batch_size * self.task.tokens_per_sample

    def micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the global batch, cut into micro-batches for accumulation."""
        inputs, targets = self.train_loader.next_batch()
        size = self.batches.micro_batch_size[self.ctx.rank]  # checked in build_rank_batches
        dev = self.ctx.device
        return [(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
                for x, y in zip(inputs.split(size), targets.split(size))]

    def forward_backward(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's gradients for the step, and the step's loss (and task metrics)."""
        pipeline = self.model.pipeline
        if pipeline is None:
            return forward_backward(self.model, self.micro_batches(), self.batches, self.task)
        inputs, targets = (t.to(self.ctx.device) for t in self.train_loader.next_batch())
        with self.model.autocast():
            return pipeline.step(inputs, targets), {}

    def train_step(self) -> StepResult:
        """One optimizer step (forward/backward over the micro-batches, clip, update)."""
        loss, extra = self.forward_backward()
        grad_norm = self.clip_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return StepResult(loss, grad_norm, lr, extra)

    def clip_gradients(self) -> torch.Tensor:
        params = [p for p in self.model.module.parameters() if p.grad is not None]
        max_norm = self.cfg.training.max_norm or float("inf")
        if self.model.pipeline is not None:  # each stage holds only its own gradients
            return self.model.pipeline.clip_gradients(params, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        # Under FSDP2 the norm is a DTensor; full_tensor() is a (small) collective.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def after_step(self, result: StepResult, final: bool) -> None:
        step, t = self.progress.step, self.cfg.training
        self.metrics.observe(step, result.loss)
        validation = None
        if t.val_every and (step % t.val_every == 0 or final):
            with self.metrics.untimed(), self.untimed_in_round():  # throughput counts training time only
                validation = self.evaluate()
        if step % self.cfg.metrics.log_every == 0 or validation is not None or final:
            self.check_finite()
            self.progress.loss = self.metrics.log_step(step, result, self.progress.tokens, validation,
                                                       position=self.federation.position(step))
            if validation is not None:
                self.progress.record_validation(validation)
            if not final and self.planner.rebalance_due(step, self.model.pipeline is not None,
                                                        len(self.metrics.idle_history)):
                self.rebalance()
        with self.untimed_in_round():
            self.save_checkpoint(final=final)

    def rebalance(self) -> None:
        """Split the batch again from this session's step records (IslandPlanner) and go on
        with it: the data loader is rebuilt for the new shares at the same position (its
        state does not depend on the split), so no sample is skipped or repeated."""
        before = self.batches
        after = self.planner.rebalanced_batches(before, self.metrics.idle_history, self.model.strategy)
        if after is None:
            return
        position = self.train_loader.state_dict()
        self.batches = after
        self.train_loader = self.build_train_loader()
        self.train_loader.load_state_dict(position)
        log.info("parallelism.rebalance_after: at step %d, from %s to %s (measured idle per rank: %s)",
                 self.progress.step, before.describe(), after.describe(),
                 ", ".join(f"{share:.0%}" for share in self.metrics.idle_history[-1]))

    @contextlib.contextmanager
    def untimed_in_round(self) -> Iterator[None]:
        """Evaluation or checkpointing: busy, but neither training nor waiting on other
        islands; the round reports it as `untimed_s` (left out of utilisation)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.federation.add_untimed(time.perf_counter() - began)

    def check_finite(self) -> None:
        """Stop on a NaN/inf loss seen since the last check (a host sync point)."""
        bad_step = self.metrics.first_nonfinite_step()
        if bad_step is None:
            return
        checkpoints = self.checkpointer
        last = checkpoints.latest_step() if checkpoints is not None else None
        where = (f"the last good checkpoint is step {last} in {checkpoints.folder}; the run "
                 "resumes from it when restarted with the same --job.run_dir"
                 if checkpoints is not None and last is not None else "no checkpoint was written before it")
        message = (f"non-finite loss at step {bad_step}: training stopped; {where}. Lower "
                   "--optimizer.lr or --training.max_norm, or check the data.")
        self.metrics.event("nonfinite_loss", step=bad_step, last_checkpoint=last)
        raise NonFiniteLossError(message)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's validation metrics (`val_loss`, and `val_accuracy` for images) over
        the held-out split: the same batches every time."""
        self.model.average_buffers()  # BatchNorm: one set of running statistics per island
        self.model.module.eval()
        sums: torch.Tensor | None = None
        for inputs, targets in self.validation_batches():
            inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
            with self.model.autocast():
                outputs = self.model_outputs(inputs)
            # [loss, count, ...] padded to 3 (what the image task sums); zeros on pipeline
            # stages without the output, so the island's sum is the last stage's.
            batch = (torch.zeros(3, dtype=torch.float64, device=self.ctx.device) if outputs is None else
                     torch.nn.functional.pad(self.task.eval_sums(outputs, targets), (0, 1)).narrow(0, 0, 3))
            sums = batch if sums is None else sums + batch
        self.model.module.train()
        if sums is None:  # every rank yields as many batches, so all take this branch together
            return self.task.eval_metrics(torch.zeros(3, dtype=torch.float64))
        all_reduce_(sums, self.ctx)
        return self.task.eval_metrics(sums)

    def model_outputs(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The model's outputs (forward only); None on pipeline stages before the last."""
        if self.model.pipeline is not None:
            return self.model.pipeline.outputs(inputs)
        return self.model.module(inputs)

    def finish(self) -> dict[str, Any]:
        self.federation.leave()
        summary = self.metrics.finish(self.progress, self.model_info.num_params)
        log.info("done: %d steps, %s tokens in %.1f s, final loss %.4f, val loss %s",
                 summary["steps"], f"{summary['tokens']:,}", summary["wall_s"], summary["final_loss"],
                 f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "n/a")
        return summary

    def abort(self) -> None:
        """After an error: flush what was logged, and run no collective.

        Other ranks may be blocked inside a collective this rank will never join, so a
        barrier here would hang the island; the process exits and torchrun stops the rest.
        """
        self.metrics.close()
        self.federation.shutdown()
        # train.log stays open: the caller logs the failure's reason into it next.

    def close(self) -> None:
        """Release everything after a successful run, in an order that cannot deadlock.

        DDP's reducer owns the gloo process group; freeing it while gloo's worker
        thread still destroys a finished all-reduce (which needs the GIL the freeing
        thread holds) hangs the process. So: wait until no collective is in flight,
        free the model and optimizer while the group is alive, then destroy the group.
        """
        self.metrics.close()
        self.federation.shutdown()
        if self.ctx.is_distributed:
            barrier(self.ctx)
            time.sleep(0.05)  # releases the GIL so gloo's threads finish their clean-up
        self.model = self.optimizer = self.lr_scheduler = None  # type: ignore[assignment]
        gc.collect()
        close_island()
        stop_logging_to_file()


def run_training(cfg: Config) -> dict[str, Any]:
    """Build a Trainer and train; release the process group cleanly only on success."""
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    except BaseException:
        trainer.abort()
        raise
    trainer.close()
    return summary
