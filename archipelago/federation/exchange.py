"""One bridge chunk's exchange across islands, with every island's row checked by every receiver.

Every codec, fp32 included, crosses islands as rows: one per island, `[header | payload]`
(header: the island's tokens and weight), or with a federation key a signed frame
(trust.py: its header binds quorum, step, fragment and island; the HMAC tag is checked
before anything is read). A summed all-reduce would hide who sent what; rows let each
receiver judge each island's contribution (policy.judge_contributions) and leave a
refused one out, and all islands decide alike because they judge the same bytes.

Two ways to move the rows, both leaving every island with bit-identical results:

* all-gather (fp32, top-k, and any codec between two islands): every island receives
  every row, decodes all of them and sums `w_k * decode(payload_k)` in fp32, in the same
  order (replica rank).
* reduce-scatter, then all-gather (bf16 and int8 with three or more islands; top-k when
  `topk_exchange` says so): the chunk
  is cut into one segment per island. An all-to-all hands island j everyone's encoded
  segment j; it inspects them, the islands all-gather what they found (a small table),
  so every island judges every contribution from all its segments; island j then sums
  the accepted ones in fp32 (replica order), encodes that sum again and the islands
  all-gather the summed segments. Each island then sends and receives about
  2 x (G-1)/G payloads instead of G - 1, at the price of a second rounding. Island j is
  trusted with the sum of segment j only as far as every island can check it: its values
  must be finite and its norm within what the accepted segments' norms allow (the
  table's, per island and segment; each island checks what its own segments were
  reported to be): `_check_sum`. Top-k's segments are whole chunks of its own, cut
  from one selection over the whole chunk (so its error feedback is unchanged), and its
  sums are not rounded again: island j all-gathers its sum exactly, as a bitmap of the
  nonzero values and those values in fp32 (codecs.pack_sum), after the islands have
  all-gathered the sums' sizes. Each island decodes and receives then about one payload
  plus one summed chunk (at most ~4.1 bytes per value) whatever the number of islands,
  instead of G - 1 payloads, and ends with the all-gather's result bit for bit.

The exchange runs in three calls, so that the outer loop can combine what the island's
bridge ranks found between them: `start_gather`, `inspect_gather` (a table of what each
row claims and holds), `finish_gather` (the sum with the weights the receivers decided).
Then `agree_on_exchange` all-gathers one signed flag per island, whether the exchange went
through there: torchft's commit vote is a vote inside one island, so without it one island
could commit a round whose exchange failed on another (docs/rounds.md).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from archipelago.config.errors import ConfigError
from archipelago.federation.codecs import Codec, PayloadError, pack_sum, sum_bytes_bound, unpack_sum
from archipelago.federation.outer_core import aggregate
from archipelago.federation.policy import (
    EXCHANGE_COMPLETED,
    FRAME_MALFORMED,
    FRAME_OK,
    FRAME_UNSIGNED,
    exchange_agreed,
)
from archipelago.federation.trust import (
    HEADER_BYTES as SIGNED_HEADER_BYTES,
)
from archipelago.federation.trust import (
    TAG_BYTES,
    FederationKey,
    FrameHeader,
    FrameRefused,
    claimed_island,
    open_frame,
    seal,
)

PLAIN_HEADER_BYTES = 16  # [tokens, weight] as two float64 values (no federation key)

# Frame kinds of the round (trust.py numbers the healing kinds).
ROUND_ROW = 3      # an island's encoded pseudo-gradient chunk (all-gather)
ROUND_SEGMENT = 4  # one segment of it (the reduce-scatter's all-to-all)
ROUND_SUM = 5      # an island's sum of one segment (the reduce-scatter's all-gather)
ROUND_AGREE = 8    # an island's flag after the exchange: it went through here (agree_on_exchange)

# The table inspect_gather returns: one row per island, these columns.
COLUMNS = ("tokens", "weight", "frame", "nonfinite", "sumsq", "island")
TOKENS, WEIGHT, FRAME, NONFINITE, SUMSQ, ISLAND = range(len(COLUMNS))


@dataclass(frozen=True)
class Framing:
    """How rows are framed: plain (no key) or signed frames bound to one round.

    `quorum`, `step`, `fragment` and `island` are this island's view of the round; a
    signed row from elsewhere (another round, fragment or kind) is refused as a replay.
    `forge` is the demo's lying island (guard.Poison): it falsifies its own header.
    """

    key: FederationKey | None = None
    quorum: int = 0
    step: int = 0
    fragment: int = 0
    island: int = 0
    forge: str | None = None  # "forge_tokens", "forge_weight" or "unsigned" (demo only)

    @property
    def header_bytes(self) -> int:
        return PLAIN_HEADER_BYTES if self.key is None else SIGNED_HEADER_BYTES

    @property
    def trailer_bytes(self) -> int:
        return 0 if self.key is None else TAG_BYTES

    def row_bytes(self, payload_bytes: int) -> int:
        """Bytes of a row, rounded up to 8 so stacked rows stay aligned."""
        return -(-(self.header_bytes + payload_bytes + self.trailer_bytes) // 8) * 8

    def _where(self, kind: int, segment: int, island: int) -> FrameHeader:
        return FrameHeader(self.quorum, self.step, self.fragment << 16 | segment, island, kind)

    def frame(self, tokens: float, weight: float, payload: torch.Tensor, size: int, kind: int = ROUND_ROW,
              segment: int = 0) -> torch.Tensor:
        """`payload` with its header (and tag), zero-padded to `size` bytes, in host memory
        when signed (the tag is computed there), else on the payload's device."""
        tokens, weight = self._claims(tokens, weight)
        if self.key is None:
            out = torch.zeros(size, dtype=torch.uint8, device=payload.device)
            out[:PLAIN_HEADER_BYTES] = torch.tensor([tokens, weight], dtype=torch.float64,
                                                    device=payload.device).view(torch.uint8)
            out[PLAIN_HEADER_BYTES:PLAIN_HEADER_BYTES + payload.numel()] = payload
            return out
        header = replace(self._where(kind, segment, self.island), tokens=int(min(max(tokens, 0), 2 ** 64 - 1)),
                         weight=weight)
        key = FederationKey(b"\x00" * 32) if self.forge == "unsigned" else self.key
        sealed = seal(key, header, payload.cpu().numpy().tobytes())
        out = torch.zeros(size, dtype=torch.uint8)
        out[:len(sealed)] = torch.frombuffer(bytearray(sealed), dtype=torch.uint8)
        return out

    def _claims(self, tokens: float, weight: float) -> tuple[float, float]:
        if self.forge == "forge_tokens":
            return 1e15, weight
        if self.forge == "forge_weight":
            return tokens, -1e6
        return tokens, weight

    def open(self, row: torch.Tensor, payload_bytes: int, kind: int = ROUND_ROW,
             segment: int = 0) -> tuple[float, float, int, torch.Tensor | None, int]:
        """(tokens, weight, island, payload, FRAME_*) of a received row; payload None when refused."""
        if self.key is None:
            head = row[:PLAIN_HEADER_BYTES].cpu().view(torch.float64)
            return (float(head[0]), float(head[1]), -1,
                    row[PLAIN_HEADER_BYTES:PLAIN_HEADER_BYTES + payload_bytes], FRAME_OK)
        size = SIGNED_HEADER_BYTES + payload_bytes + TAG_BYTES
        raw = row[:size].cpu().numpy().tobytes()
        try:
            got, payload = open_frame(self.key, raw, self._where(kind, segment, 0), any_island=True)
        except FrameRefused:
            return 0.0, 0.0, claimed_island(raw), None, FRAME_UNSIGNED
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
        return float(got.tokens), float(got.weight), got.island, body.to(row.device), FRAME_OK


@dataclass
class Gathered:
    """An exchange in flight: the work to wait on and where the rows land."""

    work: Any
    framing: Framing
    outputs: list[torch.Tensor] = field(default_factory=list)
    encode_s: float = 0.0
    sent: int = 0          # bytes of this island's data addressed to other islands
    received: int = 0      # bytes that came from other islands
    segments: list[tuple[int, int]] | None = None  # reduce-scatter: the islands' segments
    rank: int = 0          # this island's replica rank (its segment)
    payloads: list[torch.Tensor | None] = field(default_factory=list)  # opened by inspect_gather
    # Reduce-scatter: every summer's first-phase table as it sent it ([segment, island,
    # COLUMNS], host): the per-(island, segment) norms that bound each summed segment.
    reports: torch.Tensor | None = None
    # Reduce-scatter: the sums of squares of this island's own segments as it sent them
    # (decoded, float64, on its device); None when it sent weight 0 (nothing to check).
    own_sumsq: torch.Tensor | None = None
    started: float = 0.0   # perf_counter() when it was handed to the transport
    done_at: list[float] = field(default_factory=list)  # perf_counter() when the first phase's rows were in
    second: SecondPhase | None = None  # reduce-scatter: the summed segments' all-gather, once started


@dataclass
class SecondPhase:
    """The reduce-scatter's second phase in flight: this island's summed segment sent, the
    others' arriving (`start_sums`; `finish_gather` reads them)."""

    weights: list[float]   # the receivers' verdicts the sums were made with
    work: Any = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    pieces: list[Codec] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    failed: bool = True    # nothing to read: the manager saw an error before or while starting it
    started: float = 0.0   # perf_counter() when it was handed to the transport
    done_at: list[float] = field(default_factory=list)  # ... when its rows were in (gloo stamps it)
    waited: float = 0.0    # ... when finish_gather's wait for them returned

    def seconds(self) -> float:
        """From its start until its rows were in (0 when it did not run)."""
        return 0.0 if self.failed else seconds_until_in(self.started, self.waited, self.done_at)


def seconds_until_in(started: float, waited: float, done_at: list[float]) -> float:
    """A collective's seconds from `started` until its rows were in: the transport's thread
    stamped that where it can (`done_at`), else the wait for them returned (`waited`, 0 when
    nobody waited: the round failed first). 0 when neither is known."""
    ends = [t for t in (waited, *done_at) if t]
    return max(started, min(ends)) - started if ends else 0.0


class _Done:
    """Stands in for a collective that was skipped (the manager already saw an error)."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def two_phase(codec: Codec, participants: int) -> bool:
    """Reduce-scatter + all-gather: for dense codecs whose segments encode on their own,
    from three islands on; for top-k as its `exchange` says (`sparse_two_phase`)."""
    if codec.sparse:
        return sparse_two_phase(codec, participants)
    return codec.align > 0 and participants >= 3


def summed_as_received(codec: Codec, total: torch.Tensor, participants: int) -> torch.Tensor:
    """What every island receives of `total`, the weighted sum of an exchange's decoded rows:
    after the reduce-scatter each summer's segment of it is encoded again with the codec
    (dense codecs: a second rounding); top-k's sums cross exactly, and the all-gather's sum is
    made by each receiver. The quality simulator's model of the exchange."""
    if codec.sparse or not two_phase(codec, participants):
        return total
    received = total.clone()
    for start, end in codec.segments(participants):
        piece = codec.for_length(end - start)
        received[start:end] = piece.decode(piece.encode(total[start:end]))
    return received


def sparse_two_phase(codec: Any, participants: int) -> bool:
    """Whether top-k payloads take the reduce-scatter: forced by `exchange`, or, with
    `auto`, when an island's received bytes are bounded lower that way: a segment payload
    and the largest exact sum of a segment from each other island, against a whole
    payload from each (the same on every island: it depends on the config alone)."""
    if participants < 2 or codec.exchange == "all_gather":
        return False
    if codec.exchange == "reduce_scatter":
        return True
    pieces = [codec.for_length(end - start) for start, end in codec.segments(participants)]
    scattered = max(p.payload_bytes() + sum_bytes_bound(p.numel, p.sum_nonzeros(participants)) for p in pieces)
    return scattered < codec.payload_bytes()


def wire_device(manager: Any, device: torch.device) -> torch.device:
    """Where rows cross: the island's device for NCCL (which carries nothing else; a
    signed row is sealed in host memory, then copied there), host memory for gloo (its GPU
    support covers all-reduce and broadcast, not the all-to-all)."""
    return device if "NCCL" in type(manager._pg).__name__ else torch.device("cpu")


def _encoded(codec: Codec, x: torch.Tensor, weight: float) -> torch.Tensor:
    """`codec`'s payload of `x`, or zeros (of the same size) for an island of weight 0."""
    if weight:
        return codec.encode(x)
    return torch.zeros(codec.payload_bytes(), dtype=torch.uint8, device=x.device)


def _segment_payloads(codec: Codec, pieces: list[Codec], segments: list[tuple[int, int]], x: torch.Tensor,
                      weight: float) -> list[torch.Tensor]:
    """One payload per segment; zeros for an island of weight 0 (its codec state untouched)."""
    if not weight:
        return [torch.zeros(piece.payload_bytes(), dtype=torch.uint8, device=x.device) for piece in pieces]
    if codec.sparse:  # one selection over the whole chunk, cut into the segments' chunks
        return codec.encode_segments(x, segments)  # type: ignore[attr-defined]
    return [piece.encode(x[start:end]) for piece, (start, end) in zip(pieces, segments)]


def _managed(manager: Any, start: Any, outputs: Any, done_at: list[float] | None = None) -> Any:
    """Start a collective on torchft's process group with Manager.allreduce's error
    handling (_ManagedWork): a failure is reported to the manager, so the round will not
    commit, instead of raising here. With `done_at`, the collective's completion time
    (perf_counter) is appended to it by the transport's thread (codec = "auto" measures the
    link with it, also while inner steps overlap the exchange)."""
    if manager.errored() is not None:  # the round is lost already; do not touch the network
        return _Done()
    from torchft.manager import _ManagedWork

    try:
        work = start()
        if done_at is not None:
            _stamp_completion(work, done_at)
        return _ManagedWork(manager, work, outputs)
    except Exception as exc:  # noqa: BLE001 - any transport failure only loses this round
        manager.report_error(exc)
        return _Done()


def _stamp_completion(work: Any, done_at: list[float]) -> None:
    """Append the time `work` completes to `done_at` (nothing, where the transport's work
    has no future: the caller then takes the time its wait returned). Never raises: a
    timing aid must not cost the round."""
    try:
        work.get_future().add_done_callback(lambda _: done_at.append(time.perf_counter()))
    except Exception:  # noqa: BLE001 - any transport without usable futures: no stamp
        pass


def _completion_stamps(wire: torch.device) -> list[float] | None:
    """Where the exchange's completion time goes: gloo's work completes (on its own thread)
    when the rows are in; NCCL's future completes when the collective is enqueued (torch's
    `Work.get_future`), which says nothing about the link, so a GPU wire stamps nothing and
    the wait's return counts instead."""
    return [] if wire.type == "cpu" else None


def _stamps_list(done_at: list[float] | None) -> list[float]:
    """The list the transport's thread appends to (itself, even while empty: `done_at or []`
    would hand the exchange a new list the thread never sees), or a new one where nothing
    stamps."""
    return done_at if done_at is not None else []


def allgather(manager: Any, payload: torch.Tensor, count: int,
              done_at: list[float] | None = None) -> tuple[Any, list[torch.Tensor]]:
    from torch.distributed.distributed_c10d import AllgatherOptions

    outputs = [torch.zeros_like(payload) for _ in range(count)]
    start = lambda: manager._pg.allgather([outputs], [payload], AllgatherOptions())  # noqa: E731
    return _managed(manager, start, outputs, done_at), outputs


def round_received(codec: Codec, participants: int, framing: Framing) -> int:
    """Bytes one island receives in one exchange of `participants` islands, as the
    exchange below counts them (for the simulator: federation/simulate.py). A top-k
    reduce-scatter's summed segments vary with how many values the islands' choices share:
    counted here at the expected union of independent choices, 1 - (1 - k/chunk)^G."""
    if participants < 2:
        return 0
    if not two_phase(codec, participants):
        return (participants - 1) * framing.row_bytes(codec.payload_bytes())
    pieces = [codec.for_length(end - start) for start, end in codec.segments(participants)]
    segment = framing.row_bytes(max(piece.payload_bytes() for piece in pieces))
    if not codec.sparse:
        return 2 * (participants - 1) * segment
    share = 1 - (1 - codec.k / codec.chunk) ** participants  # type: ignore[attr-defined]
    numel = max(piece.numel for piece in pieces)
    summed = framing.row_bytes(math.ceil(numel / 8) + 4 * math.ceil(share * numel))
    return (participants - 1) * (segment + 8 + summed)


# codec = "auto": an exchange may take this share of the islands' median round unless
# target_exchange_s says otherwise (95% of the round left for inner steps) ...
AUTO_EXCHANGE_SHARE = 0.05
# ... and with streaming's overlap, this share of the inner steps it overlaps: the rest is
# room for a peer that starts late and for the steps the transfer slows (over 100 Mbit/s
# a fragment exchange sized to fill its whole overlap left 0.1-0.5 s exposed; bench/wan.py).
AUTO_OVERLAP_SHARE = 0.5


def auto_target_s(ft: Any, round_s: float, per_fragment: int | None = None) -> float:
    """codec = "auto": the seconds an exchange may take, `target_exchange_s` or else
    AUTO_EXCHANGE_SHARE of a round of `round_s` compute seconds; with streaming fragments
    and `fragment_sync_delay` steps of overlap, AUTO_OVERLAP_SHARE of those steps' seconds
    if that is more (the exchange hides behind them). `per_fragment`: inner steps per
    fragment round, as the outer loop counts them (default: from the config)."""
    if ft.target_exchange_s:
        return float(ft.target_exchange_s)
    if per_fragment is None:
        per_fragment = ft.sync_steps // max(ft.num_fragments, 1)
    overlap = ft.fragment_sync_delay / max(per_fragment, 1) if ft.round_pacing == "steps" else 0.0
    return max(AUTO_EXCHANGE_SHARE, AUTO_OVERLAP_SHARE * overlap) * round_s


def choose_codec(codec: Any, participants: int, link_bits_s: float, target_s: float, framing: Framing) -> str:
    """codec = "auto": the densest of its options whose exchange among `participants`
    islands, over a link of `link_bits_s`, takes at most `target_s` seconds (the bytes as
    `round_received` counts them); when none does, the one that receives the fewest bytes
    (top-k's all-gather can receive more than int8's reduce-scatter from about seven
    islands on). The same on every island given the same agreed values."""
    received = {name: round_received(option, participants, framing) for name, option in codec.options.items()}
    for name, size in received.items():
        if size * 8 / link_bits_s <= target_s:
            return name
    return min(received, key=lambda name: received[name])


def agree_on_link(manager: Any, link_bits_s: float, round_s: float, participants: int,
                  device: torch.device) -> tuple[float, float] | None:
    """codec = "auto": all-gather each island's last measured link rate and round seconds
    (16 bytes each); the slowest link and the median round, the same on every island.
    None before any island has measured (or when the all-gather fails: the round is lost).
    A lying island can lower the agreed link (a sparser codec for all) but not raise it,
    and moves the median round by one place at most."""
    values = torch.tensor([link_bits_s, round_s], dtype=torch.float64, device=device)
    work, outputs = allgather(manager, values, participants)
    work.wait()
    if manager.errored() is not None:
        return None
    rows = [out.cpu().tolist() for out in outputs]
    links = [link for link, _ in rows if math.isfinite(link) and link > 0]
    rounds = [r for _, r in rows if math.isfinite(r) and r > 0]
    if not links:
        return None
    return min(links), statistics.median(rounds) if rounds else 0.0


def start_gather(manager: Any, codec: Codec, pseudo_gradient: torch.Tensor, tokens: int,
                 weight: float, framing: Framing) -> Gathered:
    """Encode this island's chunk and start the exchange (through torchft's process group).

    An island with weight 0 sends zeros and leaves its codec state (error feedback) alone:
    nothing of it enters the average, so nothing of it counts as sent.
    """
    from torch.distributed.distributed_c10d import AllToAllOptions

    began = time.perf_counter()
    participants = max(manager.num_participants(), 1)
    wire = wire_device(manager, pseudo_gradient.device)
    if two_phase(codec, participants):
        segments = codec.segments(participants)
        pieces = [codec.for_length(end - start) for start, end in segments]
        size = framing.row_bytes(max(piece.payload_bytes() for piece in pieces))
        payloads = _segment_payloads(codec, pieces, segments, pseudo_gradient, weight)
        own_sumsq = _own_sumsq(pieces, payloads) if weight else None
        send = torch.stack([framing.frame(tokens, weight, payload, size, ROUND_SEGMENT, j).to(wire)
                            for j, payload in enumerate(payloads)])
        received = torch.zeros_like(send)
        encode_s = time.perf_counter() - began
        rank = manager.participating_rank()
        if rank is None:  # not in the quorum after all: this round is lost (finish sees the error)
            manager.report_error(RuntimeError("island is not a participant of the exchange's quorum"))
            return Gathered(_Done(), framing, [received], encode_s, segments=segments)
        done_at, started = _completion_stamps(wire), time.perf_counter()
        work = _managed(manager, lambda: manager._pg.alltoall_base(received, send, [], [], AllToAllOptions()),
                        received, done_at)
        return Gathered(work, framing, [received], encode_s, sent=(participants - 1) * size,
                        received=(participants - 1) * size, segments=segments, rank=rank, started=started,
                        done_at=_stamps_list(done_at), own_sumsq=own_sumsq)
    size = framing.row_bytes(codec.payload_bytes())
    row = framing.frame(tokens, weight, _encoded(codec, pseudo_gradient, weight), size).to(wire)
    encode_s = time.perf_counter() - began
    done_at, started = _completion_stamps(wire), time.perf_counter()
    work, outputs = allgather(manager, row, participants, done_at)
    return Gathered(work, framing, outputs, encode_s, sent=row.numel(), received=row.numel() * (participants - 1),
                    started=started, done_at=_stamps_list(done_at))


def _own_sumsq(pieces: list[Codec], payloads: list[torch.Tensor]) -> torch.Tensor:
    """The float64 sum of squares of each segment this island sends, decoded as its summer
    decodes it: what that summer must report of it (`_misreported_segment`). One more
    decode of the island's own chunk and a float64 dot product (about 6x faster on a CPU
    than squaring and summing), kept on its device (no sync until finish)."""
    decoded = (piece.decode(payload).double() for piece, payload in zip(pieces, payloads))  # one at a time
    return torch.stack([torch.dot(values, values) for values in decoded])


def empty_table(participants: int) -> torch.Tensor:
    """The table of an island rank that has no rows (a non-bridge rank, a lost round)."""
    table = torch.zeros(participants, len(COLUMNS), dtype=torch.float64)
    table[:, ISLAND] = -1
    return table


def inspect_gather(gathered: Gathered, codec: Codec, manager: Any, participants: int) -> torch.Tensor:
    """Wait for the rows, open and decode each, and return what each island claims and
    holds (the COLUMNS table, one row per replica rank, over this bridge chunk).

    With the reduce-scatter this island holds one segment of each; the islands then
    all-gather their tables, so each row sums its segments' squares and flags. A claim
    (tokens, weight, island) that differs between segments marks the row malformed. The
    tables as each summer sent them stay in `gathered.reports` (the summed segments'
    check needs the norms per segment).
    """
    gathered.work.wait()
    if manager.errored() is not None or len(gathered.outputs[0]) == 0:
        return empty_table(participants)
    if gathered.segments is None:
        return _inspect_rows(gathered, codec, gathered.outputs, ROUND_ROW, 0)
    piece = codec.for_length(gathered.segments[gathered.rank][1] - gathered.segments[gathered.rank][0])
    mine = _inspect_rows(gathered, piece, list(gathered.outputs[0]), ROUND_SEGMENT, gathered.rank)
    work, tables = allgather(manager, mine.to(gathered.outputs[0].device), len(gathered.segments))
    work.wait()
    if manager.errored() is not None:
        return empty_table(participants)
    gathered.reports = torch.stack([t.cpu() for t in tables])
    return _merge_segment_tables(list(gathered.reports))


def _inspect_rows(gathered: Gathered, codec: Codec, rows: list[torch.Tensor], kind: int,
                  segment: int) -> torch.Tensor:
    table = empty_table(len(rows))
    gathered.payloads = []
    seen: set[int] = set()
    for k, row in enumerate(rows):
        tokens, weight, island, payload, frame = gathered.framing.open(row, codec.payload_bytes(), kind, segment)
        if island >= 0 and island in seen:  # one island's frame in two places: a replay
            frame, payload = FRAME_UNSIGNED, None
        seen.add(island)
        table[k, TOKENS], table[k, WEIGHT], table[k, ISLAND], table[k, FRAME] = tokens, weight, island, frame
        if payload is not None and weight != 0:
            try:
                values = codec.decode(payload)
            except PayloadError:
                table[k, FRAME], payload = FRAME_MALFORMED, None
            else:
                # float64 sums of squares: the same on every island for the same bytes. A device sync.
                table[k, NONFINITE] = float(not bool(torch.isfinite(values).all()))
                table[k, SUMSQ] = float(values.double().square().sum()) if not table[k, NONFINITE] else 0.0
        gathered.payloads.append(payload)
    return table


def _merge_segment_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    merged = tables[0].clone()
    merged[:, FRAME] = torch.stack([t[:, FRAME] for t in tables]).amax(dim=0)
    merged[:, NONFINITE] = torch.stack([t[:, NONFINITE] for t in tables]).amax(dim=0)
    merged[:, SUMSQ] = torch.stack([t[:, SUMSQ] for t in tables]).sum(dim=0)
    claims = torch.stack([t[:, [TOKENS, WEIGHT, ISLAND]] for t in tables])
    differs = ~(claims == claims[0]).all(dim=2).all(dim=0)
    merged[differs, FRAME] = torch.maximum(merged[differs, FRAME], torch.tensor(float(FRAME_MALFORMED)))
    return merged


def finish_gather(gathered: Gathered, codec: Codec, into: torch.Tensor, weights: list[float],
                  tokens: float, manager: Any, trimmed: bool = False) -> float:
    """Write `[sum w_k*g_k ..., tokens, sum w_k]` into `into` with the weights the receivers
    decided (0 for a refused or idle island); with `trimmed`, the first part is the trimmed
    mean (`aggregate`) times sum w_k. Returns the decode seconds (with the reduce-scatter:
    also the second phase's)."""
    began = time.perf_counter()
    if manager.errored() is not None:  # the round will not commit
        into.zero_()
        return time.perf_counter() - began
    if gathered.segments is None:
        into[:-2] = _weighted_sum(gathered.payloads, codec, weights, into.numel() - 2, into.device, trimmed)
    else:
        if gathered.second is None:
            start_sums(gathered, codec, weights, manager, into.device, trimmed)
        _read_second_phase(gathered, codec, into, manager, trimmed)
    into[-2], into[-1] = tokens, sum(weights)
    return time.perf_counter() - began


def _weighted_sum(payloads: list[torch.Tensor | None], codec: Codec, weights: list[float], numel: int,
                  device: torch.device, trimmed: bool = False) -> torch.Tensor:
    """sum_k w_k * decode(payload_k) in fp32 in row (replica) order (`aggregate`). Summed
    where the rows are (host memory under gloo), then moved once to `device`."""
    rows = [(weight, codec.decode(payload)) for payload, weight in zip(payloads, weights)
            if weight and payload is not None]
    if not rows:
        return torch.zeros(numel, dtype=torch.float32, device=device)
    return aggregate([v for _, v in rows], [w for w, _ in rows], trimmed).to(device)


def start_sums(gathered: Gathered, codec: Codec, weights: list[float], manager: Any, device: torch.device,
               trimmed: bool = False) -> None:
    """The reduce-scatter's second phase, started: sum this island's segment of the accepted
    rows (the receivers' `weights`), encode the sum (dense codecs: again with the codec;
    top-k: exactly, `pack_sum`) and start all-gathering the summed segments; `finish_gather`
    waits for them and checks each (`_read_sums`) before it is used. Decoupled rounds start
    it between inner steps, so that it travels while the island trains. The sum's frame
    carries, in its tokens field (unused otherwise), this island's complaint: 1 + the
    segment whose summer misreported what this island sent (`_misreported_segment`), else
    0; so every island refuses the round alike, at no extra byte."""
    segments = gathered.segments
    assert segments is not None, "a two-phase exchange always has segments"
    second = gathered.second = SecondPhase(list(weights))
    if manager.errored() is not None:
        return
    pieces = [codec.for_length(end - start) for start, end in segments]
    mine = pieces[gathered.rank]
    total = _weighted_sum(gathered.payloads, mine, weights, mine.numel, device, trimmed)
    wire = wire_device(manager, device)
    if codec.sparse:
        payload = pack_sum(total)
        bounds = [sum_bytes_bound(piece.numel, piece.sum_nonzeros(len(pieces))) for piece in pieces]  # type: ignore[attr-defined]
        sizes = _sum_sizes(gathered, manager, payload.numel(), [piece.numel for piece in pieces], bounds, wire)
        if sizes is None:
            return
    else:
        payload = mine.encode(total)
        sizes = [piece.payload_bytes() for piece in pieces]
    framing = gathered.framing
    size = framing.row_bytes(max(sizes))
    misreported = _misreported_segment(gathered)
    complaint = 0.0 if misreported is None else float(misreported + 1)
    row = replace(framing, forge=None).frame(complaint, sum(weights), payload, size, ROUND_SUM, gathered.rank)
    stamps, second.started = _completion_stamps(wire), time.perf_counter()
    second.work, second.outputs = allgather(manager, row.to(wire), len(segments), stamps)
    second.pieces, second.sizes, second.failed, second.done_at = pieces, sizes, False, _stamps_list(stamps)
    gathered.sent += size
    gathered.received += size * (len(segments) - 1)


def _read_second_phase(gathered: Gathered, codec: Codec, into: torch.Tensor, manager: Any, trimmed: bool) -> None:
    """Wait for the summed segments and write them, checked, into `into` (zeros when the
    second phase failed: the round will not commit)."""
    second = gathered.second
    assert second is not None, "the second phase was started"
    if not second.failed:
        second.work.wait()
        second.waited = time.perf_counter()
    if second.failed or manager.errored() is not None:
        into.zero_()
        return
    problem = _read_sums(gathered, codec, second.pieces, second.sizes, second.outputs, into, second.weights,
                         trimmed)
    if problem is not None:  # the same bytes and table on every island: every island refuses
        manager.report_error(problem)
        into.zero_()


class SumRefused(ValueError):
    """A summed segment (or a complaint about its summer) that fails the round."""


def _read_sums(gathered: Gathered, codec: Codec, pieces: list[Codec], sizes: list[int],
               outputs: list[torch.Tensor], into: torch.Tensor, weights: list[float],
               trimmed: bool) -> Exception | None:
    """Open, decode and check every summed segment into `into`, in replica order; the
    first problem, or None. Every island decodes the same summed segments: the same
    bytes, the same result, the same verdict."""
    assert gathered.segments is not None
    if gathered.reports is None:  # inspect_gather did not run or failed: nothing to check the sums by
        return SumRefused("the summed segments came without the first phase's table")
    framing = gathered.framing
    for j, (piece, (start, end), out) in enumerate(zip(pieces, gathered.segments, outputs)):
        complaint, _, _, opened, frame = framing.open(out, sizes[j], ROUND_SUM, j)
        if opened is None or frame != FRAME_OK:
            return FrameRefused(f"the sum of segment {j} is not signed by the federation's key")
        if complaint:
            return SumRefused(f"the island at replica rank {j} says the island at replica rank "
                              f"{int(complaint) - 1}, which summed segment {int(complaint) - 1}, misreported "
                              f"the norm of its segment {int(complaint) - 1} in the first phase's table")
        try:
            values = unpack_sum(opened, end - start) if codec.sparse else piece.decode(opened)
        except PayloadError as exc:
            return exc
        why = _check_sum(values, gathered.reports[j], weights, trimmed, None if codec.sparse else piece)
        if why is not None:
            return SumRefused(f"the sum of segment {j} from the island at replica rank {j}: {why}")
        into[start:end] = values.to(into.device)
    return None


# What a summer reports of a segment must match what its sender decoded: the same fp32
# values, their float64 squares summed in another order (another device), which moves the
# sum by at most n 2^-53 of it (1e-6 covers 2^33 values).
REPORT_TOLERANCE = 1e-6


def _misreported_segment(gathered: Gathered) -> int | None:
    """The first segment whose summer reported a sum of squares of this island's segment
    other than the one this island sent (a summer inflating its bound, or framing this
    island for the norm limits); None when all match or this island sent weight 0."""
    if gathered.own_sumsq is None or gathered.reports is None:
        return None
    own = gathered.own_sumsq.cpu().tolist()
    for j, report in enumerate(gathered.reports[:, gathered.rank].tolist()):
        if report[FRAME] != FRAME_OK or report[NONFINITE] or report[WEIGHT] == 0 or not math.isfinite(own[j]):
            continue  # it says it read nothing of it (or nothing finite): the row is refused anyway
        if not abs(report[SUMSQ] - own[j]) <= REPORT_TOLERANCE * own[j]:  # a NaN report fails too
            return j
    return None


def summed_norm_bound(norms: list[float], weights: list[float], trimmed: bool) -> float:
    """The largest norm the exact `aggregate` of rows of these norms can have, with these
    weights (0: left out, as `_weighted_sum` leaves them out; the receivers' weights are
    never negative).

    The weighted sum: sum_i |w_i| ||x_i|| (the triangle inequality). The trimmed mean of
    three or more rows: per coordinate a weighted mean of values that are neither that
    coordinate's largest nor its smallest, so at most its second-largest magnitude m2,
    times W = sum_i w_i. For any one row a, m2 is at most the largest magnitude among the
    other rows (the two largest come from two rows, one of them not a), so summed over
    coordinates m2^2 is at most sum_{i != a} ||x_i||^2; a = the row of the largest norm
    leaves that row out, so a summer that inflates one norm (its own segment's, which no
    other island sees) gains nothing by it. And m2^2 is at most half the sum of the two
    largest squares, so of all of them. Hence
    W sqrt(min(sum_i ||x_i||^2 - max_i ||x_i||^2, sum_i ||x_i||^2 / 2))."""
    live = [(abs(w), n) for w, n in zip(weights, norms) if w]
    if not live:
        return 0.0
    if not trimmed or len(live) < 3:
        return sum(w * n for w, n in live)
    squares = sorted(n * n for _, n in live)
    allowed = min(sum(squares[:-1]), sum(squares) / 2)  # summed without the largest: no cancellation
    return sum(w for w, _ in live) * math.sqrt(allowed)


def _sum_of_squares(values: torch.Tensor) -> float:
    """sum(values^2) in float64 with the same bits on every island: the squares of fp32
    values are exact in float64, and they are added pairwise in a fixed tree of
    elementwise additions (IEEE-rounded alike on every device), where torch's own sum
    picks its order by device, instruction set and threads; a summer could otherwise aim
    its sum at the bound, to be kept by some islands and refused by others. Costs about
    what .sum() does: each level of the tree adds half of what is left, in place."""
    squares = values.detach().double().square().flatten()  # a new buffer: summed in place
    count = squares.numel()
    while count > 1:  # the last `half` values onto the first (an odd one in the middle waits)
        half = count // 2
        squares[:half].add_(squares[count - half:count])
        count -= half
    return float(squares[0]) if count else 0.0


def summing_slack(rows: int) -> float:
    """How far the computed `aggregate` of `rows` rows, and the float64 norms it is
    checked with, may exceed `summed_norm_bound`'s exact bound, as a factor. fp32: each
    product and addition rounds by at most 2^-24 of the running sum of magnitudes, so the
    sum grows by at most (rows + 1) 2^-24; the trimmed mean's second sum (the weights),
    division and product add rows + 3 more (2 rows + 8 covers both). float64 norms of
    fp32 values: at most n 2^-53 off (1e-6 covers 2^33 values)."""
    return 1 + (2 * rows + 8) * 2.0 ** -24 + 1e-6


def _check_sum(values: torch.Tensor, reported: torch.Tensor, weights: list[float], trimmed: bool,
               piece: Codec | None) -> str | None:
    """Why a summed segment's decoded `values` cannot be the sum of the accepted segments
    whose norms its summer reported (`reported`: its first-phase table), or None.

    Finite, and of norm at most summed_norm_bound x summing_slack, grown by the codec's
    second rounding (`piece.norm_bound`; None: top-k's exact sums). A summer can then move
    its segment no further than a contributor of the norms the table holds: every island
    checks what it was reported to have sent (`_misreported_segment`), and the summer's
    own segment counts in its own row's norm, which the receivers judge. Every island
    computes the same verdict (`_sum_of_squares`): torchft's should_commit is a vote
    within an island only, so islands that decided otherwise would step apart. Costs about
    three passes (and two device syncs) over the segment."""
    if not bool(torch.isfinite(values).all()):
        return "values that are not finite"
    sumsq = [float(reported[k, SUMSQ]) for k, w in enumerate(weights) if w]
    if not all(math.isfinite(sq) and sq >= 0 for sq in sumsq):
        return "its first-phase table reports a norm that is not a finite number >= 0"
    norms = [math.sqrt(float(reported[k, SUMSQ])) if w else 0.0 for k, w in enumerate(weights)]
    bound = summed_norm_bound(norms, weights, trimmed) * summing_slack(len(sumsq))
    if piece is not None:
        bound = piece.norm_bound(bound)
    norm = math.sqrt(_sum_of_squares(values))
    if norm > bound:
        return (f"norm {norm:.6g} is above {bound:.6g}, the most the accepted segments' norms allow "
                f"({'trimmed mean' if trimmed else 'weighted sum'})")
    return None


def _sum_sizes(gathered: Gathered, manager: Any, mine: int, lengths: list[int], bounds: list[int],
               wire: torch.device) -> list[int] | None:
    """Every island's exact-sum payload size, all-gathered (8 bytes each), so that the sums
    can cross as rows of one size. A size no sum of its segment can have fails the round
    on every island alike (they all see the same table)."""
    work, outputs = allgather(manager, torch.tensor([mine], dtype=torch.int64, device=wire), len(lengths))
    work.wait()
    gathered.sent += 8
    gathered.received += 8 * (len(lengths) - 1)
    if manager.errored() is not None:
        return None
    sizes = [int(out.cpu()[0]) for out in outputs]
    for j, (got, numel, bound) in enumerate(zip(sizes, lengths, bounds)):
        if not math.ceil(numel / 8) <= got <= bound:
            manager.report_error(PayloadError(f"island at replica rank {j} announced a sum of {got} bytes "
                                              f"for a segment of {numel} values"))
            return None
    return sizes


# Errors the exchange reports on purpose, the same on every island (the same bytes judged
# alike): a verdict on what was received, which a new quorum would only repeat.
REFUSALS = (SumRefused, PayloadError, FrameRefused, ConfigError)


def member_failure(manager: Any) -> bool:
    """The manager saw an error that a new quorum may repair: a collective that failed or
    timed out (a member died, a link broke, a process group could not be built), not a
    refusal of rows (REFUSALS)."""
    error = manager.errored()
    if error is None:
        return False
    return not isinstance(getattr(error, "original_exception", error), REFUSALS)


def settle_exchange(manager: Any, framing: Framing, device: torch.device, exchanges: list[Gathered | None],
                    measured: float = 0.0, overlapped: bool = False,
                    facts: list[tuple[float, float]] | None = None) -> bool:
    """True when the exchange failed on some member: this one saw a member or link fail
    (`member_failure`), or the members' agreement (`agree_on_exchange`) says so or fails.
    A failed exchange's group is closed at once (`abandon_group`, releasing `exchanges`).

    A member that saw its exchange fail says so by closing the group, not by a flag. It
    skipped the exchange's later collectives, and gloo numbers a group's collectives in
    the order each member starts them, so its flag's all-gather would meet a collective
    its peers started before it (the first phase's tables, the sums): gloo aborts the
    process whose receive is smaller than what arrives (`op.preamble.length <= op.nbytes`).
    Closed, the group fails every peer's next collective, the agreement among them
    included, so no member commits a round it lost."""
    failed = member_failure(manager)
    if not failed:
        flags = agree_on_exchange(manager, framing, device, measured, overlapped, facts)
        failed = not exchange_agreed(flags, max(manager.num_participants(), 1))
    if failed:  # members blocked on this island fail now, not at process_group_timeout_ms
        abandon_group(manager, *exchanges)
    return failed


def agree_on_exchange(manager: Any, framing: Framing, device: torch.device, measured: float = 0.0,
                      overlapped: bool = False,
                      facts: list[tuple[float, float]] | None = None) -> list[float | None] | None:
    """Every member's flag, by replica rank: EXCHANGE_COMPLETED where its exchange went
    through, 0 where it says it failed, None where the flag is not signed with the
    federation's key for this round (another key's island, a replay); None instead of a
    list when this collective failed (a member died, or closed the group because its own
    exchange failed: OuterLoop._exchange_failed).

    Decoupled rounds (federation/decoupled.py) add two facts to each flag, at no extra
    byte: `measured` (a non-negative number in the frame's tokens field) and `overlapped`
    (its weight field); with `facts` given, each signed member's pair is appended to it, by
    replica rank ((0, 0) for a flag that is not signed for this round).

    Runs on torchft's process group even after the manager saw an error, unlike the
    exchange's own collectives: a refusal of rows is a verdict every member reached alike,
    so all of them skipped the same collectives and meet here. The collective's error is
    reported to the manager, so that the round does not commit unless it is run again."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    participants = max(manager.num_participants(), 1)
    flag = torch.tensor([1], dtype=torch.uint8)
    size = framing.row_bytes(1)
    claim = float(min(max(round(measured), 0), 2 ** 53))  # an integer either header carries exactly
    row = replace(framing, forge=None).frame(claim, float(overlapped), flag, size, ROUND_AGREE).to(device)
    outputs = [torch.zeros_like(row) for _ in range(participants)]
    try:
        manager._pg.allgather([outputs], [row], AllgatherOptions()).wait()
    except Exception as exc:  # noqa: BLE001 - any transport failure: no agreement, the round is not committed
        if manager.errored() is None:
            manager.report_error(exc)
        return None
    opened = [_flag(framing, out) for out in outputs]
    if facts is not None:
        facts.extend(fact for _, fact in opened)
    return [value for value, _ in opened]


def release_works(gathered: Gathered | None) -> None:
    """Let go of a failed exchange's collectives before `abandon_group` (the rows stay): a
    gloo work still referenced keeps the process group's connections open after the abort,
    and a member blocked on this island in a ring then waits for the process group's
    timeout instead of failing at once (measured: bench/gloo_abort.py)."""
    if gathered is None:
        return
    gathered.work = _Done()
    if gathered.second is not None:
        gathered.second.work = _Done()


def abandon_group(manager: Any, *exchanges: Gathered | None) -> None:
    """Close torchft's process group of a failed exchange now, not when the next quorum
    forms: a member still blocked in a collective with this island then fails at once.
    (gloo's all-gather passes rows around a ring, so a member two places from a dead one
    waits on a live neighbour that gave up; torchft aborts the group only once the new
    quorum forms, and the lighthouse waits for that member to ask for it.) The next quorum
    builds a new group; a retry's quorum always has a new id (quorum.Quorum.start). The
    `exchanges` on that group let go of their collectives first (`release_works`), or the
    abort would leave the group's connections open."""
    for gathered in exchanges:
        release_works(gathered)
    try:
        manager._pg.abort()
    except Exception:  # noqa: BLE001 - already aborted, or a transport without abort: torchft's configure does it
        pass


def _flag(framing: Framing, row: torch.Tensor) -> tuple[float | None, tuple[float, float]]:
    tokens, weight, _, payload, frame = framing.open(row, 1, ROUND_AGREE)
    if frame != FRAME_OK or payload is None or payload.numel() != 1:
        return None, (0.0, 0.0)
    facts = (tokens if math.isfinite(tokens) and tokens > 0 else 0.0, float(weight == 1.0))
    return (EXCHANGE_COMPLETED if int(payload[0]) == 1 else 0.0), facts
