"""What an island's ranks share while they save or load a checkpoint together.

Every helper is a collective when a process group is up and the identity without one, so
that a single-process island uses the same code. Only rank 0 reads manifests and keys; a
failure there is shared with every rank (`on_rank0`) instead of leaving them blocked in
the next collective.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

T = TypeVar("T")


def dist_active() -> bool:
    """Whether a torch.distributed process group is up."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Every rank waits for the others (nothing without a process group)."""
    if dist_active():
        dist.barrier()


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (identity without a process group).

    Within one island only: its ranks run one owner's code, so the object collective is not
    a byte from another island."""
    if not dist_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a collective; [obj] without a process group)."""
    if not dist_active():
        return [obj]
    objs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def on_rank0(rank: int, fn: Callable[[], T], what: str) -> T | None:
    """Run `fn` on rank 0 only and share its result (or failure) with all ranks.

    Without this, an exception on rank 0 (disk full, permissions) would leave the other
    ranks blocked forever in the next collective.
    """
    result: T | None = None
    failure: Exception | None = None
    if rank == 0:
        try:
            result = fn()
        except Exception as exc:
            failure = exc
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    result, error = broadcast_from_rank0((result, error))
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"rank 0 failed while {what}: {error}")
    return result


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming ... single process" UserWarning when that is intended."""
    with warnings.catch_warnings():
        if not dist_active():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def short_error(exc: BaseException) -> str:
    """One line for a warning: DCP's CheckpointException embeds whole tracebacks."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def failure_in(exc: BaseException, kind: type[Exception]) -> Exception | None:
    """The first `kind` error in `exc` or, for DCP's CheckpointException, in any rank's failure."""
    if isinstance(exc, kind):
        return exc
    failures = getattr(exc, "failures", None) if isinstance(exc, CheckpointException) else None
    for inner, _trace in (failures or {}).values():
        if isinstance(inner, kind):
            return inner
    return None
