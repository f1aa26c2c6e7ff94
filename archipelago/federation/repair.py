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

from dataclasses import dataclass, field
from typing import Any

import torch

from archipelago.federation.codecs import Codec
from archipelago.federation.exchange import Framing
from archipelago.federation.policy import FRAME_OK, SegmentRepair

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
    """Every part that travels, in the plan's order (the same list on every survivor)."""
    return [Part(sender, summer, segment, part, *part_range(codec, segments, plan, segment, part))
            for sender, summer, segment, part in plan.sends]


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
    offsets = _offsets([frame_bytes(codec, framing, p) for p in arriving])
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
    return [Part(me, me, k, part, *part_range(codec, segments, plan, k, part))
            for k, summers in enumerate(plan.summers) if len(summers) > 1
            for part, summer in enumerate(summers) if summer == me]


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def open_parts(inflight: PartsInFlight, codec: Codec, framing: Framing,
               islands: list[int] | None = None) -> dict[tuple[int, int, int], torch.Tensor | None]:
    """Wait for the parts and open each: {(sender, segment, part): payload}, None where the
    frame was refused (a bad tag, another round's or kind's frame, a signer that is not the
    island at the sender's replica rank (`islands`, as the first phase's table named them),
    or an address that is not the part this survivor expected from that sender)."""
    inflight.work.wait()
    opened: dict[tuple[int, int, int], torch.Tensor | None] = {}
    for part, offset in zip(inflight.incoming, inflight.offsets):
        size = frame_bytes(codec, framing, part)
        payload_bytes = ADDRESS_BYTES + codec.for_length(part.end - part.start).payload_bytes()
        _, _, island, body, frame = framing.open(inflight.received[offset:offset + size], payload_bytes,
                                                 ROUND_PART, part.segment)
        signer_ok = islands is None or framing.key is None or island == islands[part.sender]
        ok = frame == FRAME_OK and signer_ok and body is not None and _address_of(body) == part.address
        opened[(part.sender, part.segment, part.part)] = body[ADDRESS_BYTES:] if ok and body is not None else None
    return opened


def _address_of(body: torch.Tensor) -> tuple[int, ...]:
    if body.numel() < ADDRESS_BYTES:
        return ()
    return tuple(int(v) for v in body[:ADDRESS_BYTES].clone().view(torch.int64))
