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
  reported to be): `sums.check_sum`. Top-k's segments are whole chunks of its own, cut
  from one selection over the whole chunk (so its error feedback is unchanged), and its
  sums are not rounded again: island j all-gathers its sum exactly, as a bitmap of the
  nonzero values and those values in fp32 (codecs.pack_sum), after the islands have
  all-gathered the sums' sizes. Each island decodes and receives then about one payload
  plus one summed chunk (at most ~4.1 bytes per value) whatever the number of islands,
  instead of G - 1 payloads, and ends with the all-gather's result bit for bit.

The exchange runs in three calls, so that the outer loop can combine what the island's
bridge ranks found between them: `start_gather` and `inspect_gather` here (a table of what
each row claims and holds), then `sums.finish_gather` (the sum with the weights the
receivers decided; the reduce-scatter's second phase). Then `agreement.settle_exchange`
decides with every member whether the exchange went through everywhere: torchft's commit
vote is a vote inside one island, so without it one island could commit a round whose
exchange failed on another (docs/rounds.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from archipelago.federation.codecs import Codec, PayloadError, sum_bytes_bound
from archipelago.federation.policy import FRAME_MALFORMED, FRAME_OK, FRAME_UNSIGNED
from archipelago.federation.receipts import Shown
from archipelago.federation.trust import (
    HEADER_BYTES as SIGNED_HEADER_BYTES,
)
from archipelago.federation.trust import (
    SIGNATURE_BYTES,
    TAG_BYTES,
    FederationKey,
    FrameHeader,
    FrameRefused,
    claimed_island,
    open_frame,
    seal,
    sign,
    signed_by,
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

    With a key every frame also carries, after its tag, the sending member's signature
    (Ed25519, `signer`) over its header, which holds the SHA-256 of its payload: the tag
    keeps outsiders out, but every member could make it; the signature only its sender can
    (trust.member_id). `members` and `islands` are the quorum's public signing keys and
    island ids by replica rank (from the member tokens the lighthouse handed every member
    alike): a row from replica rank k must carry member k's signature and island id. A
    signed header is what a member shows as evidence of what another sent it
    (`evidence`, federation/receipts.py).
    """

    key: FederationKey | None = None
    quorum: int = 0
    step: int = 0
    fragment: int = 0
    island: int = 0
    forge: str | None = None  # "forge_tokens", "forge_weight", "unsigned", ... (demo only: guard.Poison)
    signer: Any = None        # this member's Ed25519 private key (trust.member_signer)
    members: tuple[bytes | None, ...] = ()  # the quorum's public signing keys, by replica rank
    islands: tuple[int, ...] = ()           # ... and island ids

    @property
    def header_bytes(self) -> int:
        return PLAIN_HEADER_BYTES if self.key is None else SIGNED_HEADER_BYTES

    @property
    def trailer_bytes(self) -> int:
        return 0 if self.key is None else TAG_BYTES + SIGNATURE_BYTES

    @property
    def checks_signers(self) -> bool:
        """Whether rows must carry their sender's signature: a key, and every member's public
        signing key known (a quorum with an id that carries none has an outsider in it, and
        its rounds commit nothing anyway: membership.MembersOnly)."""
        return self.key is not None and bool(self.members) and all(m is not None for m in self.members)

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
        signature = (sign(self.signer, sealed[:SIGNED_HEADER_BYTES])
                     if self.signer is not None and self.forge != "unsigned" else bytes(SIGNATURE_BYTES))
        out = torch.zeros(size, dtype=torch.uint8)
        out[:len(sealed)] = torch.frombuffer(bytearray(sealed), dtype=torch.uint8)
        out[len(sealed):len(sealed) + SIGNATURE_BYTES] = torch.frombuffer(bytearray(signature), dtype=torch.uint8)
        return out

    def _claims(self, tokens: float, weight: float) -> tuple[float, float]:
        if self.forge == "forge_tokens":
            return 1e15, weight
        if self.forge == "forge_weight":
            return tokens, -1e6
        return tokens, weight

    def open(self, row: torch.Tensor, payload_bytes: int, kind: int = ROUND_ROW, segment: int = 0,
             sender: int = -1) -> tuple[float, float, int, torch.Tensor | None, int]:
        """(tokens, weight, island, payload, FRAME_*) of a received row; payload None when
        refused. `sender`: the replica rank it came from, whose signature it must carry
        (`checks_signers`; -1: not checked)."""
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
        signature = row[size:size + SIGNATURE_BYTES].cpu().numpy().tobytes()
        if sender >= 0 and self.checks_signers and not self.signed_by_member(raw[:SIGNED_HEADER_BYTES],
                                                                              signature, sender, got.island):
            return 0.0, 0.0, got.island, None, FRAME_UNSIGNED
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
        return float(got.tokens), float(got.weight), got.island, body.to(row.device), FRAME_OK

    def signed_by_member(self, header: bytes, signature: bytes, sender: int, island: int) -> bool:
        """Whether `header` (of a frame claiming `island`) carries the signature of the member
        at replica rank `sender`, whose token names that island."""
        if not 0 <= sender < len(self.members) or self.members[sender] is None:
            return False
        if sender < len(self.islands) and self.islands[sender] != island:
            return False
        return signed_by(self.members[sender], header, signature)  # type: ignore[arg-type]

    def evidence(self, row: torch.Tensor, payload_bytes: int) -> bytes:
        """What a member shows of a signed row it received (or sent): its header and its
        sender's signature (receipts.EVIDENCE_BYTES with the leading 1: present)."""
        size = SIGNED_HEADER_BYTES + payload_bytes + TAG_BYTES  # two small slices, not a copy of the row
        header = row[:SIGNED_HEADER_BYTES].cpu().numpy().tobytes()
        return b"\x01" + header + row[size:size + SIGNATURE_BYTES].cpu().numpy().tobytes()


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
    stamped: bool = False  # the transport stamps `done_at` (gloo); else it stays empty (NCCL)
    second: SecondPhase | None = None  # reduce-scatter: the summed segments' all-gather, once started
    # With signing members (Framing.checks_signers): the evidence of the segments this
    # island sent (receipts.py), and the summers whose sums the receipts refused.
    sent_evidence: list[bytes] = field(default_factory=list)
    refused_summers: set[int] = field(default_factory=set)
    shown: list[Shown] = field(default_factory=list)  # ... the frames every member got, shown in the agreement


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
    stamped: bool = False  # the transport stamps `done_at`
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


class SkippedWork:
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


HANDED = "_archipelago_handed"  # the manager's list of tensors handed to the transport (hand_over)


def hand_over(manager: Any, *tensors: torch.Tensor) -> None:
    """Note `tensors` (a collective's inputs and outputs) as handed to the cross-island
    transport. A collective that failed on one pair (a dead member's) may go on reading
    and writing them on gloo's transport thread for the live pairs until the group is
    aborted, after the work itself has finished with its error and been let go
    (agreement.release_works); a tensor freed under it aborts the process (`writev ...
    Bad address`, a terminate on gloo's thread). So every tensor handed over stays
    referenced here until the island's exchange attempts take the list (`take_handed`):
    kept with a failed attempt, dropped once an exchange went through everywhere."""
    handed = getattr(manager, HANDED, None)
    if handed is None:
        handed = []
        setattr(manager, HANDED, handed)
    handed.extend(tensors)


def take_handed(manager: Any) -> list[torch.Tensor]:
    """The tensors handed to the transport since the last call (`hand_over`); the next
    ones go to a new list."""
    if manager is None:  # a rank that is not a bridge: it hands nothing over
        return []
    handed = getattr(manager, HANDED, None) or []
    setattr(manager, HANDED, [])
    return handed


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a collective's outputs: one, or a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def start_managed(manager: Any, start: Any, outputs: Any, done_at: list[float] | None = None,
                  inputs: tuple[torch.Tensor, ...] = ()) -> Any:
    """Start a collective on torchft's process group with Manager.allreduce's error
    handling (_ManagedWork): a failure is reported to the manager, so the round will not
    commit, instead of raising here. With `done_at`, the collective's completion time
    (perf_counter) is appended to it by the transport's thread (codec = "auto" measures the
    link with it, also while inner steps overlap the exchange). Its `inputs` and `outputs`
    are handed over (`hand_over`): they outlive a failure of the collective."""
    if manager.errored() is not None:  # the round is lost already; do not touch the network
        return SkippedWork()
    from torchft.manager import _ManagedWork

    hand_over(manager, *inputs, *_tensors(outputs))
    try:
        work = start()
        if done_at is not None:
            stamp_completion(work, done_at)
        return _ManagedWork(manager, work, outputs)
    except Exception as exc:  # noqa: BLE001 - any transport failure only loses this round
        manager.report_error(exc)
        return SkippedWork()


class Stamps(list):
    """The completion times the transport's thread appends (perf_counter); `live` turns
    False where the work has no future, so nothing will ever be appended."""

    live = True


def stamp_completion(work: Any, done_at: list[float]) -> bool:
    """Append the time `work` completes to `done_at`; False (nothing will be stamped, and
    a `Stamps` says so from then on) where the transport's work has no future: the caller
    then takes the time its wait returned. Never raises: a timing aid must not cost the round."""
    try:
        work.get_future().add_done_callback(lambda _: done_at.append(time.perf_counter()))
        return True
    except Exception:  # noqa: BLE001 - any transport without usable futures: no stamp
        if isinstance(done_at, Stamps):
            done_at.live = False
        return False


def completion_stamps(wire: torch.device) -> Stamps | None:
    """Where the exchange's completion time goes: gloo's work completes (on its own thread)
    when the rows are in; NCCL's future completes when the collective is enqueued (torch's
    `Work.get_future`), which says nothing about the link, so a GPU wire stamps nothing and
    the wait's return counts instead."""
    return Stamps() if wire.type == "cpu" else None


def stamping(done_at: Stamps | None) -> bool:
    """Will the transport's thread stamp `done_at` (from `completion_stamps`, after the
    work started)? The one answer for every phase's `stamped` (give_up.wait_for polls only then)."""
    return done_at is not None and done_at.live


def stamps_list(done_at: list[float] | None) -> list[float]:
    """The list the transport's thread appends to (itself, even while empty: `done_at or []`
    would hand the exchange a new list the thread never sees), or a new one where nothing
    stamps."""
    return done_at if done_at is not None else []


def allgather(manager: Any, payload: torch.Tensor, count: int,
              done_at: list[float] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """Every member's `payload` (all of one size), one tensor per member by group rank,
    through torchft's process group with its error handling (`start_managed`)."""
    start, outputs, handed = gather_start(manager, payload, count)
    return start_managed(manager, start, outputs, done_at, inputs=handed), outputs


def gather_start(manager: Any, payload: torch.Tensor,
                 count: int) -> tuple[Callable[[], Any], list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """How `count` members all-gather `payload` on the island's cross-island group: the
    collective's start, the rows it fills (by group rank) and every buffer it sends from or
    receives into (to hand over: `hand_over`).

    On gloo an all-to-all of buffers of our own, not gloo's all-gather: that one gathers
    into a flat temporary of its own and passes rows on around a ring from it, so when a
    member dies mid-ring the temporary is freed as the failure unwinds while gloo's
    transport thread may still be writing from it to a live neighbour; the survivor then
    aborts (`writev ... Bad address`, a terminate on gloo's thread), and no hand-over can
    keep that buffer alive. The all-to-all sends only from `send` (this member's row, once
    per peer) and receives only into `received`, both handed over. The bytes are the
    ring's ((count - 1) rows each way a member) and the memory less (no temporary of
    count rows; `send` is the row itself between two islands). NCCL keeps its all-gather:
    its buffers come from the caching allocator and are ordered on the stream."""
    from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

    rank = _gloo_rank(manager)
    if rank is None or count < 2:
        outputs = [torch.zeros_like(payload) for _ in range(count)]
        return (lambda: manager._pg.allgather([outputs], [payload], AllgatherOptions())), outputs, (payload,)
    send = payload.reshape(1, -1).expand(count - 1, -1).contiguous()  # a view when count is 2
    received = torch.zeros_like(send)
    splits = [0 if member == rank else 1 for member in range(count)]  # no row to or from itself
    rows = [row.view_as(payload) for row in received.unbind(0)]
    outputs = [*rows[:rank], payload.clone(), *rows[rank:]]
    start = lambda: manager._pg.alltoall_base(received, send, splits, splits, AllToAllOptions())  # noqa: E731
    return start, outputs, (payload, send, received)


def _gloo_rank(manager: Any) -> int | None:
    """This member's rank in torchft's gloo group; None for any other process group (NCCL,
    a test's stand-in) or one not configured, which keep the plain all-gather."""
    if type(manager._pg).__name__ != "ProcessGroupGloo":
        return None
    try:
        return int(manager._pg.parent.rank())
    except Exception:  # noqa: BLE001 - not configured: the all-gather reports the failure
        return None


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
            return Gathered(SkippedWork(), framing, [received], encode_s, segments=segments)
        done_at, started = completion_stamps(wire), time.perf_counter()
        work = start_managed(manager, lambda: manager._pg.alltoall_base(received, send, [], [], AllToAllOptions()),
                             received, done_at, inputs=(send,))
        sent_evidence = ([framing.evidence(row, piece.payload_bytes()) for row, piece in zip(send, pieces)]
                         if framing.checks_signers else [])
        return Gathered(work, framing, [received], encode_s, sent=(participants - 1) * size,
                        received=(participants - 1) * size, segments=segments, rank=rank, started=started,
                        done_at=stamps_list(done_at), stamped=stamping(done_at), own_sumsq=own_sumsq,
                        sent_evidence=sent_evidence)
    size = framing.row_bytes(codec.payload_bytes())
    row = framing.frame(tokens, weight, _encoded(codec, pseudo_gradient, weight), size).to(wire)
    encode_s = time.perf_counter() - began
    done_at, started = completion_stamps(wire), time.perf_counter()
    if framing.forge == "equivocate" and participants >= 2:  # the drill of a dishonest member (guard.Poison)
        work, outputs = _equivocate(manager, codec, pseudo_gradient, tokens, weight, framing, size, row, done_at)
    else:
        work, outputs = allgather(manager, row, participants, done_at)
    return Gathered(work, framing, outputs, encode_s, sent=row.numel(), received=row.numel() * (participants - 1),
                    started=started, done_at=stamps_list(done_at), stamped=stamping(done_at))


def _equivocate(manager: Any, codec: Codec, x: torch.Tensor, tokens: int, weight: float, framing: Framing,
                size: int, row: torch.Tensor, done_at: list[float] | None) -> tuple[Any, list[torch.Tensor]]:
    """The `equivocate` drill: each peer gets its own validly signed row (the pseudo-gradient
    scaled by 1 + rank / 4), as a dishonest member's own process could send them. Only the
    tcp group can send different rows to different peers (CheckedTCPGroup.allgather_each)."""
    participants = max(manager.num_participants(), 1)
    rank = manager.participating_rank() or 0
    rows = {k: framing.frame(tokens, weight, _encoded(codec, x * (1 + k / 4), weight), size)
            for k in range(participants) if k != rank}
    outputs = [torch.zeros_like(row) for _ in range(participants)]
    start = lambda: manager._pg.allgather_each(outputs, row, rows)  # noqa: E731
    return start_managed(manager, start, outputs, done_at, inputs=(row, *rows.values())), outputs


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


class Confirmation(Protocol):
    """How members confirm what they received (federation/confirm.py), handed in by the
    caller so that this module imports nothing above it."""

    def rows(self, gathered: Gathered, codec: Codec, manager: Any, table: torch.Tensor) -> None: ...

    def tables(self, gathered: Gathered, piece: Codec, manager: Any, mine: torch.Tensor) -> torch.Tensor: ...


def inspect_gather(gathered: Gathered, codec: Codec, manager: Any, participants: int,
                   confirm: Confirmation | None = None) -> torch.Tensor:
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
        table = _inspect_rows(gathered, codec, gathered.outputs, ROUND_ROW, 0)
        if confirm is not None and gathered.framing.checks_signers:  # the members confirm what they received
            confirm.rows(gathered, codec, manager, table)
        return table
    piece = codec.for_length(gathered.segments[gathered.rank][1] - gathered.segments[gathered.rank][0])
    mine = _inspect_rows(gathered, piece, list(gathered.outputs[0]), ROUND_SEGMENT, gathered.rank)
    if confirm is not None and gathered.framing.checks_signers:  # signed tables with receipts, statements
        return confirm.tables(gathered, piece, manager, mine)
    work, tables = allgather(manager, mine.to(gathered.outputs[0].device), len(gathered.segments))
    work.wait()
    if manager.errored() is not None:
        return empty_table(participants)
    gathered.reports = torch.stack([t.cpu() for t in tables])
    return merge_segment_tables(list(gathered.reports))


def _inspect_rows(gathered: Gathered, codec: Codec, rows: list[torch.Tensor], kind: int,
                  segment: int) -> torch.Tensor:
    table = empty_table(len(rows))
    gathered.payloads = []
    seen: set[int] = set()
    censor = gathered.framing.forge == "censor" and kind == ROUND_SEGMENT  # a dishonest summer's drill
    for k, row in enumerate(rows):
        tokens, weight, island, payload, frame = gathered.framing.open(row, codec.payload_bytes(), kind, segment,
                                                                       sender=k)
        if censor and k != gathered.rank:
            frame, payload = FRAME_UNSIGNED, None
        if island >= 0 and island in seen:  # one island's frame in two places: a replay
            frame, payload = FRAME_UNSIGNED, None
        seen.add(island)
        gathered.payloads.append(fill_row(table, k, (tokens, weight, island, payload, frame), codec))
    return table


def fill_row(table: torch.Tensor, k: int, opened: tuple[float, float, int, torch.Tensor | None, int],
             codec: Codec) -> torch.Tensor | None:
    """Row k of a COLUMNS table from an opened frame (tokens, weight, island, payload,
    FRAME_*): its claims, and, decoded, whether its values are finite and their sum of
    squares. Returns the payload, None when refused or undecodable."""
    tokens, weight, island, payload, frame = opened
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
    return payload


def merge_segment_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    """One table over every island's whole row from its segments' tables: a frame refused or a
    value not finite anywhere marks the row, the sums of squares add up, and claims that
    differ between segments mark it malformed."""
    merged = tables[0].clone()
    merged[:, FRAME] = torch.stack([t[:, FRAME] for t in tables]).amax(dim=0)
    merged[:, NONFINITE] = torch.stack([t[:, NONFINITE] for t in tables]).amax(dim=0)
    merged[:, SUMSQ] = torch.stack([t[:, SUMSQ] for t in tables]).sum(dim=0)
    claims = torch.stack([t[:, [TOKENS, WEIGHT, ISLAND]] for t in tables])
    differs = ~(claims == claims[0]).all(dim=2).all(dim=0)
    merged[differs, FRAME] = torch.maximum(merged[differs, FRAME], torch.tensor(float(FRAME_MALFORMED)))
    return merged
