"""`Stateful` adapters that put training state into a DCP checkpoint.

Use them as TOP-LEVEL values of the dict passed to CheckpointManager.save /
load_latest: DCP calls state_dict() before saving and loading and
load_state_dict() after loading, but only on top-level values.

Non-tensor values are stored as plain ints/floats/strs/bytes on purpose, but DCP
still reads them back with torch.load(weights_only=False) (and unpickles its
.metadata file): a checkpoint directory must be trusted. With a federation key the
manifest is signed and checked before DCP reads anything (checkpoint/manager.py).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger("archipelago.checkpoint")


class ModelOptimizerState(Stateful):
    """Model (+ optional optimizer) state for plain, DDP and FSDP2 models.

    torch's get_state_dict/set_state_dict produce keys that do not depend on
    the wrapping (no "module." / FSDP prefixes) and sharded DTensors for FSDP2,
    so a checkpoint can be resharded across a different world size. They also
    materialize an empty optimizer state (before the first step) so loading
    into a fresh optimizer works.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"])
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )


class RNGState(Stateful):
    """Python `random`, numpy global, torch CPU and current-CUDA-device RNG state.

    Assumption: every rank of our trainer seeds identically and consumes
    random numbers identically, so all ranks hold the same RNG state; DCP
    de-duplicates the identical non-tensor entries and every rank restores
    the same saved copy. Per-rank randomness (e.g. dropout that must differ
    per rank) would need per-rank keys instead.

    The CUDA state is for the current device only (one device per rank). It
    is stored as raw bytes, empty when saved without CUDA, so CPU and GPU
    checkpoints stay loadable on the other kind of machine; the CUDA state is
    then left unchanged, with a warning.
    """

    def state_dict(self) -> dict[str, Any]:
        version, mt, gauss = random.getstate()
        np_name, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        return {
            "python_version": int(version),
            "python_mt": np.asarray(mt, dtype=np.uint32).tobytes(),
            "python_has_gauss": int(gauss is not None),
            "python_gauss": float(gauss if gauss is not None else 0.0),
            "numpy_name": str(np_name),
            "numpy_key": np.asarray(np_key, dtype=np.uint32).tobytes(),
            "numpy_pos": int(np_pos),
            "numpy_has_gauss": int(np_has_gauss),
            "numpy_gauss": float(np_gauss),
            "torch_cpu": _tensor_bytes(torch.get_rng_state()),
            "cuda": _tensor_bytes(torch.cuda.get_rng_state()) if _cuda_ready() else b"",
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = state_dict
        mt = tuple(int(x) for x in np.frombuffer(sd["python_mt"], dtype=np.uint32))
        gauss = sd["python_gauss"] if sd["python_has_gauss"] else None
        random.setstate((sd["python_version"], mt, gauss))
        np.random.set_state((
            sd["numpy_name"],
            np.frombuffer(sd["numpy_key"], dtype=np.uint32).copy(),
            sd["numpy_pos"],
            sd["numpy_has_gauss"],
            sd["numpy_gauss"],
        ))
        torch.set_rng_state(_bytes_tensor(sd["torch_cpu"]))
        self._load_cuda(sd["cuda"])

    @staticmethod
    def _load_cuda(blob: bytes) -> None:
        if blob and _cuda_ready():
            torch.cuda.set_rng_state(_bytes_tensor(blob))
        elif blob or _cuda_ready():
            log.warning(
                "CUDA RNG state not restored (checkpoint saved %s CUDA, running %s CUDA): "
                "GPU-side random numbers will differ from the original run",
                "with" if blob else "without", "with" if _cuda_ready() else "without",
            )


class ObjectState(Stateful):
    """Adapter from a pair of get/set callables to `Stateful`.

    `get` must return a (possibly nested) dict of ints/floats/strs/tensors
    whose keys are the same at save and at load time: DCP uses the dict
    returned at load time as the template of what to read.
    """

    def __init__(self, get: Callable[[], dict[str, Any]], set: Callable[[dict[str, Any]], Any]) -> None:  # noqa: A002
        self._get = get
        self._set = set

    def state_dict(self) -> dict[str, Any]:
        return self._get()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._set(state_dict)


class LoaderState(ObjectState):
    """Any object with state_dict()/load_state_dict() (data loader position,
    LR scheduler, ...) whose state is a dict of ints/strs."""

    def __init__(self, obj: Any) -> None:
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(
                f"{type(obj).__name__} has no state_dict()/load_state_dict(); "
                "wrap it with ObjectState(get, set) instead"
            )
        super().__init__(obj.state_dict, obj.load_state_dict)
        self.obj = obj


def _cuda_ready() -> bool:
    # Reading the CUDA RNG initializes CUDA lazily; fine for a GPU trainer.
    return torch.cuda.is_available()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def _bytes_tensor(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
