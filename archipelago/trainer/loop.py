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

from archipelago.config import Config, ConfigError, advice, config_to_dict
from archipelago.data import default_cache_dir
from archipelago.federation import Federation, build_federation, scales_inner_batch
from archipelago.federation.trust import FederationKey, dashboard_tag, load_key
from archipelago.island.backends import apply_backend, describe_backend
from archipelago.island.batches import forward_backward
from archipelago.island.device import IslandContext, all_reduce_, barrier, broadcast_object, close_island, init_island
from archipelago.island.emulation import SlowDevice
from archipelago.island.optim import build_lr_scheduler, build_optimizer
from archipelago.island.parallelize import ParallelModel, compute_dtype, parallelize
from archipelago.island.pipeline import check_pipelinable, pipeline_layout
from archipelago.metrics import write_json_atomic
from archipelago.metrics.push import RecordPusher
from archipelago.tasks import Task, TaskModel, build_task
from archipelago.trainer.drills import Drills
from archipelago.trainer.evaluation import evaluate
from archipelago.trainer.hooks import TrainerHooks
from archipelago.trainer.island_data import IslandData
from archipelago.trainer.planner import IslandPlanner
from archipelago.trainer.run_checkpoints import RunCheckpoints, TrainingParts
from archipelago.trainer.run_files import log_to_file, resume_mismatch, stop_logging_to_file
from archipelago.trainer.run_metrics import RunMetrics
from archipelago.trainer.state import Progress, StepResult

log = logging.getLogger("archipelago.trainer")


class Trainer:
    """Trains one model on one island; see the module docstring."""

    model_info: TaskModel  # what build_model built: parameter count and FLOPs per token, for metrics
    compute: str  # what build_model made the island compute with (device, dtype, backend), for the fingerprint

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ctx = self.build_island()
        self.run_dir = self.build_run_dir()
        self.task = self.build_task()
        self.build_dataset()
        self.drills = Drills(cfg, self.ctx)  # emulated slowness and injected faults (tests, demos)
        self.planner = IslandPlanner(cfg, self.ctx, self.task)  # parallelism.auto, rebalance_after
        self.data = self.build_data()  # the batch split now (the model is built for it), the loader later
        self.model = self.build_model()
        self.slow_device = self.build_slow_device()
        self.optimizer = self.build_optimizer()
        self.lr_scheduler = self.build_lr_scheduler()
        self.data.open_loader()
        self.progress = Progress()
        self.federation = self.build_federation()
        self.metrics = self.build_metrics()
        self.checkpoints = self.build_checkpoints()

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

    def build_data(self) -> IslandData:
        """This rank's batch split (parallelism.auto asks the planner), loader and held-out batches."""
        return IslandData(self.cfg, self.ctx, self.task, self.planner)

    def build_model(self) -> ParallelModel:
        t = self.cfg.training
        built = self.task.build_model()
        self.compute = self.apply_backend(built.module)
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
                                   broadcast_buffers=not self.data.batches.uneven_counts,
                                   pipeline=layout, loss_fn=self.task.loss)
        except ValueError as exc:  # e.g. experts that do not divide over the ranks
            raise ConfigError(str(exc)) from exc
        self.model_info = built  # parameter count and FLOPs per token, for metrics
        log.info("model %s: %s parameters, %s FLOPs/token, %s on %d x %s (%s)", built.description,
                 f"{built.num_params:,}", f"{built.flops_per_token:,}",
                 parallel.strategy, self.ctx.world_size, self.ctx.device.type, parallel.dtype)
        return parallel

    def apply_backend(self, module: torch.nn.Module) -> str:
        """training.backend: the model computes through it (island/backends); returns what
        this island computes with, as its fingerprint declares it (`cpu float32, dace 1.0.2, generated loops`)."""
        t = self.cfg.training
        dtype = compute_dtype(t.mixed_precision, self.ctx.device)
        cache = Path(self.cfg.data.cache_dir).expanduser() if self.cfg.data.cache_dir else default_cache_dir()
        try:
            converted = apply_backend(module, t.backend, self.ctx.device, dtype, cache)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if converted:
            log.info("training.backend = %s: %d module(s) compute through it", t.backend, converted)
        return f"{self.ctx.device.type} {str(dtype).removeprefix('torch.')}, {describe_backend(t.backend)}"

    def build_slow_device(self) -> SlowDevice:
        """island.rank_slowdown: this rank's model made that many times slower, unit by unit
        (an emulation for tests and benchmarks; a factor of 1 adds nothing)."""
        return self.drills.slow_device(self.model)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model.module, self.cfg.optimizer, self.ctx.device,
                               batch_scaled=scales_inner_batch(self.cfg.fault_tolerance))

    def build_lr_scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return build_lr_scheduler(self.optimizer, self.cfg.training.steps, self.cfg.lr_scheduler)

    def build_federation(self) -> Federation:
        """The seam to the other islands: `Alone` when fault_tolerance is off, else a
        federation member that has joined the lighthouse (it talks back through TrainerHooks)."""
        return build_federation(self.cfg.fault_tolerance, self.cfg.training.steps,
                                self.model.federation_parameters(), f"{self.cfg.model.name}/{self.cfg.model.flavor}",
                                self.ctx.rank, self.ctx.world_size, self.tokens_per_step, TrainerHooks(self),
                                self.optimizer, self.federation_key, self.cfg.federation_security.insecure,
                                self.compute)

    @functools.cached_property
    def federation_key(self) -> FederationKey | None:
        """The federation key (`[federation_security]`), read once, when a part first needs it."""
        return load_key(self.cfg.federation_security.key_file)

    def build_metrics(self) -> RunMetrics:
        return RunMetrics(self.cfg, self.ctx, self.run_dir, self.model, self.model_info.flops_per_token,
                          self.tokens_per_step, self.task.unit, emulated_s=lambda: self.slow_device.slept_s,
                          pusher=self.build_dashboard_pusher())

    def build_checkpoints(self) -> RunCheckpoints:
        """Where the run starts and what it saves (a federation run always verifies its checkpoints)."""
        parts = TrainingParts(self.model, self.optimizer, self.lr_scheduler, self.data, self.progress,
                              self.federation)
        return RunCheckpoints(self.cfg, self.ctx, self.run_dir, parts, self.task, self.metrics,
                              verify_always=self.federation_key is not None)

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

    # ---- the loop ------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Train to `training.steps` and return the summary (also written to summary.json)."""
        self.checkpoints.resume()
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
        self.drills.warn()
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
        self.checkpoints.save(final=True)

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

    def forward_backward(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's gradients for the step, and the step's loss (and task metrics)."""
        pipeline = self.model.pipeline
        if pipeline is None:
            return forward_backward(self.model, self.data.micro_batches(), self.data.batches, self.task)
        inputs, targets = self.data.next_batch()
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
            self.checkpoints.check_finite()
            self.progress.loss = self.metrics.log_step(step, result, self.progress.tokens, validation,
                                                       position=self.federation.position(step))
            if validation is not None:
                self.progress.record_validation(validation)
            if not final and self.planner.rebalance_due(step, self.model.pipeline is not None,
                                                        len(self.metrics.idle_history)):
                self.rebalance()
        with self.untimed_in_round():
            self.checkpoints.save(final=final)

    def rebalance(self) -> None:
        """Split the batch again from this session's step records (IslandPlanner) and go on
        with it, at the same data position (IslandData.resplit)."""
        before = self.data.batches
        after = self.planner.rebalanced_batches(before, self.metrics.idle_history, self.model.strategy)
        if after is None:
            return
        self.data.resplit(after)
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

    def evaluate(self) -> dict[str, float]:
        """The task's validation metrics over the held-out split (trainer/evaluation.py)."""
        return evaluate(self.model, self.ctx, self.task, self.data.validation_batches())

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
