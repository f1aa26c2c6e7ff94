"""The canonical flat layout: how an island's sharded parameters meet the other islands.

Islands shard the model differently (FSDP2 over 2 ranks, 1 rank, DDP, ...). Across
islands we therefore never exchange per-rank shards; we exchange chunks of one flat
vector that is the same on every island: the parameters of a fragment, in model order,
each flattened. That vector is cut into `width` (= `sync_width`) equal chunks, and
bridge rank s of every island holds chunk s.

A parameter held by some ranks only (a pipeline stage's) is a meta tensor on the others:
it keeps its place in the flat vector and is sent by a rank that holds it.

`FlatLayout.gather` moves the island's current parameter values into the bridge
ranks' chunks; `FlatLayout.scatter` writes chunk values back into every rank's own
shard. Both are one `all_to_all` inside the island; no rank ever materialises more
than its chunk, so a wide bridge never holds the whole model on one rank. Both also take
any tensors sharded like the parameters (the inner optimizer's moments) in their place.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Holding:
    """A contiguous run of the flat vector that one rank holds in one local tensor."""

    param: int        # index of the parameter in the fragment
    start: int        # first flat index
    stop: int         # one past the last flat index
    replicated: bool  # every rank of the island holds this run (DDP, one-rank islands)


@dataclass(frozen=True)
class Piece:
    """The part of a holding that falls into one chunk."""

    param: int
    start: int
    stop: int
    offset: int  # where `start` sits inside the holder's flattened local tensor


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a parameter (a view: writing it writes the parameter)."""
    return p._local_tensor if isinstance(p, DTensor) else p.data


def _holdings(params: Sequence[torch.Tensor]) -> list[tuple[Holding, int]]:
    """This rank's holdings and, for each, the flat index of its local tensor's element 0."""
    out, base = [], 0
    for i, p in enumerate(params):
        if p.is_meta:  # held by other ranks only (another pipeline stage): a place in the layout, no data
            base += p.numel()
            continue
        if isinstance(p, DTensor):
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(f"parameter {i}: only 1-D Shard(0) sharding (FSDP2) is supported "
                                 f"by the bridge, got {p.placements}")
            local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                                        p.placements)
            row = math.prod(p.shape[1:])
            start = base + offset[0] * row
            out.append((Holding(i, start, start + math.prod(local_shape), False), start))
        else:
            out.append((Holding(i, base, base + p.numel(), True), base))
        base += p.numel()
    return out


def _replica_holders(everyone: list[list[Holding]], n_params: int) -> list[list[int]]:
    """For each parameter, the ranks holding it whole (all of them under DDP, one stage's
    ranks in a pipeline, none under FSDP); ValueError if no rank holds some of it."""
    holders: list[list[int]] = [[] for _ in range(n_params)]
    sharded = set()
    for rank, holdings in enumerate(everyone):
        for h in holdings:
            if h.replicated:
                holders[h.param].append(rank)
            else:
                sharded.add(h.param)
    missing = [i for i in range(n_params) if not holders[i] and i not in sharded]
    if missing:
        raise ValueError(f"parameters {missing[:5]} are held by no rank of the island")
    return holders


def _owner(holders: list[int], dst: int) -> int | None:
    """Which rank sends a whole-held run to bridge rank `dst`: dst itself if it holds one
    (nothing crosses the wire), else the lowest holder (None: the run is sharded)."""
    if not holders:
        return None
    return dst if dst in holders else holders[0]


def _sends(holders: list[list[int]], src: int, dst: int, holding: Holding) -> bool:
    return _owner(holders[holding.param], dst) == src


def _always(holding: Holding) -> bool:
    return True


class FlatLayout:
    """Gather/scatter between an island's parameter shards and the bridge ranks' chunks."""

    def __init__(self, params: Sequence[torch.Tensor], width: int, rank: int, world_size: int,
                 group: dist.ProcessGroup | None = None) -> None:
        if not 1 <= width <= world_size:
            raise ValueError(f"sync_width {width} must be between 1 and the island's {world_size} rank(s)")
        self.params, self.width, self.rank, self.world_size = params, width, rank, world_size
        # where this rank's data lives (a pipeline stage holds some parameters only)
        self.device = next((local_tensor(p).device for p in params if not p.is_meta), torch.device("cpu"))
        self.group = group
        self.numel = sum(p.numel() for p in params)
        self.chunk_size = -(-self.numel // width)  # ceil: chunks are equal but the last
        mine = _holdings(params)
        self._bases = {h.param: base for h, base in mine}
        everyone = self._exchange([h for h, _ in mine])
        holders = _replica_holders(everyone, len(params))
        self.gather_plan = {(src, dst): self._pieces(everyone[src], dst, functools.partial(_sends, holders, src, dst))
                            for src in range(world_size) for dst in range(width)}
        self.scatter_plan = {(src, dst): self._pieces(everyone[dst], src, _always)
                             for src in range(width) for dst in range(world_size)}

    # ---- geometry ------------------------------------------------------------------

    @property
    def is_bridge(self) -> bool:
        return self.rank < self.width

    def chunk_range(self, s: int) -> tuple[int, int]:
        start = min(s * self.chunk_size, self.numel)
        return start, min(start + self.chunk_size, self.numel)

    def _exchange(self, mine: list[Holding]) -> list[list[Holding]]:
        if self.world_size == 1:
            return [mine]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone

    def _pieces(self, holdings: list[Holding], chunk: int, take_replicated: Callable[[Holding], bool]) -> list[Piece]:
        """Parts of `holdings` inside `chunk`. A run several ranks hold whole is sent by one of
        them only: those for which `take_replicated(holding)` is true."""
        lo, hi = self.chunk_range(chunk)
        out = []
        for h in holdings:
            if h.replicated and not take_replicated(h):
                continue
            a, b = max(h.start, lo), min(h.stop, hi)
            if a < b:
                out.append(Piece(h.param, a, b, a - h.start))
        return out

    def _flat_local(self, i: int, tensors: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        return local_tensor((self.params if tensors is None else tensors)[i]).view(-1)

    # ---- data movement -------------------------------------------------------------

    @torch.no_grad()
    def gather(self, dtype: torch.dtype = torch.float32,
               tensors: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The current parameter values of this rank's chunk (bridge ranks), else None.
        `tensors`: gather these instead, one per parameter, sharded as the parameters are.

        A collective over the island: every rank must call it.
        """
        device = self.device
        sends = [self._pack(self.gather_plan[(self.rank, d)], dtype, device, tensors) if d < self.width else
                 torch.empty(0, dtype=dtype, device=device) for d in range(self.world_size)]
        recv_plans = [self.gather_plan[(src, self.rank)] if self.is_bridge else []
                      for src in range(self.world_size)]
        received = self._all_to_all(sends, recv_plans, dtype, device)
        if not self.is_bridge:
            return None
        lo, hi = self.chunk_range(self.rank)
        chunk = torch.empty(hi - lo, dtype=dtype, device=device)
        for plan, data in zip(recv_plans, received):
            self._unpack_into_chunk(plan, data, chunk, lo)
        return chunk

    @torch.no_grad()
    def scatter(self, chunk: torch.Tensor | None, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Write the bridge ranks' chunks into every rank's own shard (a collective);
        into `tensors` instead of the parameters when given."""
        device = self.device
        dtype = chunk.dtype if chunk is not None else torch.float32
        lo = self.chunk_range(self.rank)[0] if self.is_bridge else 0
        if chunk is not None:
            chunk = chunk.to(device)
        sends = [self._slice_chunk(self.scatter_plan[(self.rank, d)], chunk, lo, dtype, device)
                 if chunk is not None and self.is_bridge else torch.empty(0, dtype=dtype, device=device)
                 for d in range(self.world_size)]
        recv_plans = [self.scatter_plan[(src, self.rank)] if src < self.width else []
                      for src in range(self.world_size)]
        received = self._all_to_all(sends, recv_plans, dtype, device)
        for plan, data in zip(recv_plans, received):
            cursor = 0
            for piece in plan:
                n = piece.stop - piece.start
                target = self._flat_local(piece.param, tensors)[piece.offset:piece.offset + n]
                target.copy_(data[cursor:cursor + n])
                cursor += n

    def _pack(self, plan: list[Piece], dtype: torch.dtype, device: torch.device,
              tensors: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        parts = [self._flat_local(p.param, tensors)[p.offset:p.offset + p.stop - p.start] for p in plan]
        return torch.cat(parts).to(dtype) if parts else torch.empty(0, dtype=dtype, device=device)

    @staticmethod
    def _slice_chunk(plan: list[Piece], chunk: torch.Tensor, lo: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        parts = [chunk[p.start - lo:p.stop - lo] for p in plan]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    @staticmethod
    def _unpack_into_chunk(plan: list[Piece], data: torch.Tensor, chunk: torch.Tensor, lo: int) -> None:
        cursor = 0
        for p in plan:
            n = p.stop - p.start
            chunk[p.start - lo:p.stop - lo] = data[cursor:cursor + n]
            cursor += n

    def _all_to_all(self, sends: list[torch.Tensor], recv_plans: list[list[Piece]],
                    dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Send sends[d] to rank d; returns what each rank sent here, sized by `recv_plans`."""
        sizes = [sum(p.stop - p.start for p in plan) for plan in recv_plans]
        if self.world_size == 1:
            return sends
        out = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.all_to_all_single(out, torch.cat(sends), output_split_sizes=sizes,
                               input_split_sizes=[s.numel() for s in sends], group=self.group)
        return list(out.split(sizes))
