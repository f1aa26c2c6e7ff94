"""Console progress: a rich live bar on terminals, plain lines elsewhere.

Plain mode exists because live bars turn into megabytes of control codes in
log files (Slurm, nohup, CI). The display never raises on output problems: a
broken or closed stream disables it instead of killing a training run.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, TextIO

log = logging.getLogger("archipelago.metrics")

MODES = ("auto", "rich", "plain", "off")


class ProgressDisplay:
    """Training progress for `total_steps` steps, resuming at `start_step`.

    mode: "auto" (rich bar when `file` is a TTY, else plain lines), "rich",
    "plain" or "off". `update` understands these metric keys (all optional):
    loss, accuracy, lr, tokens_per_s, mfu (a fraction: 0.031 shows as 3.1%), val_loss,
    val_accuracy. `unit` names what tokens_per_s counts ("tok", or "img" for images).
    With `budget_unit` the run ends at a budget of that unit, not a step count (a time-paced
    federation: `total_steps` is then the federation's token budget), and `update`'s
    `position` (tokens so far) drives the bar and the ETA.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        mode: str = "auto",
        enabled: bool = True,
        title: str = "train",
        file: TextIO | None = None,
        time_limit_s: float = 0.0,
        unit: str = "tok",
        budget_unit: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.total_steps = total_steps
        self.start_step = start_step
        # training.time_budget_s: the run ends by then whatever the step count says.
        self.deadline = time.monotonic() + time_limit_s if time_limit_s > 0 else None
        self.title, self.unit, self.budget_unit = title, unit, budget_unit
        self.file = file if file is not None else sys.stdout
        self.mode = _resolve_mode(mode, self.file) if enabled else "off"
        self._progress: Any = None
        self._task: Any = None
        self._first: tuple[float, float] | None = None  # (position, time) of first update, for ETA
        if self.mode == "rich":
            self._start_rich()

    # ------------------------------------------------------------- public API

    def update(self, step: int, metrics: dict[str, Any], position: float | None = None) -> None:
        """Show progress at `step` (toward a budget: at `position`); the caller decides how often."""
        if self.mode == "off":
            return
        now = time.monotonic()
        where = position if self.budget_unit is not None and position is not None else step
        if self._first is None:
            self._first = (where, now)
        info = format_metrics(metrics, self.unit)
        if self.mode == "rich":
            self._guard(lambda: self._progress.update(self._task, completed=where, info=info))
            return
        if self.budget_unit is None:
            parts = [f"step {step}/{self.total_steps}"]
        else:
            parts = [f"step {step}", f"federation {format_count(where)}/{format_count(self.total_steps)} "
                                     f"{self.budget_unit} ({100 * where / max(1, self.total_steps):.0f}%)"]
        parts += [info] if info else []
        eta = self._eta(where, now)
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        self._write(" | ".join(parts))

    def message(self, text: str) -> None:
        """Print `text` above the bar (rich) or as its own line (plain)."""
        if self.mode == "rich":
            self._guard(lambda: self._progress.console.print(text, markup=False, highlight=False))
        elif self.mode == "plain":
            self._write(text)

    def close(self) -> None:
        """Stop the live bar (leaves its final state on screen). Idempotent."""
        if self._progress is not None:
            progress, self._progress = self._progress, None
            try:
                progress.stop()
            except Exception as exc:  # never let cosmetics kill a run
                log.debug("progress bar stop failed: %s", exc)
        if self.mode != "off":
            self.mode = "off"

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- internals

    def _start_rich(self) -> None:
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            console = Console(file=self.file)
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._progress.add_task(
                self.title, total=self.total_steps, completed=self.start_step, info=""
            )
            self._progress.start()
        except Exception as exc:
            log.warning("rich progress bar unavailable (%s): using plain progress lines", exc)
            self._progress = None
            self.mode = "plain"

    def _eta(self, step: float, now: float) -> float | None:
        if self._first is None:
            return None
        first_step, first_time = self._first
        done, elapsed = step - first_step, now - first_time
        if done <= 0 or elapsed <= 0:
            return None
        eta = max(0.0, (self.total_steps - step) * elapsed / done)
        return eta if self.deadline is None else min(eta, max(0.0, self.deadline - now))

    def _write(self, line: str) -> None:
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except (OSError, ValueError) as exc:  # closed stream, broken pipe
            log.warning("progress output failed (%s): progress display disabled", exc)
            self.mode = "off"

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            log.warning("progress bar failed (%s): progress display disabled", exc)
            self.close()


def _resolve_mode(mode: str, file: TextIO) -> str:
    if mode != "auto":
        return mode
    try:
        return "rich" if file.isatty() else "plain"
    except (AttributeError, ValueError, OSError):
        return "plain"


def format_metrics(metrics: dict[str, Any], unit: str = "tok") -> str:
    """'loss 5.123 | lr 3.0e-04 | 12.3k tok/s | mfu 3.1% | val 5.400' (known keys only;
    with accuracies: 'loss 0.512 | acc 81.2% | ... | val 0.480 | val acc 83.0%')."""
    parts = []
    if metrics.get("loss") is not None:
        parts.append(f"loss {_fixed(metrics['loss'])}")
    if metrics.get("accuracy") is not None:
        parts.append(f"acc {100 * float(metrics['accuracy']):.1f}%")
    if metrics.get("lr") is not None:
        parts.append(f"lr {float(metrics['lr']):.1e}")
    if metrics.get("tokens_per_s") is not None:
        parts.append(f"{format_count(metrics['tokens_per_s'])} {unit}/s")
    if metrics.get("mfu") is not None:
        parts.append(f"mfu {100 * float(metrics['mfu']):.1f}%")
    elif "mfu" in metrics:  # above 100% of a measured peak: not shown (the trainer logs why)
        parts.append("mfu n/a")
    if metrics.get("val_loss") is not None:
        parts.append(f"val {_fixed(metrics['val_loss'])}")
    if metrics.get("val_accuracy") is not None:
        parts.append(f"val acc {100 * float(metrics['val_accuracy']):.1f}%")
    return " | ".join(parts)


def _fixed(value: Any) -> str:
    value = float(value)
    return f"{value:.3f}" if math.isfinite(value) else str(value)


def format_count(value: float) -> str:
    """12345 -> '12.3k', 2.5e6 -> '2.5M'; short and fixed-width-ish for logs."""
    value = float(value)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.0f}"


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 192 -> '3m12s', 45 -> '45s'."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
