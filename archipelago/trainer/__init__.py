"""One island's training: the loop (`Trainer`, loop.py, every part built by a small
`build_*` hook) and the collaborators it calls: this rank's data (island_data.py), the
run's checkpoints (run_checkpoints.py), held-out evaluation (evaluation.py), what it
reports (run_metrics.py), its plan (planner.py), emulations and faults (drills.py), the
hooks the federation talks back through (hooks.py), where the run stands (state.py) and
its run folder (run_files.py)."""

from archipelago.trainer.loop import Trainer, run_training
from archipelago.trainer.run_metrics import RunMetrics
from archipelago.trainer.state import NonFiniteLossError, Progress, StepResult

__all__ = ["NonFiniteLossError", "Progress", "RunMetrics", "StepResult", "Trainer", "run_training"]
