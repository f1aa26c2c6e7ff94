"""Optional TensorBoard scalar logging (the `tensorboard` extra)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("archipelago.metrics")


class TensorBoardLog:
    """Writes scalars to a TensorBoard event file under `log_dir`.

    tensorboard is an optional dependency: when it is missing and logging is
    enabled, one warning names the install command and every call is a no-op,
    so a run never fails just because TensorBoard is absent.
    """

    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        if enabled:
            self._writer = _make_writer(self.log_dir)

    @property
    def active(self) -> bool:
        """True when scalars are really being written."""
        return self._writer is not None

    def log(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Add each number at `step` (NaN is kept: TensorBoard shows it); a list of numbers
        (one per rank, as `rank_idle`) as `name/0`, `name/1`, ...; None and text are left out."""
        if self._writer is None:
            return
        for name, value in scalars.items():
            if isinstance(value, (list, tuple)):
                for k, item in enumerate(value):
                    self._add(f"{name}/{k}", item, step)
            else:
                self._add(name, value, step)

    def _add(self, name: str, value: Any, step: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._writer.add_scalar(name, float(value), global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning(
            "TensorBoard logging requested but the tensorboard package is not installed: "
            "pip install archipelago[tensorboard] (continuing without TensorBoard)"
        )
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    # flush_secs=10 bounds what a crash can lose without a write per step.
    return SummaryWriter(log_dir=str(log_dir), flush_secs=10)
