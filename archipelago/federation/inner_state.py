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
    has_moments: bool            # the island has moments to overwrite (false before its first step)
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
        have, layout = not lacking, self.layouts[fragment]
        # Whether the island sends is the same on all its ranks (the weight is the island's).
        chunks = [layout.gather(tensors=m) for m in moments] if not bad and weight > 0 else []
        if not layout.is_bridge:
            return StateExchange(fragment, have, None)
        gathered = [c for c in chunks if c is not None]  # every chunk, on a bridge rank
        if gathered:
            buffer = torch.cat([*gathered, gathered[0].new_zeros(1)])
            buffer[:-1].mul_(weight)
            buffer[-1] = weight
        else:  # zeros: no moments yet, non-finite ones (never x 0: NaN x 0 is NaN), or weight 0
            lo, hi = layout.chunk_range(layout.rank)
            buffer = torch.zeros(len(self.keys) * (hi - lo) + 1, device=local_tensor(layout.params[0]).device)
        if device is not None:
            buffer = buffer.to(device)
        work = manager.allreduce(buffer, reduce_op=ReduceOp.SUM)
        return StateExchange(fragment, have, buffer, work)

    def wait(self, exchange: StateExchange) -> None:
        """Wait for the sum (before the commit vote, so a failed exchange votes no)."""
        if exchange.work is not None:
            exchange.work.wait()

    def finish(self, exchange: StateExchange, apply: bool) -> None:
        """Write the average into every rank's optimizer state when `apply` (the round
        committed and some island sent moments); a collective over the island."""
        if not apply or not exchange.has_moments:
            return
        chunk = exchange.buffer  # bridge ranks: the weighted sums, then the total weight
        averages = ([None] * len(self.keys) if chunk is None else
                    list((chunk[:-1] / chunk[-1]).split((chunk.numel() - 1) // len(self.keys))))
        for key, average in zip(self.keys, averages):
            tensors = self._moments(exchange.fragment, key)
            assert tensors is not None, "finish() for a fragment whose moments were not sent"
            self.layouts[exchange.fragment].scatter(average, tensors=tensors)

    @staticmethod
    def total_weight(exchange: StateExchange) -> float:
        return 0.0 if exchange.buffer is None else float(exchange.buffer[-1])
