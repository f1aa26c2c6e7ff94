"""Moving the segment repair's parts: what a reduce-scatter's survivors send each other
instead of running the whole exchange again (policy.segment_repair decides what).

After a member died in the first phase (the all-to-all of segments), each survivor holds
some of the other members' segments whole (their frames' signatures say which) and the
survivors agree on that. The plan then names every part that must travel: a live summer's
missing segments, and one part of each dead summer's segment per survivor. Here those
parts cross in one all-to-all with per-pair sizes over the survivors' new group, each a
signed frame like every other row (kind ROUND_PART), so every byte is still checked by its
receiver: the tag first, then the part's address (summer, part, value range) that the
signed payload starts with, so a frame meant for one summer or range cannot be replayed
to another. A receiver ends with, for each part it sums, every survivor's payload of
that part (its own encoded locally), or None where a frame was refused.

Dense codecs only (bf16, int8: segments that encode on their own); a top-k row's segments
come from one selection over the whole chunk and its error feedback, which a part cut
later would not match. Cost: each survivor sends and receives about 1/N of a row per dead
member, plus the segments its summers lacked, instead of a whole exchange again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from archipelago.federation.codecs import Codec
from archipelago.federation.exchange import (
    COLUMNS,
    ISLAND,
    ROUND_SEGMENT,
    ROUND_SUM,
    Framing,
    Gathered,
    SkippedWork,
    allgather,
    fill_row,
    merge_segment_tables,
    start_managed,
)
from archipelago.federation.policy import FRAME_OK, FRAME_UNSIGNED, SegmentRepair, segment_repair
from archipelago.federation.sums import SumRefused, check_sum, misreported, weighted_sum
from archipelago.federation.trust import FrameRefused

ROUND_PART = 9  # a part of a segment sent again by the segment repair (exchange.py numbers the others)
ADDRESS_VALUES = 4  # the signed payload starts with (summer, part, start, end) as int64
ADDRESS_BYTES = 8 * ADDRESS_VALUES


@dataclass(frozen=True)
class Part:
    """One part the repair moves: `sender`'s values [start, end) of the chunk, summed by
    `summer` (replica ranks of the failed exchange)."""

    sender: int
    summer: int
    segment: int
    part: int
    start: int
    end: int

    @property
    def address(self) -> tuple[int, int, int, int]:
        return (self.summer, self.part, self.start, self.end)


def part_range(codec: Codec, segments: list[tuple[int, int]], plan: SegmentRepair, segment: int,
               part: int) -> tuple[int, int]:
    """The values of the chunk that part `part` of `segment` covers: the whole segment for a
    live summer, else one of as many cuts as the segment has summers, on the codec's block
    boundaries (so each part encodes on its own, as a segment does)."""
    start, end = segments[segment]
    summers = plan.summers[segment]
    if len(summers) == 1:
        return start, end
    lo, hi = codec.for_length(end - start).segments(len(summers))[part]
    return start + lo, start + hi


def planned_parts(codec: Codec, segments: list[tuple[int, int]], plan: SegmentRepair) -> list[Part]:
    """Every part that travels, in the plan's order (the same list on every survivor); a
    part cut empty (a segment of fewer blocks than survivors) has nothing to send."""
    parts = [Part(sender, summer, segment, part, *part_range(codec, segments, plan, segment, part))
             for sender, summer, segment, part in plan.sends]
    return [part for part in parts if part.end > part.start]


def frame_bytes(codec: Codec, framing: Framing, part: Part) -> int:
    """Bytes of `part`'s frame on the wire: its address, its payload, the framing."""
    return framing.row_bytes(ADDRESS_BYTES + codec.for_length(part.end - part.start).payload_bytes())


@dataclass
class PartsInFlight:
    """The repair's all-to-all in flight (`send_parts`; `open_parts` reads it)."""

    work: Any
    received: torch.Tensor
    incoming: list[Part]       # the parts addressed to this survivor, in arrival order
    offsets: list[int]         # where each starts in `received`
    sent: int = 0              # bytes this survivor sent
    own: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (segment, part) -> own payload


def _encode(codec: Codec, x: torch.Tensor, part: Part, weight: float) -> torch.Tensor:
    piece = codec.for_length(part.end - part.start)
    if not weight:  # an island of weight 0 sends zeros, as in the first phase
        return torch.zeros(piece.payload_bytes(), dtype=torch.uint8)
    return piece.encode(x[part.start:part.end]).cpu()


def _addressed(part: Part, payload: torch.Tensor) -> torch.Tensor:
    address = torch.tensor(part.address, dtype=torch.int64).view(torch.uint8)
    return torch.cat([address, payload])


def send_parts(group: Any, codec: Codec, framing: Framing, x: torch.Tensor, tokens: int, weight: float,
               plan: SegmentRepair, segments: list[tuple[int, int]], me: int) -> PartsInFlight:
    """Start the all-to-all that moves the plan's parts among the survivors. `group` is the
    survivors' process group, its ranks the survivors in replica order; `me` this island's
    replica rank in the failed exchange; `x` its pseudo-gradient chunk (encoded part by
    part). Every survivor computes the same sizes from the plan, so nobody learns a size
    from a peer."""
    from torch.distributed.distributed_c10d import AllToAllOptions

    live = _survivors(plan)
    parts = planned_parts(codec, segments, plan)
    outgoing = [[p for p in parts if p.sender == me and p.summer == to] for to in live]
    incoming = [[p for p in parts if p.summer == me and p.sender == src] for src in live]
    frames = [framing.frame(tokens, weight, _addressed(p, _encode(codec, x, p, weight)),
                            frame_bytes(codec, framing, p), kind=ROUND_PART, segment=p.segment)
              for group_parts in outgoing for p in group_parts]
    send = torch.cat(frames) if frames else torch.zeros(0, dtype=torch.uint8)
    in_sizes = [sum(frame_bytes(codec, framing, p) for p in group_parts) for group_parts in outgoing]
    out_sizes = [sum(frame_bytes(codec, framing, p) for p in group_parts) for group_parts in incoming]
    received = torch.zeros(sum(out_sizes), dtype=torch.uint8)
    arriving = [p for group_parts in incoming for p in group_parts]
    offsets = list(itertools.accumulate((frame_bytes(codec, framing, p) for p in arriving), initial=0))[:-1]
    own = {(p.segment, p.part): _encode(codec, x, Part(me, me, p.segment, p.part, p.start, p.end), weight)
           for p in _own_parts(codec, segments, plan, me)}
    work = group.alltoall_base(received, send, out_sizes, in_sizes, AllToAllOptions())
    return PartsInFlight(work, received, arriving, offsets, sent=send.numel(), own=own)


def _survivors(plan: SegmentRepair) -> list[int]:
    """The survivors, in replica order: every live member sums its own segment, and every
    survivor a part of each dead one."""
    return sorted({summer for summers in plan.summers for summer in summers})


def _own_parts(codec: Codec, segments: list[tuple[int, int]], plan: SegmentRepair, me: int) -> list[Part]:
    """The parts `me` sums that were cut from dead segments (its own share of each is local)."""
    parts = [Part(me, me, k, part, *part_range(codec, segments, plan, k, part))
             for k, summers in enumerate(plan.summers) if len(summers) > 1
             for part, summer in enumerate(summers) if summer == me]
    return [part for part in parts if part.end > part.start]


def open_parts(inflight: PartsInFlight, codec: Codec, framing: Framing, islands: list[int] | None = None,
               claims: bool = False) -> dict[tuple[int, int, int], Any]:
    """Wait for the parts and open each: {(sender, segment, part): payload}, None where the
    frame was refused (a bad tag, another round's or kind's frame, a signer that is not the
    island at the sender's replica rank (`islands`, as the first phase's table named them),
    or an address that is not the part this survivor expected from that sender). With
    `claims`, each value is the opened frame (tokens, weight, island, payload, FRAME_*)
    instead, its payload None where refused."""
    inflight.work.wait()
    opened: dict[tuple[int, int, int], Any] = {}
    for part, offset in zip(inflight.incoming, inflight.offsets):
        size = frame_bytes(codec, framing, part)
        payload_bytes = ADDRESS_BYTES + codec.for_length(part.end - part.start).payload_bytes()
        tokens, weight, island, body, frame = framing.open(inflight.received[offset:offset + size], payload_bytes,
                                                           ROUND_PART, part.segment)
        signer_ok = islands is None or framing.key is None or island == islands[part.sender]
        ok = frame == FRAME_OK and signer_ok and body is not None and _address_of(body) == part.address
        payload = body[ADDRESS_BYTES:] if ok and body is not None else None
        where = (part.sender, part.segment, part.part)
        opened[where] = (tokens, weight, island, payload, frame if ok else FRAME_UNSIGNED) if claims else payload
    return opened


def _address_of(body: torch.Tensor) -> tuple[int, ...]:
    if body.numel() < ADDRESS_BYTES:
        return ()
    return tuple(int(v) for v in body[:ADDRESS_BYTES].clone().view(torch.int64))


# ---- the repaired exchange: holdings, parts, tables, the second phase -----------------

Opened = tuple[float, float, int, "torch.Tensor | None", int]  # tokens, weight, island, payload, FRAME_*


def held_rows(gathered: Gathered, codec: Codec, islands: list[int] | None) -> list[Opened | None]:
    """What the failed first phase left this summer of its own segment, by the old members'
    replica ranks: each row that arrived whole (its signed frame opens, from the island at
    that rank, where `islands` names them), opened; None for the others. Without a federation key nothing counts as
    held (a plain row cannot say whether it arrived whole), so the repair sends every row
    again, which is a restart's bytes, not a wrong sum."""
    members = len(gathered.segments or [])
    if gathered.framing.key is None or gathered.segments is None or not gathered.outputs:
        return [None] * members
    start, end = gathered.segments[gathered.rank]
    piece = codec.for_length(end - start)
    held: list[Opened | None] = []
    for j, row in enumerate(gathered.outputs[0]):
        opened = gathered.framing.open(row.clone(), piece.payload_bytes(), ROUND_SEGMENT, gathered.rank, sender=j)
        signer_ok = islands is None or opened[2] == islands[j]
        held.append(opened if opened[4] == FRAME_OK and opened[3] is not None and signer_ok else None)
    return held


def agree_on_holdings(manager: Any, held: list[Opened | None], me: int, survivors: list[int]) -> SegmentRepair:
    """All-gather over the survivors' new group which rows each summer holds, and plan the
    repair from them (the same plan on every survivor). A survivor that claims another old
    rank than the one the quorums give it fails the repair (`RepairRefused`)."""
    members = len(held)
    mine = torch.tensor([float(me), *[float(h is not None) for h in held]], dtype=torch.float64)
    work, tables = allgather(manager, mine, len(survivors))
    work.wait()
    if manager.errored() is not None:
        raise RepairRefused("the survivors' holdings did not arrive")
    holds = [[False] * members for _ in range(members)]
    for survivor, table in zip(survivors, tables):
        values = table.cpu().tolist()
        if int(values[0]) != survivor:
            raise RepairRefused(f"the survivor at old replica rank {survivor} claims rank {int(values[0])}")
        holds[survivor] = [bool(v) for v in values[1:]]
    alive = [j in survivors for j in range(members)]
    return segment_repair(alive, holds)


class RepairRefused(RuntimeError):
    """The segment repair cannot go on (the exchange is run again instead)."""


@dataclass(frozen=True)
class Unit:
    """A piece of the chunk the repaired exchange sums as one: a live summer's segment, or
    one part of a dead summer's; `owner` sums it (the survivors' new rank)."""

    segment: int
    part: int
    start: int
    end: int
    owner: int


def units_of(codec: Codec, segments: list[tuple[int, int]], plan: SegmentRepair) -> list[Unit]:
    """Every unit, in chunk order (each segment's parts in order), but empty ones."""
    survivors = _survivors(plan)
    units = [Unit(k, part, *part_range(codec, segments, plan, k, part), survivors.index(summer))
             for k, summers in enumerate(plan.summers) for part, summer in enumerate(summers)]
    return [unit for unit in units if unit.end > unit.start]


@dataclass
class Repaired:
    """A two-phase exchange finished by the segment repair among the survivors: the units
    this survivor sums with every survivor's payload of each, and every summer's tables."""

    framing: Framing                  # signed for the survivors' new quorum
    units: list[Unit]
    rank: int                         # this survivor's rank in the new group
    payloads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)  # unit -> per survivor
    reports: torch.Tensor | None = None   # [unit, survivor, COLUMNS] as each unit's summer reported it
    own_sumsq: torch.Tensor | None = None  # [unit] of this survivor's own payloads (None: weight 0)
    sent: int = 0
    received: int = 0
    work: Any = field(default_factory=SkippedWork)  # nothing in flight between the calls (attempts waits on it)


def repair_first_phase(manager: Any, codec: Codec, old: Gathered, framing: Framing, x: torch.Tensor,
                       tokens: int, weight: float, survivors: list[int], islands: list[int] | None
                       ) -> tuple[Repaired, torch.Tensor]:
    """The first phase, repaired: agree on the holdings, move the missing parts, inspect
    every unit this survivor sums and all-gather the tables. Returns the repaired exchange
    and the merged table (COLUMNS, one row per survivor) the receivers judge, as
    `inspect_gather` does for an exchange that went through. `islands`: the island id at
    each old replica rank, as the quorum's member ids name them (None: not known; then
    each row's claims must agree across its units, and no island may claim two rows)."""
    assert old.segments is not None, "the repair finishes a two-phase exchange"
    me = old.rank
    held = held_rows(old, codec, islands)
    plan = agree_on_holdings(manager, held, me, survivors)
    units = units_of(codec, old.segments, plan)
    rank = survivors.index(me)
    inflight = send_parts(_Managed(manager), codec, framing, x, tokens, weight, plan, old.segments, me)
    opened = open_parts(inflight, codec, framing, islands, claims=True)
    if manager.errored() is not None:
        raise RepairRefused("the repair's parts did not arrive")
    island = old.framing.island if framing.key is not None else -1  # what a plain frame of it reads as
    own = {u: _own_opened(codec, x, unit, tokens, weight, island)
           for u, unit in enumerate(units) if unit.owner == rank}
    repaired = Repaired(framing, units, rank, sent=inflight.sent, received=inflight.received.numel())
    # Each survivor all-gathers the tables of the units it sums only (1 + one per dead
    # member), padded to the most any survivor sums: about what the first phase's tables cost.
    owned = [[u for u, unit in enumerate(units) if unit.owner == i] for i in range(len(survivors))]
    local = torch.zeros(max(len(o) for o in owned), len(survivors), len(COLUMNS), dtype=torch.float64)
    local[:, :, ISLAND] = -1
    for slot, u in enumerate(owned[rank]):
        unit = units[u]
        piece = codec.for_length(unit.end - unit.start)
        entries = [own[u] if j == me else
                   held[j] if unit.segment == me and held[j] is not None else
                   opened.get((j, unit.segment, unit.part)) for j in survivors]
        repaired.payloads[u] = [fill_row(local[slot], i, entry or _refused(), piece)
                                for i, entry in enumerate(_once_per_island(entries))]
    work, tables = allgather(manager, local.flatten(), len(survivors))
    work.wait()
    if manager.errored() is not None:
        raise RepairRefused("the repaired units' tables did not arrive")
    shaped = [t.cpu().view(local.shape) for t in tables]
    repaired.reports = torch.stack([shaped[unit.owner][owned[unit.owner].index(u)] for u, unit in enumerate(units)])
    repaired.sent += local.numel() * 8
    repaired.received += local.numel() * 8 * (len(survivors) - 1)
    if weight:
        repaired.own_sumsq = torch.tensor([_sumsq_of(codec, x, unit) for unit in units], dtype=torch.float64)
    return repaired, merge_segment_tables(list(repaired.reports))


def _refused() -> Opened:
    return (0.0, 0.0, -1, None, FRAME_UNSIGNED)


def _once_per_island(entries: list[Opened | None]) -> list[Opened | None]:
    """An island's frame in two rows of one unit is a replay: the later one is refused."""
    seen: set[int] = set()
    kept: list[Opened | None] = []
    for entry in entries:
        if entry is not None and entry[2] >= 0 and entry[2] in seen:
            entry = None
        if entry is not None:
            seen.add(entry[2])
        kept.append(entry)
    return kept


def _own_opened(codec: Codec, x: torch.Tensor, unit: Unit, tokens: int, weight: float, island: int) -> Opened:
    """This survivor's own payload of a unit it sums, as if it had arrived (its claims)."""
    part = Part(-1, -1, unit.segment, unit.part, unit.start, unit.end)
    return (float(tokens), float(weight), island, _encode(codec, x, part, weight), FRAME_OK)


def _sumsq_of(codec: Codec, x: torch.Tensor, unit: Unit) -> float:
    """The sum of squares of this survivor's unit as its summer decodes it."""
    piece = codec.for_length(unit.end - unit.start)
    values = piece.decode(piece.encode(x[unit.start:unit.end])).double()
    return float(values.square().sum())


class _Managed:
    """The survivors' group as torchft's manager runs it: a failure is reported to the
    manager (the round then does not commit) instead of raising here."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_sizes: list[int],
                      input_sizes: list[int], options: Any) -> Any:
        return start_managed(self.manager, lambda: self.manager._pg.alltoall_base(output, input, output_sizes,
                                                                             input_sizes, options), output,
                             inputs=(input,))


def finish_repair(repaired: Repaired, codec: Codec, into: torch.Tensor, weights: list[float], tokens: float,
                  manager: Any, trimmed: bool = False) -> None:
    """The repaired exchange's second phase: each survivor sums the units it owns with the
    receivers' `weights` (in survivor order), encodes each sum again and the survivors
    all-gather them, every summer's units in one frame; each sum is checked against its
    unit's table (`sums.check_sum`) before it is written into `into` ([sum ..., tokens,
    sum w]). A sum that fails, or a survivor's complaint that a summer misreported its
    unit, fails the round on every survivor alike (the manager's error)."""
    into.zero_()
    if manager.errored() is not None or repaired.reports is None:
        return
    units, rank = repaired.units, repaired.rank
    pieces = [codec.for_length(unit.end - unit.start) for unit in units]
    mine = [u for u, unit in enumerate(units) if unit.owner == rank]
    payload = torch.cat([pieces[u].encode(weighted_sum(repaired.payloads[u], pieces[u], weights,
                                                       pieces[u].numel, torch.device("cpu"), trimmed))
                         for u in mine]) if mine else torch.zeros(0, dtype=torch.uint8)
    survivors = len(weights)
    sizes = [sum(pieces[u].payload_bytes() for u, unit in enumerate(units) if unit.owner == i)
             for i in range(survivors)]
    complaint = None
    if repaired.own_sumsq is not None:
        complaint = misreported(repaired.reports, repaired.own_sumsq, rank)
    size = repaired.framing.row_bytes(max(sizes))
    row = repaired.framing.frame(0.0 if complaint is None else complaint + 1.0, sum(weights), payload, size,
                                 ROUND_SUM, rank)
    work, outputs = allgather(manager, row, survivors)
    work.wait()
    repaired.sent += size
    repaired.received += size * (survivors - 1)
    if manager.errored() is not None:
        into.zero_()
        return
    problem = _read_repaired_sums(repaired, pieces, sizes, outputs, into, weights, trimmed)
    if problem is not None:
        manager.report_error(problem)
        into.zero_()
        return
    into[-2], into[-1] = tokens, sum(weights)


def _read_repaired_sums(repaired: Repaired, pieces: list[Codec], sizes: list[int], outputs: list[torch.Tensor],
                        into: torch.Tensor, weights: list[float], trimmed: bool) -> Exception | None:
    """Open every summer's frame, split it into its units, decode and check each into
    `into`; the first problem, or None (the same verdict on every survivor)."""
    assert repaired.reports is not None
    for i, out in enumerate(outputs):
        complaint, _, _, opened, frame = repaired.framing.open(out, sizes[i], ROUND_SUM, i, sender=i)
        if opened is None or frame != FRAME_OK:
            return FrameRefused(f"the repaired sums of the survivor at rank {i} are not signed by the federation's key")
        if complaint:
            return SumRefused(f"the survivor at rank {i} says the summer of repaired unit {int(complaint) - 1} "
                              "misreported the norm of its part of it")
        at = 0
        for u, unit in enumerate(repaired.units):
            if unit.owner != i:
                continue
            values = pieces[u].decode(opened[at:at + pieces[u].payload_bytes()])
            at += pieces[u].payload_bytes()
            why = check_sum(values, repaired.reports[u], weights, trimmed, pieces[u])
            if why is not None:
                return SumRefused(f"the sum of repaired unit {u} (segment {unit.segment}, part {unit.part}) "
                                  f"from the survivor at rank {i}: {why}")
            into[unit.start:unit.end] = values.to(into.device)
    return None
