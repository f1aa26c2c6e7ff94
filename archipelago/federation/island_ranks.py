"""The ranks of one island, as the outer loop sees them: the small collectives that make
every rank of an island take the same decision (a round's end, the vote, a row's
verdict), over the island's own process group. They carry a handful of floats, never a
peer island's bytes, so the object gather below stays inside the island (one owner).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp


class IslandRanks:
    """Collectives over the ranks of one island (no-ops for a 1-rank island)."""

    def __init__(self, world_size: int, group: dist.ProcessGroup | None) -> None:
        self.world_size, self.group = world_size, group

    def max(self, values: list[float]) -> list[float]:
        """Each value's maximum over the island's ranks (a tiny all-reduce)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, op=ReduceOp.MAX, group=self.group)
        return t.tolist()

    def sums(self, values: list[float]) -> list[float]:
        """Each value's sum over the island's ranks."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (the island's own ranks only: one owner, so pickling is safe)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
