"""`training.backend = "dace-loops"`: as `dace` (dace.py), but every product is DaCe's own
generated loop nest (dace_program.matmul_loops) instead of its BLAS library node: no
library under it, so it runs where DaCe generates the code and no BLAS exists, many times
slower than a BLAS on a CPU (docs/backends.md has the table)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from archipelago.island.backends.dace import LOOPS, DaceConv2d, DaceLinear, convert, missing, refuse_unless_cpu_fp32


class DaceLoopsLinear(DaceLinear):
    """nn.Linear through the generated loops."""

    program = LOOPS


class DaceLoopsConv2d(DaceConv2d):
    """nn.Conv2d (im2col) through the generated loops."""

    program = LOOPS


def available() -> str | None:
    """None when DaCe can be imported, else how to install it."""
    return missing("dace-loops", ("dace",))


def describe() -> str:
    import dace

    return f"dace {dace.__version__}, generated loops"


def check(device: torch.device, dtype: torch.dtype) -> None:
    refuse_unless_cpu_fp32("dace-loops", device, dtype)


def apply(model: nn.Module, cache_dir: Path) -> int:
    """Every nn.Linear and ungrouped nn.Conv2d of `model` computes through the loops."""
    return convert(model, cache_dir, DaceLoopsLinear, DaceLoopsConv2d)
