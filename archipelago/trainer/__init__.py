"""One island's training: the loop (`Trainer`, loop.py, every part built by a small
`build_*` hook), what it reports (run_metrics.py), the hooks the federation talks back
through (hooks.py), where the run stands (state.py) and its run folder (run_files.py)."""

from archipelago.trainer.loop import Trainer, run_training
from archipelago.trainer.run_metrics import RunMetrics
from archipelago.trainer.state import NonFiniteLossError, Progress, StepResult

__all__ = ["NonFiniteLossError", "Progress", "RunMetrics", "StepResult", "Trainer", "run_training"]
