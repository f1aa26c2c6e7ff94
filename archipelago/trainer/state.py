"""Where a run stands (`Progress`, checkpointed), what one step produced (`StepResult`), and
the error a non-finite loss raises."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the message names the step and the last good checkpoint."""


@dataclass
class Progress:
    """Where the run stands; checkpointed with everything else."""

    step: int = 0
    tokens: int = 0
    loss: float = float("nan")      # last logged training loss
    val_loss: float = float("nan")  # last validation loss (nan: not evaluated yet)
    val_accuracy: float = float("nan")  # last validation accuracy (image classification only)
    wall_s: float = 0.0             # wall-clock seconds of training, summed over sessions

    def state_dict(self) -> dict[str, float]:
        return {"step": self.step, "tokens": self.tokens, "loss": self.loss,
                "val_loss": self.val_loss, "val_accuracy": self.val_accuracy, "wall_s": self.wall_s}

    def record_validation(self, metrics: dict[str, float]) -> None:
        self.val_loss = metrics["val_loss"]
        self.val_accuracy = metrics.get("val_accuracy", float("nan"))

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.loss, self.val_loss = float(state["loss"]), float(state["val_loss"])
        self.val_accuracy = float(state.get("val_accuracy", float("nan")))
        self.wall_s = float(state["wall_s"])


@dataclass
class StepResult:
    """What one optimizer step produced; tensors stay on the device until a log step."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float  # the learning rate this step used
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # the task's step metrics (accuracy)
