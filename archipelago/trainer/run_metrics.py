"""What an island's run reports (`RunMetrics`): metrics.jsonl, TensorBoard, the live display,
summary.json."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from archipelago.config import Config
from archipelago.island.device import IslandContext, all_reduce_
from archipelago.island.parallelize import ParallelModel
from archipelago.metrics import (
    MetricsLog,
    ProgressDisplay,
    TensorBoardLog,
    ThroughputMeter,
    peak_flops_per_s,
    write_json_atomic,
)
from archipelago.metrics.progress import format_count
from archipelago.metrics.push import RecordPusher
from archipelago.trainer.state import Progress, StepResult

log = logging.getLogger("archipelago.trainer")


class RunMetrics:
    """Everything the trainer reports: metrics.jsonl, TensorBoard, the live display, summary.json.

    Losses stay on the device until a log step: reading them every step would be a
    host-device sync point that stalls the GPU queue.
    """

    def __init__(self, cfg: Config, ctx: IslandContext, run_dir: Path, model: ParallelModel,
                 flops_per_token: float, tokens_per_step: int, unit: str = "tok",
                 emulated_s: Callable[[], float] = lambda: 0.0, pusher: RecordPusher | None = None) -> None:
        """`emulated_s`: seconds an emulated slow rank has waited so far (counted as busy);
        `pusher`: where records also go (a federation dashboard)."""
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        self.tokens_per_step, self.unit = tokens_per_step, unit
        leader = ctx.is_leader
        self.jsonl = MetricsLog(run_dir / "metrics.jsonl", enabled=leader)
        self.pusher = pusher
        self.tensorboard = TensorBoardLog(run_dir / "tensorboard", enabled=leader and cfg.metrics.tensorboard)
        self.display: ProgressDisplay | None = None  # made in start(), once the first step is known
        self.flops_per_token = flops_per_token
        self.peak, self.peak_source = peak_flops_per_s(ctx.device, model.dtype, cfg.metrics.peak_tflops)
        self.meter = ThroughputMeter(window=1)  # each update is already a whole log window
        self.first_bad = torch.full((), -1, dtype=torch.long, device=ctx.device)
        self.poison_next_loss = False
        self.started = self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_untimed = 0.0  # seconds of validation/checkpointing inside the window
        # Each rank's idle share of the step (`rank_idle`, a pipeline's bubble): busy is this
        # thread's CPU time plus emulated waits. Only on a CPU: a GPU's host thread mostly
        # waits for the device, so its CPU time says nothing about the device being busy.
        self.busy_clock = (lambda: time.thread_time() + emulated_s()) if ctx.device.type == "cpu" else None
        self.window_busy = self.busy_clock() if self.busy_clock else 0.0
        self.window_untimed_busy = 0.0
        self.idle_history: list[list[float]] = []  # every record's rank_idle, this session (a re-plan reads it)
        self.start_step, self.wall_before = 0, 0.0

    def start(self, progress: Progress, token_budget: int | None = None) -> None:
        """Begin this session's clock where the (possibly resumed) run stands. With a
        `token_budget` (time-paced rounds) the display counts the federation's tokens toward
        it, not steps: an island's step count is not what ends the run."""
        self.display = ProgressDisplay(token_budget or self.cfg.training.steps, start_step=progress.step,
                                       mode=self.cfg.metrics.progress, enabled=self.ctx.is_leader,
                                       title=self.cfg.job.name, time_limit_s=self.cfg.training.time_budget_s,
                                       unit=self.unit, budget_unit=self.unit if token_budget else None)
        self.started = self.window_start = time.perf_counter()
        self.window_busy = self.busy_clock() if self.busy_clock else 0.0
        self.start_step, self.wall_before = progress.step, progress.wall_s
        log.info("peak %.2f TFLOP/s per rank (%s) used for MFU", self.peak / 1e12, self.peak_source)

    def wall_s(self) -> float:
        """Wall-clock seconds of training so far, over all sessions of the run."""
        return self.wall_before + time.perf_counter() - self.started

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Leave the enclosed work (validation, checkpointing) out of tokens/s and MFU."""
        began, busy = time.perf_counter(), self.busy_clock() if self.busy_clock else 0.0
        try:
            yield
        finally:
            self.window_untimed += time.perf_counter() - began
            if self.busy_clock:
                self.window_untimed_busy += self.busy_clock() - busy

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """Record the first step whose loss is not finite, without a host sync."""
        if self.poison_next_loss:
            loss.fill_(float("nan"))
            self.poison_next_loss = False
        bad = ~torch.isfinite(loss) & (self.first_bad < 0)
        self.first_bad = torch.where(bad, torch.full_like(self.first_bad, step), self.first_bad)
        self.window_steps += 1

    def first_nonfinite_step(self) -> int | None:
        """The earliest non-finite step on any rank (a collective and a host sync point).

        Every rank learns about any rank's NaN, so all stop together and none is left
        waiting in a collective.
        """
        never = 2**62
        mine = torch.where(self.first_bad < 0, torch.full_like(self.first_bad, never), self.first_bad)
        first = int(all_reduce_(mine.clone(), self.ctx, op="min"))
        return None if first >= never else first

    def log_step(self, step: int, result: StepResult, tokens: int, validation: dict[str, float] | None,
                 position: float | None = None) -> float:
        """Write one step record; returns the loss averaged over the island's ranks.
        `position`: where the run stands toward the display's total (steps, or tokens)."""
        # float() waits for the device to finish the queued steps, so the clock read
        # after it covers their whole compute time (this is the host sync point).
        loss_avg = float(all_reduce_(result.loss.detach().clone(), self.ctx, op="avg"))
        now = time.perf_counter()
        window_tokens = self.window_steps * self.tokens_per_step
        timed = now - self.window_start - self.window_untimed
        self.meter.update(window_tokens, timed)
        idle = self.rank_idle(timed)
        self.window_start, self.window_steps, self.window_untimed = now, 0, 0.0
        tokens_per_s = self.meter.tokens_per_s()
        mfu = self.shown_mfu(self.meter.mfu(self.flops_per_token, self.peak * self.ctx.world_size))
        record: dict[str, Any] = {"step": step, "loss": loss_avg, "lr": result.lr, "grad_norm": float(result.grad_norm),
                  "tokens": tokens, "tokens_per_s": tokens_per_s, "mfu": mfu,
                  "elapsed_s": now - self.started, "time": time.time()}
        if idle is not None:
            record["rank_idle"] = idle
            self.idle_history.append(idle)
        for name, value in result.extra.items():  # the task's own, e.g. accuracy
            record[name] = float(all_reduce_(value.detach().clone(), self.ctx, op="avg"))
        record.update(validation or {})
        self.write(record)
        self.tensorboard.log(step, {k: v for k, v in record.items() if k != "step"})
        if self.display is not None:
            self.display.update(step, record, position)
        return loss_avg

    _mfu_warned = False

    def shown_mfu(self, mfu: float) -> float | None:
        """MFU, or None (`n/a`) above 100%: a measured peak (a CPU's, taken while other ranks or
        islands shared its cores) can be below what training then reaches; a fraction over 1
        would say nothing true. Logged once, naming metrics.peak_tflops for a stated peak."""
        if mfu <= 1.0 or self.peak_source.startswith("override"):
            return mfu
        if not self._mfu_warned:
            self._mfu_warned = True
            log.warning("MFU shown as n/a: training reached %.0f%% of the %s (%.2f TFLOP/s per rank), which was "
                        "taken while the cores were shared; set --metrics.peak_tflops to the device's nominal peak "
                        "for a true MFU", 100 * mfu, self.peak_source, self.peak / 1e12)
        return None

    def rank_idle(self, timed_s: float) -> list[float] | None:
        """Every rank's idle share of the window's training time (a collective), on a CPU
        island of several ranks; None elsewhere. Restarts the busy count."""
        if self.busy_clock is None or self.ctx.world_size == 1:
            return None
        now = self.busy_clock()
        busy = now - self.window_busy - self.window_untimed_busy
        self.window_busy, self.window_untimed_busy = now, 0.0
        shares = torch.zeros(self.ctx.world_size, dtype=torch.float64, device=self.ctx.device)
        shares[self.ctx.rank] = min(1.0, max(0.0, 1.0 - busy / timed_s)) if timed_s > 0 else 0.0
        return [round(float(x), 4) for x in all_reduce_(shares, self.ctx)]

    def write(self, record: dict[str, Any]) -> None:
        """One record to metrics.jsonl, and to the dashboard when there is one."""
        self.jsonl.log(record)
        if self.pusher is not None:
            self.pusher.push(record)

    def log_validation(self, step: int, validation: dict[str, float]) -> None:
        """A validation-only record (the evaluation before the first step)."""
        self.write({"step": step, **validation, "tokens": 0})
        self.tensorboard.log(step, validation)
        if self.display is not None:
            accuracy = f", accuracy {validation['val_accuracy']:.3f}" if "val_accuracy" in validation else ""
            self.display.message(f"step {step}: val {validation['val_loss']:.3f}{accuracy}")

    def outer_step(self, record: dict[str, Any]) -> None:
        """One round of the outer loop (metrics.jsonl `outer_step` event, and a display line)."""
        self.write({"event": "outer_step", "time": time.time(), **record})
        self.tensorboard.log(record["step"], {"outer/participants": record["participants"],
                                              "outer/sync_s": record["sync_s"]})
        if self.display is not None:
            state = "committed" if record["committed"] else "NOT committed"
            extra = " (healed from a peer)" if record["healed"] else ""
            if record["own_refused"]:
                extra += f"; this island's pseudo-gradient REFUSED ({record['own_refused']})"
            if record["overlap_s"] >= 0.01:  # streaming with fragment_sync_delay: the exchange ran behind steps
                extra += (f"; exchange hidden behind {record['overlap_s']:.2f} s of inner steps, "
                          f"then {record['exposed_s']:.2f} s exposed")
            self.display.message(f"outer step {record['outer_step']} {state} with "
                                 f"{record['participants']} island(s){extra}: {record['inner_steps']} inner "
                                 f"steps in {record['compute_s']:.2f} s, waited {record['sync_s']:.2f} s, "
                                 f"sent {format_count(record['bytes_sent'])}B ({record['codec']})")

    def event(self, name: str, **fields: Any) -> None:
        self.write({"event": name, "time": time.time(), **fields})
        if self.display is not None:
            self.display.message(f"{name}: {fields}")

    def finish(self, progress: Progress, params: int) -> dict[str, Any]:
        """Write summary.json (whole-run totals); a session that trained nothing keeps the old one."""
        path = self.run_dir / "summary.json"
        if progress.step == self.start_step and path.is_file():
            return json.loads(path.read_text())
        wall = progress.wall_s
        if self.pusher is not None:  # its last records go now, so its CPU time below is whole
            self.pusher.close()
        summary = {
            "steps": progress.step, "tokens": progress.tokens, "wall_s": wall,
            "tokens_per_s": progress.tokens / wall if wall > 0 else None,
            "final_loss": progress.loss,
            "val_loss": progress.val_loss if math.isfinite(progress.val_loss) else None,
            **({"val_accuracy": progress.val_accuracy} if math.isfinite(progress.val_accuracy) else {}),
            "params": params,
            "model": f"{self.cfg.model.name}/{self.cfg.model.flavor}", "ranks": self.ctx.world_size,
            "device": self.ctx.device.type, "peak_flops_per_s": self.peak,
            "peak_source": self.peak_source, "run_dir": str(self.run_dir),
            # This session's: wall_s spans every session of a resumed run.
            **({"dashboard_push_cpu_s": self.pusher.cpu_s} if self.pusher is not None else {}),
            # The leader's (rank 0, the first bridge rank) peak resident memory in this session.
            "peak_rss_bytes": peak_rss_bytes(),
        }
        if self.ctx.is_leader:
            write_json_atomic(path, summary)
        return summary

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        if self.display is not None:
            self.display.close()
        self.tensorboard.close()
        self.jsonl.close()


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size (Linux reports KiB; None where unknown)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
