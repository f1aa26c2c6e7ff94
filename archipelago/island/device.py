"""Device and process-group setup for the ranks of one island.

An island is one torchrun job. torchrun exports RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; a plain `python` process is an island of one rank and needs no
process group at all.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from archipelago.config import ConfigError

T = TypeVar("T")

log = logging.getLogger("archipelago.island")

# Backend per device type: the vendor collective library on accelerators, gloo elsewhere.
_BACKENDS = {"cuda": "nccl", "xpu": "xccl", "mps": "gloo", "cpu": "gloo"}


@dataclass(frozen=True)
class IslandContext:
    """Where this process sits in its island."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_leader(self) -> bool:
        """Rank 0 writes the island's files and talks to the user."""
        return self.rank == 0


def detect_device_type(requested: str = "auto") -> str:
    """The device type to train on: the requested one, or the best one present."""
    if requested != "auto":
        available = {"cpu": True, "cuda": torch.cuda.is_available(),
                     "xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
                     "mps": torch.backends.mps.is_available()}
        if not available[requested]:
            raise ConfigError(f"training.device = {requested!r} but no {requested} device is visible; "
                               "use --training.device auto (or cpu)")
        return requested
    if torch.cuda.is_available():  # ROCm builds report through torch.cuda too
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _local_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device: one accelerator per local rank; CPU and MPS are shared."""
    if kind in ("cpu", "mps"):  # mps has a single device and no set_device
        return torch.device(kind)
    count = getattr(torch, kind).device_count()
    if local_rank >= count:
        raise ConfigError(f"local rank {local_rank} has no {kind} device: this node shows {count}; "
                          f"start at most {count} ranks per node (--nproc / NGPU)")
    device = torch.device(kind, local_rank)
    getattr(torch, kind).set_device(device)
    return device


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def init_island(device_type: str = "auto", timeout_s: float = 600.0) -> IslandContext:
    """Pick the device, and join the island's process group when launched by torchrun."""
    kind = detect_device_type(device_type)
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = _local_device(kind, local_rank)
    backend = _BACKENDS[kind]
    if world > 1 and not dist.is_initialized():
        # device_id binds NCCL's communicator eagerly to this GPU; gloo takes no device.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if kind != "cpu" else None)
        log.debug("rank %d/%d joined the island process group (%s)", rank, world, backend)
    return IslandContext(rank=rank, local_rank=local_rank, world_size=world, device=device,
                         backend=backend)


def close_island() -> None:
    """Leave the process group (a no-op for a one-rank island)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(value: T, ctx: IslandContext) -> T:
    """Rank 0's `value`, on every rank (a collective: every rank must call it)."""
    if not ctx.is_distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value: T, ctx: IslandContext) -> list[T]:
    """Every rank's `value`, in rank order (a collective; pickles: inside one island only,
    whose ranks share an owner, never between islands)."""
    if not ctx.is_distributed:
        return [value]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def barrier(ctx: IslandContext) -> None:
    """Wait for every rank of the island (a no-op for one rank)."""
    if ctx.is_distributed:
        dist.barrier()


def all_reduce_(tensor: torch.Tensor, ctx: IslandContext, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the island (sum, max, min or avg); returns `tensor`."""
    if ctx.is_distributed:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=ops["sum" if op == "avg" else op])
        if op == "avg":
            tensor /= ctx.world_size
    return tensor
