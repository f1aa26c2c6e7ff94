"""Compute backends: how an island computes its model's heavy operators.

A backend is applied to the model from outside, after the model is built and before the
island's parallelism wraps it (as torch.compile and FSDP are): it may change how modules
compute, never their parameters or names, so checkpoints, the federation's flat layout and
the other islands see the same model whatever each island computes it with. Islands of one
federation may use different backends; each declares its own at the join (the
fingerprint's `compute` field, logged, not compared).

One module per backend, each with four functions (docs/backends.md says how to add one):

- `available() -> str | None`: None, or why it cannot run here and how to install it;
- `check(device, dtype)`: raise ValueError naming the fix when it cannot compute there;
- `apply(model, cache_dir) -> int`: convert the model in place, return the modules converted;
- `describe() -> str`: one line for the fingerprint and logs (its version, device, dtype).

Every backend passes the same suite (tests/test_backends.py): forward and gradients equal
to eager within float32 tolerance on llama3 `debug` and a ResNet block, 20 training steps
tracking eager's losses, parameters and state_dict names unchanged.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

BACKENDS = {"eager": "archipelago.island.backends.eager", "dace": "archipelago.island.backends.dace",
            "dace-loops": "archipelago.island.backends.dace_loops"}


def backend(name: str) -> ModuleType:
    """The backend module called `name` (training.backend), imported on demand."""
    if name not in BACKENDS:
        raise ValueError(f"training.backend = {name!r}: expected one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


def apply_backend(model: nn.Module, name: str, device: torch.device, dtype: torch.dtype,
                  cache_dir: Path) -> int:
    """Make `model` compute through backend `name` on this island (in place): checks that
    it is installed and can compute on `device` in `dtype`, then converts the model.
    Returns the number of modules converted (0 for eager). Raises ValueError naming the fix."""
    chosen = backend(name)
    missing = chosen.available()
    if missing:
        raise ValueError(missing)
    chosen.check(device, dtype)
    return chosen.apply(model, cache_dir)


def describe_backend(name: str) -> str:
    """One line naming the backend (and its version) an island computes with."""
    return backend(name).describe()
