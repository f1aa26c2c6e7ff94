"""`training.backend = "eager"` (the default): PyTorch's own kernels on any device; nothing to convert."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def available() -> str | None:
    return None


def describe() -> str:
    return f"eager (torch {torch.__version__})"


def check(device: torch.device, dtype: torch.dtype) -> None:
    return None


def apply(model: nn.Module, cache_dir: Path) -> int:
    return 0
