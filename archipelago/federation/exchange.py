"""Starting and finishing one bridge chunk's exchange across islands.

With the `fp32` codec the islands' weighted pseudo-gradients are summed by one all-reduce
of `[w*g ..., tokens, w]` (diloco.py). With any other codec the sum cannot happen on
encoded values. Two ways, both leaving every island with bit-identical results:

* all-gather (top-k, and any codec between two islands): each island sends its
  `[tokens, w | encoded g]` payload; every island decodes all of them and sums
  `w_k * decode(payload_k)` in fp32, in the same order (replica rank).
* reduce-scatter, then all-gather (bf16 and int8 with three or more islands): the chunk
  is cut into one segment per island. An all-to-all hands island j everyone's encoded
  segment j; it sums them in fp32 (replica order), encodes that sum again and the
  islands all-gather the summed segments. Each island then sends and receives about
  2 x (G-1)/G payloads instead of G - 1, at the price of a second rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from archipelago.federation.codecs import Codec

HEADER_BYTES = 8  # [tokens, weight] as two fp32 values


@dataclass
class Gathered:
    """An exchange in flight: the work to wait on and where the payloads land."""

    work: Any
    outputs: list[torch.Tensor] = field(default_factory=list)
    encode_s: float = 0.0
    sent: int = 0          # bytes of this island's data addressed to other islands
    received: int = 0      # bytes that came from other islands
    segments: list[tuple[int, int]] | None = None  # reduce-scatter: the islands' segments
    rank: int = 0          # this island's replica rank (its segment)


class _Done:
    """Stands in for a collective that was skipped (the manager already saw an error)."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def two_phase(codec: Codec, participants: int) -> bool:
    """Reduce-scatter + all-gather pays off from three islands on, for codecs whose
    segments encode on their own (not top-k, whose error feedback spans the chunk)."""
    return codec.align > 0 and participants >= 3


def _wire_device(manager: Any, device: torch.device) -> torch.device:
    """Where payloads cross: the island's device for NCCL, host memory for gloo (its GPU
    support covers all-reduce and broadcast, not the all-to-all; the payloads are small
    next to the pseudo-gradient, so the copy is cheap)."""
    return device if "NCCL" in type(manager._pg).__name__ else torch.device("cpu")


def _row_bytes(pieces: list[Codec]) -> int:
    """Bytes per row of the reduce-scatter: header + the largest segment payload, rounded
    up to 8 so that every row of a stacked buffer starts aligned for its fp32 views."""
    return HEADER_BYTES + -(-max(piece.payload_bytes() for piece in pieces) // 8) * 8


def _frame(header: torch.Tensor, body: torch.Tensor, size: int) -> torch.Tensor:
    """`[header | body]` zero-padded to `size` bytes (equal sizes for the collectives)."""
    out = torch.zeros(size, dtype=torch.uint8, device=body.device)
    out[:HEADER_BYTES] = header.view(torch.uint8)
    out[HEADER_BYTES:HEADER_BYTES + body.numel()] = body
    return out


def _encoded(codec: Codec, x: torch.Tensor, weight: float) -> torch.Tensor:
    """`codec`'s payload of `x`, or zeros (of the same size) for an island of weight 0."""
    if weight:
        return codec.encode(x)
    return torch.zeros(codec.payload_bytes(), dtype=torch.uint8, device=x.device)


def _managed(manager: Any, start: Any, outputs: Any) -> Any:
    """Start a collective on torchft's process group with Manager.allreduce's error
    handling (_ManagedWork): a failure is reported to the manager, so the round will not
    commit, instead of raising here."""
    if manager.errored() is not None:  # the round is lost already; do not touch the network
        return _Done()
    from torchft.manager import _ManagedWork

    try:
        return _ManagedWork(manager, start(), outputs)
    except Exception as exc:  # noqa: BLE001 - any transport failure only loses this round
        manager.report_error(exc)
        return _Done()


def start_gather(manager: Any, codec: Codec, pseudo_gradient: torch.Tensor, tokens: int,
                 weight: float) -> Gathered:
    """Encode this island's chunk and start the exchange (through torchft's process group).

    An island with weight 0 sends zeros and leaves its codec state (error feedback) alone:
    nothing of it enters the average, so nothing of it counts as sent.
    """
    from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

    began = time.perf_counter()
    participants = max(manager.num_participants(), 1)
    device = pseudo_gradient.device
    wire = _wire_device(manager, device)
    header = torch.tensor([float(tokens), weight], dtype=torch.float32, device=device)
    if two_phase(codec, participants):
        segments = codec.segments(participants)
        pieces = [codec.for_length(end - start) for start, end in segments]
        size = _row_bytes(pieces)
        send = torch.stack([_frame(header, _encoded(piece, pseudo_gradient[start:end], weight), size)
                            for piece, (start, end) in zip(pieces, segments)]).to(wire)
        received = torch.zeros_like(send)
        encode_s = time.perf_counter() - began
        rank = manager.participating_rank()
        if rank is None:  # not in the quorum after all: this round is lost (finish sees the error)
            manager.report_error(RuntimeError("island is not a participant of the exchange's quorum"))
            return Gathered(_Done(), [received], encode_s, segments=segments)
        work = _managed(manager, lambda: manager._pg.alltoall_base(received, send, [], [], AllToAllOptions()),
                        received)
        return Gathered(work, [received], encode_s, sent=(participants - 1) * size,
                        received=(participants - 1) * size, segments=segments, rank=rank)
    payload = torch.cat([header.view(torch.uint8), _encoded(codec, pseudo_gradient, weight)]).to(wire)
    encode_s = time.perf_counter() - began
    outputs = [torch.zeros_like(payload) for _ in range(participants)]
    work = _managed(manager, lambda: manager._pg.allgather([outputs], [payload], AllgatherOptions()), outputs)
    return Gathered(work, outputs, encode_s, sent=payload.numel(), received=payload.numel() * (participants - 1))


def finish_gather(gathered: Gathered, codec: Codec, into: torch.Tensor, manager: Any = None) -> float:
    """Wait, then write `[sum w_k*g_k ..., sum tokens_k, sum w_k]` into `into`; returns
    the decode seconds (with reduce-scatter: also the second phase's)."""
    gathered.work.wait()
    began = time.perf_counter()
    if manager is not None and manager.errored() is not None:  # the round will not commit
        into.zero_()
        return time.perf_counter() - began
    if gathered.segments is None:
        into[:-2], tokens, weights = _weighted_sum(gathered.outputs, codec, into.numel() - 2, into.device)
        into[-2], into[-1] = tokens, weights
    else:
        _finish_two_phase(gathered, codec, into, manager)
    return time.perf_counter() - began


def _weighted_sum(rows: list[torch.Tensor] | torch.Tensor, codec: Codec, numel: int,
                  device: torch.device) -> tuple[torch.Tensor, float, float]:
    """sum_k w_k * decode(row_k) in fp32 in row (replica) order, sum tokens, sum weights.
    Summed where the rows are (host memory under gloo), then moved once to `device`."""
    total = torch.zeros(numel, dtype=torch.float32, device=rows[0].device if len(rows) else device)
    tokens, weights = 0.0, 0.0
    for row in rows:
        head = row[:HEADER_BYTES].view(torch.float32)
        tokens += float(head[0])
        weight = float(head[1])
        if weight:
            weights += weight
            total += weight * codec.decode(row[HEADER_BYTES:HEADER_BYTES + codec.payload_bytes()])
    return total.to(device), tokens, weights


def _finish_two_phase(gathered: Gathered, codec: Codec, into: torch.Tensor, manager: Any) -> None:
    """Sum this island's segment, encode the sum again and all-gather the summed segments."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    segments = gathered.segments
    assert segments is not None, "a two-phase exchange always has segments"
    pieces = [codec.for_length(end - start) for start, end in segments]
    mine = pieces[gathered.rank]
    total, tokens, weights = _weighted_sum(list(gathered.outputs[0]), mine, mine.numel, into.device)
    header = torch.tensor([tokens, weights], dtype=torch.float32, device=into.device)
    size = _row_bytes(pieces)
    payload = _frame(header, mine.encode(total), size).to(_wire_device(manager, into.device))
    outputs = [torch.zeros_like(payload) for _ in segments]
    _managed(manager, lambda: manager._pg.allgather([outputs], [payload], AllgatherOptions()), outputs).wait()
    gathered.sent += size
    gathered.received += size * (len(segments) - 1)
    if manager.errored() is not None:  # the second phase failed: the round will not commit
        into.zero_()
        return
    # Every island decodes the same summed segments: the same bytes, the same result.
    for piece, (start, end), row in zip(pieces, segments, outputs):
        into[start:end] = piece.decode(row[HEADER_BYTES:HEADER_BYTES + piece.payload_bytes()]).to(into.device)
    head = outputs[0][:HEADER_BYTES].view(torch.float32)
    into[-2], into[-1] = float(head[0]), float(head[1])
