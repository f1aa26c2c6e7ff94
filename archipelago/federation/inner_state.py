"""Averaging the islands' inner optimizer state at each outer step (`average_optimizer_state`).

Each island's AdamW divides its update by the square root of its own second-moment
estimate, and an island's gradient (its own batch) is noisier than the federation's
combined one, so islands under-step where noise and signal are of the same size
(docs/quality.md, "the gap that remains"). With this setting the islands also average
their optimizer's moments at every outer step, weighted like their pseudo-gradients,
and every island continues from the average.

The moments cross islands like the pseudo-gradient (exchange.py): each island's bridge
chunk of them, in fp32 (or bf16 with `moments_dtype`, half the bytes), is one row (with
a federation key a signed frame of kind MOMENTS), all-gathered beside the
pseudo-gradient's exchange and voted on with it: a round that does not commit leaves
every island its own moments. Every receiver judges every row (`judge_moments`): an
island whose pseudo-gradient was refused, whose row is not signed, holds no moments, or
holds moments no optimizer can have (not finite, a negative second moment, or for Adam a
first moment larger than Cauchy-Schwarz allows against the second, `adam_moment_bound`,
with slack for the wire type's rounding) has its moments left out, on every island
alike. It costs one model-sized row per moment (two for AdamW) per island and round.
The moments are gathered and written back through the fragment's flat layout, so
islands sharded differently meet as they do for the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from archipelago.config.errors import ConfigError
from archipelago.federation.exchange import Framing, Gathered, allgather, wire_device
from archipelago.federation.layout import FlatLayout, local_tensor
from archipelago.federation.outer_core import aggregate
from archipelago.federation.policy import FRAME_OK

log = logging.getLogger("archipelago.federation")

# The state an optimizer keeps per parameter, shaped like the parameter, that is averaged.
STATE_KEYS: dict[str, tuple[str, ...]] = {
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "BatchScaledAdamW": ("exp_avg", "exp_avg_sq"),  # island/optim.py: AdamW's state
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


MOMENTS = 9  # frame kind of a row of moments (every kind is listed in tests/test_trust.py, each used once)
_SLACK = 1e-3      # relative slack of the Cauchy-Schwarz bound: the moments' own rounding
# In bf16 each value is rounded by at most 2^-9 of itself: exp_avg^2 by about 2^-8, exp_avg_sq
# by 2^-9, so the bound may be off by about 0.6% more. 1% keeps a margin.
_SLACK_BF16 = 1e-2
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TINY = 1e-30      # absolute slack: a second moment that underflowed to 0 under a tiny first one


def adam_moment_bound(betas: tuple[float, float]) -> float | None:
    """C with exp_avg^2 <= C * exp_avg_sq for every coordinate of any Adam state with these
    betas, whatever the gradients (None if there is none: beta1^2 >= beta2).

    exp_avg = sum_k (1-b1) b1^k g_k and exp_avg_sq = sum_k (1-b2) b2^k g_k^2, so by
    Cauchy-Schwarz exp_avg^2 <= sum_k (1-b1)^2 b1^2k / ((1-b2) b2^k) * exp_avg_sq. A weighted
    average of such states keeps the bound, so averaged moments satisfy it too.
    """
    b1, b2 = betas
    if not (0 <= b1 < 1 and 0 < b2 < 1) or b1 * b1 >= b2:
        return None
    return (1 - b1) ** 2 / ((1 - b2) * (1 - b1 * b1 / b2))


def moments_problem(values: torch.Tensor, keys: tuple[str, ...], bound: float | None,
                    slack: float = _SLACK) -> str | None:
    """Why a row of moments ([key 0 chunk, key 1 chunk, ...]) cannot be an optimizer's, or None.
    `slack`: the relative error the bound allows for rounding (more for rows sent in bf16)."""
    if not bool(torch.isfinite(values).all()):  # a device sync
        return "non-finite moments"
    if "exp_avg_sq" not in keys:
        return None
    parts = dict(zip(keys, values.split(values.numel() // len(keys))))
    second = parts["exp_avg_sq"]
    if bool((second < 0).any()):
        return "a negative second moment"
    if bound is not None and "exp_avg" in parts:
        first = parts["exp_avg"].double()
        if bool((first.square() > bound * (1 + slack) * second.double() + _TINY).any()):
            return "first moments larger than the second moments allow"
    return None


@dataclass
class StateExchange:
    """One fragment's moments in flight: this island's row and, after `judge_moments`,
    the rows' values (bridge ranks only)."""

    fragment: int
    has_moments: bool                # the island has moments to overwrite (false before its first step)
    gathered: Gathered | None = None  # bridge ranks only
    payload_bytes: int = 0
    values: list[torch.Tensor | None] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # what each row counts for (judge_moments)
    sent: int = 0
    received: int = 0
    carried: bool = True  # false: codec = "auto" held the moments back this round (nothing in flight)


def _finite(tensors: list[torch.Tensor]) -> bool:
    """Every value finite; one device sync for all of them."""
    held = [t for t in tensors if not t.is_meta]  # a pipeline stage checks its own
    if not held:
        return True
    return bool(torch.stack([torch.isfinite(local_tensor(t)).all() for t in held]).all())


class InnerStateAverager:
    """Gathers, exchanges (as rows) and writes back one fragment's optimizer moments."""

    def __init__(self, optimizer: torch.optim.Optimizer, fragments: list[list[nn.Parameter]],
                 layouts: list[FlatLayout], moments_dtype: str = "fp32") -> None:
        self.optimizer, self.fragments, self.layouts = optimizer, fragments, layouts
        self.wire_dtype = WIRE_DTYPES[moments_dtype]  # what the rows carry (fault_tolerance.moments_dtype)
        self.slack = _SLACK_BF16 if self.wire_dtype == torch.bfloat16 else _SLACK
        self.keys = state_keys(optimizer)
        betas = optimizer.param_groups[0].get("betas")
        self.bound = adam_moment_bound(tuple(betas)) if betas is not None else None

    @property
    def row_bytes_per_value(self) -> int:
        """Bytes of this island's row of moments per value of its chunk (8 for AdamW in fp32)."""
        return len(self.keys) * self.wire_dtype.itemsize

    def _moments(self, fragment: int, key: str) -> list[torch.Tensor] | None:
        tensors: list[torch.Tensor] = []
        for p in self.fragments[fragment]:
            if p.is_meta:  # another pipeline stage holds it, and its moments
                tensors.append(p)
                continue
            t = self.optimizer.state.get(p, {}).get(key)
            if not isinstance(t, torch.Tensor):  # before the first step; SGD without momentum
                return None
            tensors.append(t)
        return tensors

    def start(self, fragment: int, sends: bool, manager: Any,
              island_max: Callable[[list[float]], list[float]], framing: Framing,
              device: torch.device | None = None, carry: bool = True) -> StateExchange:
        """Gather the fragment's moments onto the bridge ranks and start their exchange (a
        collective over the island, then an all-gather over the federation). An island
        that does not `send` (weight 0), or whose moments are not finite, sends a row of
        zeros that claims weight 0, and takes the others' average. `carry`: false on a
        bridge rank whose codec = "auto" holds the moments back this round; then no rank of
        the island gathers or sends them (`carried` false), nor does any other island, since
        their bridge ranks chose from the same agreed link."""
        moments = [self._moments(fragment, key) for key in self.keys]
        have = all(m is not None for m in moments)
        finite = have and _finite([t for m in moments if m is not None for t in m])
        lacking, bad, held_back = island_max([float(not have), float(not finite), float(not carry)])
        have, layout = not lacking, self.layouts[fragment]
        if held_back:
            return StateExchange(fragment, have, carried=False)
        sends = sends and not bad
        # Whether the island sends is the same on all its ranks.
        chunks = [layout.gather(tensors=m) for m in moments] if sends else []
        if not layout.is_bridge:
            return StateExchange(fragment, have)
        gathered = [c for c in chunks if c is not None]  # every chunk, on a bridge rank
        if gathered:
            payload = torch.cat(gathered).to(self.wire_dtype)
        else:
            lo, hi = layout.chunk_range(layout.rank)
            payload = torch.zeros(len(self.keys) * (hi - lo), device=layout.device, dtype=self.wire_dtype)
        if device is not None:
            payload = payload.to(device)
        raw = payload.contiguous().view(torch.uint8)
        size = framing.row_bytes(raw.numel())
        row = framing.frame(0.0, float(sends), raw, size, MOMENTS).to(wire_device(manager, payload.device))
        participants = max(manager.num_participants(), 1)
        work, outputs = allgather(manager, row, participants)
        return StateExchange(fragment, have, Gathered(work, framing, outputs), raw.numel(),
                             sent=size, received=size * (participants - 1))

    def judge_moments(self, exchange: StateExchange, weights: list[float],
                      island_max: Callable[[list[float]], list[float]]) -> list[float]:
        """The weights the rows of moments are averaged with: the pseudo-gradient's verdict
        (`weights`: 0 for a refused island), and 0 for a row that is not signed, claims no
        moments or fails `moments_problem` on any of the island's bridge chunks. The same
        on every island (they judge the same bytes); a collective over the island."""
        bad = [0.0] * len(weights)
        gathered = exchange.gathered
        if gathered is not None:
            gathered.work.wait()  # a lost exchange leaves zeros: no row opens, none counts
            for k, out in enumerate(gathered.outputs):
                _, claims, island, payload, frame = gathered.framing.open(out, exchange.payload_bytes, MOMENTS)
                values = None
                if frame == FRAME_OK and payload is not None and claims == 1.0 and k < len(weights) and weights[k]:
                    values = payload.clone().view(self.wire_dtype).float()
                    problem = moments_problem(values, self.keys, self.bound, self.slack)
                    if problem is not None:
                        log.warning("refused the optimizer moments of island %s: %s", island, problem)
                        values = None
                exchange.values.append(values)
                bad[k] = float(values is None)
        combined = island_max(bad)
        exchange.weights = [w if not b else 0.0 for w, b in zip(weights, combined)]
        return exchange.weights

    def finish(self, exchange: StateExchange, apply: bool) -> None:
        """Write the weighted average of the accepted rows into every rank's optimizer state
        when `apply` (the round committed and some island's moments count); a collective
        over the island."""
        if not apply or not exchange.has_moments or not sum(exchange.weights):
            return
        averages: list[torch.Tensor | None] = [None] * len(self.keys)
        if exchange.gathered is not None:  # bridge ranks: the weighted mean of the accepted rows
            rows = [(w, v) for w, v in zip(exchange.weights, exchange.values) if w and v is not None]
            mean = aggregate([v for _, v in rows], [w for w, _ in rows]) / sum(exchange.weights)
            averages = list(mean.split(mean.numel() // len(self.keys)))
        for key, average in zip(self.keys, averages):
            tensors = self._moments(exchange.fragment, key)
            assert tensors is not None, "finish() for a fragment whose moments were not sent"
            self.layouts[exchange.fragment].scatter(average, tensors=tensors)

