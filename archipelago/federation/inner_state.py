"""Averaging the islands' inner optimizer state at each outer step (`average_optimizer_state`).

Each island's AdamW divides its update by the square root of its own second-moment
estimate, and an island's gradient (its own batch) is noisier than the federation's
combined one, so islands under-step where noise and signal are of the same size
(docs/quality.md, "the gap that remains"). With this setting the islands also average
their optimizer's moments at every outer step, weighted like their pseudo-gradients,
and every island continues from the average.

It costs one more model-sized fp32 all-reduce per moment (two for AdamW) in each round,
sent beside the pseudo-gradient's exchange and voted on with it: a round that does not
commit leaves every island its own moments. The moments are gathered and written back
through the fragment's flat layout, so islands sharded differently meet as they do for
the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from archipelago.config.errors import ConfigError
from archipelago.federation.layout import FlatLayout, local_tensor

# The state an optimizer keeps per parameter, shaped like the parameter, that is averaged.
STATE_KEYS: dict[str, tuple[str, ...]] = {
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "Adam": ("exp_avg", "exp_avg_sq"),
    "SGD": ("momentum_buffer",),
}


def state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state of `optimizer` that islands average."""
    name = type(optimizer).__name__
    if name not in STATE_KEYS:
        raise ConfigError(f"fault_tolerance.average_optimizer_state does not know the state of {name}; "
                          f"use one of {', '.join(STATE_KEYS)} or set it to false")
    return STATE_KEYS[name]


@dataclass
class StateExchange:
    """One fragment's moments in flight: [moment 0 chunk, moment 1 chunk, ..., weight]."""

    fragment: int
    ready: bool                  # the island has moments to overwrite (false before its first step)
    buffer: torch.Tensor | None  # bridge ranks only
    work: Any = None


def _finite(tensors: list[torch.Tensor]) -> bool:
    """Every value finite; one device sync for all of them."""
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(local_tensor(t)).all() for t in tensors]).all())


class InnerStateAverager:
    """Gathers, all-reduces and writes back one fragment's optimizer moments."""

    def __init__(self, optimizer: torch.optim.Optimizer, fragments: list[list[nn.Parameter]],
                 layouts: list[FlatLayout]) -> None:
        self.optimizer, self.fragments, self.layouts = optimizer, fragments, layouts
        self.keys = state_keys(optimizer)

    def _moments(self, fragment: int, key: str) -> list[torch.Tensor] | None:
        tensors = []
        for p in self.fragments[fragment]:
            t = self.optimizer.state.get(p, {}).get(key)
            if not isinstance(t, torch.Tensor):  # before the first step; SGD without momentum
                return None
            tensors.append(t)
        return tensors

    def start(self, fragment: int, weight: float, manager: Any,
              island_max: Callable[[list[float]], list[float]],
              device: torch.device | None = None) -> StateExchange:
        """Gather the fragment's moments onto the bridge ranks and start their weighted sum
        across islands (a collective over the island, then over the federation). An island
        whose moments are not finite sends nothing and takes the others' average."""
        moments = [self._moments(fragment, key) for key in self.keys]
        have = all(m is not None for m in moments)
        finite = have and _finite([t for m in moments if m is not None for t in m])
        lacking, bad = island_max([float(not have), float(not finite)])  # over the island's ranks
        have, ready = not lacking, not bad
        chunks = [self.layouts[fragment].gather(tensors=m if ready else None) for m in moments]
        if chunks[0] is None:  # not a bridge rank
            return StateExchange(fragment, have, None)
        buffer = torch.cat([*(c for c in chunks if c is not None), chunks[0].new_zeros(1)])
        if device is not None:
            buffer = buffer.to(device)
        if ready and weight > 0:
            buffer[:-1].mul_(weight)
            buffer[-1] = weight
        else:  # no moments yet, or non-finite ones (never multiply them by 0: NaN x 0 is NaN)
            buffer.zero_()
        work = manager.allreduce(buffer, reduce_op=ReduceOp.SUM)
        return StateExchange(fragment, have, buffer, work)

    def wait(self, exchange: StateExchange) -> None:
        """Wait for the sum (before the commit vote, so a failed exchange votes no)."""
        if exchange.work is not None:
            exchange.work.wait()

    def finish(self, exchange: StateExchange, apply: bool) -> None:
        """Write the average into every rank's optimizer state when `apply` (the round
        committed and some island sent moments); a collective over the island."""
        if not apply or not exchange.ready:
            return
        moments = [self._moments(exchange.fragment, key) for key in self.keys]
        chunk = exchange.buffer
        size = None if chunk is None else (chunk.numel() - 1) // len(self.keys)
        for i, tensors in enumerate(moments):
            assert tensors is not None, "finish() for a fragment whose moments were not sent"
            part = None
            if chunk is not None and size is not None:
                part = chunk[i * size:(i + 1) * size] / chunk[-1]
            self.layouts[exchange.fragment].scatter(part, tensors=tensors)

    @staticmethod
    def total_weight(exchange: StateExchange) -> float:
        return 0.0 if exchange.buffer is None else float(exchange.buffer[-1])
