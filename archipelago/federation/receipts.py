"""Receipts: before anything is summed, the members confirm what each of them received.

Every island judges every row it receives, and all islands reach the same verdicts because
they judge the same bytes. A member could break that last premise: on the wire every
receiver gets its own copy of a member's row, so a member can send different, validly
signed rows to different peers (equivocation), and in the two-phase exchange the member
that sums segment j is the only one that sees everyone's segment j, so it could say in
its table that an honest island's segment was unsigned or not finite (censorship), and
have that island's row refused everywhere. So with a federation key each member signs
what it sends with a key of its own (Ed25519; its public half is in its member token, so
the quorum gives every member everyone's: trust.member_id), and the members exchange
receipts: for every sender, the signed header (which holds the SHA-256 of the payload) of
what arrived, or nothing.

* All-gather (every row to every island): one more all-gather, of receipts of
  183 bytes per member (`confirm_rows`). A sender two of whose headers differ for one
  place (two valid signatures on different rows) equivocated and is refused on every
  island. A row that some member holds no valid copy of is refused too (not every island
  could add it), and so is that member's own row: it claims the row was missing or
  broken, which it cannot show, while the sender's signature shows what it sent to the
  others. Every island decides from the same receipts, so alike.
* Reduce-scatter (segments to their summers): the first phase's tables, which the
  members all-gather anyway, become signed frames that carry, besides the summer's
  table of its segment, the evidence of every segment it received and, from each member,
  its own statement of what it sent: each of its segments' signed header and their sums
  of squares (`table_frame`, `judge_tables`). A summer that says a segment was missing,
  unsigned or other than its sender's own statement shows, is refused, not the sender:
  its sum is not used (that segment of the outer step is zero everywhere) and its own row
  is left out. A sender whose segment the summer shows with another valid signature than
  its own statement's equivocated and is refused. A sender whose statement contradicts
  the reports of two summers or more is the one that lies (one liar cannot be two of
  them), and is refused instead.
* The summed segments go to every member: their evidence rides in the agreement's flags
  that already follow the exchange (agreement.py), with that of every receipt and table
  each member got (`Shown`), and a sum, receipt or table that reached members two ways
  fails the round on every island, its sender named in the log.

What it costs: one signature (about 50 us) per frame sent, one check (about 100 us) per
distinct frame header shown, the receipts' all-gather (one round trip and 183 bytes per
member and sender) in the all-gather exchange, 366 + 8 bytes per member and sender in the
tables of the reduce-scatter, and 167 bytes per frame shown in the agreement. What it
cannot do: a member can still send its agreement flag two ways (some members then lose a
round the others commit, and heal at the next quorum), and its rows of moments are not
covered; the members also compare the state each of them committed, every round (their
state claims), and an island whose state differs from the majority's is named in every
member's log (docs/federation.md, "Security").
"""

from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass, field

import torch

from archipelago.federation.trust import HEADER_BYTES, HEADER_FORMAT, SIGNATURE_BYTES

log = logging.getLogger("archipelago.federation")

EVIDENCE_BYTES = 1 + HEADER_BYTES + SIGNATURE_BYTES  # present flag | signed header | signature
NO_EVIDENCE = bytes(EVIDENCE_BYTES)
ROUND_RECEIPT = 20  # frame kind: a member's receipts for the rows of an all-gather exchange
ROUND_TABLE = 21    # frame kind: a summer's first-phase table, its receipts and its own statement

_HEADER = HEADER_FORMAT  # the signed header's fields: magic, federation, quorum, step, fragment, island, kind, ...


@dataclass
class Shown:
    """What this member holds of frames every member received from every other: for each
    sender, the evidence of its frame of `kind` (for `segment`; None: the sender's own
    replica rank), NO_EVIDENCE where none arrived intact. Shown again in the agreement's
    flags (agreement.py), so a frame that reached members two ways fails the round;
    `skip`: senders not judged (summers already refused)."""

    kind: int
    segment: int | None
    evidence: list[bytes]
    skip: set[int] = field(default_factory=set)


@dataclass
class Refusals:
    """What the receipts show, by replica rank: why a member's row is refused, and which
    summers' sums are not used (the reduce-scatter only)."""

    rows: dict[int, str] = field(default_factory=dict)
    summers: dict[int, str] = field(default_factory=dict)

    def refuse(self, rank: int, reason: str) -> None:
        self.rows.setdefault(rank, reason)


def shown_header(framing, evidence: bytes, sender: int, kind: int, segment: int) -> bytes | None:  # noqa: ANN001
    """The header `evidence` shows, if it is a frame of `sender` (its signature, its island)
    for this round, fragment, `kind` and `segment`; None for no evidence or evidence that
    proves nothing (another place, another signer)."""
    if len(evidence) != EVIDENCE_BYTES or evidence[0] != 1:
        return None
    header, signature = evidence[1:1 + HEADER_BYTES], evidence[1 + HEADER_BYTES:]
    try:
        magic, fed, quorum, step, fragment, island, got_kind, *_ = _HEADER.unpack(header)
    except struct.error:
        return None
    where = framing._where(kind, segment, 0)
    if (magic, fed, quorum, step, fragment, got_kind) != (b"ARF1", framing.key.federation_id, where.quorum,
                                                          where.step, where.fragment, kind):
        return None
    return header if framing.signed_by_member(header, signature, sender, island) else None


class _Shown:
    """`shown_header` with each distinct piece of evidence checked once: honest members
    show the same header for an honest sender, so a round checks about one signature per
    sender, not one per member and sender."""

    def __init__(self, framing) -> None:  # noqa: ANN001
        self.framing = framing
        self.seen: dict[tuple[bytes, int, int, int], bytes | None] = {}

    def __call__(self, evidence: bytes, sender: int, kind: int, segment: int) -> bytes | None:
        slot = (evidence, sender, kind, segment)
        if slot not in self.seen:
            self.seen[slot] = shown_header(self.framing, evidence, sender, kind, segment)
        return self.seen[slot]


def split_evidence(payload: bytes, count: int) -> list[bytes]:
    """`count` pieces of evidence from a receipt's payload."""
    return [payload[k * EVIDENCE_BYTES:(k + 1) * EVIDENCE_BYTES] for k in range(count)]


# ---- the all-gather exchange ------------------------------------------------------

_FRAMES = {3: "row", 5: "summed segment", ROUND_RECEIPT: "receipt", ROUND_TABLE: "first-phase table"}  # by kind


def judge_receipts(framing, receipts: list[list[bytes] | None], kind: int,  # noqa: ANN001
                   segment: int | None = 0, skip: set[int] | None = None) -> Refusals:
    """The verdicts the members' `receipts` (by replica rank: each the evidence of every
    sender's row, None for a receipt that is not signed by its member) give; the same on
    every island that holds the same receipts. A member's word on its own row is no
    evidence (it could show a second version to some only). `segment` None: each sender's
    frame is for the segment of its own replica rank (the summed segments); the senders in
    `skip` are not judged (summers already refused: nobody reads their sums)."""
    shown, refusals = _Shown(framing), Refusals()
    what = _FRAMES.get(kind, "frame")
    for rank, receipt in enumerate(receipts):
        if receipt is None:
            refusals.refuse(rank, "its receipt for this exchange is not signed by it (members confirm what they "
                                  "received before anything is summed)")
    for sender in range(len(receipts)):
        if skip and sender in skip:
            continue
        headers, missing = set(), []
        for rank, receipt in enumerate(receipts):
            if rank == sender or receipt is None:
                continue
            header = shown(receipt[sender], sender, kind, sender if segment is None else segment)
            if header is None:
                missing.append(rank)
            else:
                headers.add(header)
        if len(headers) > 1:
            refusals.refuse(sender, f"it sent different signed versions of its {what} to different members "
                                    f"(equivocation: {len(headers)} versions, shown by the members' receipts)")
        elif missing:
            refusals.refuse(sender, f"the member(s) at replica rank {missing} hold no valid copy of its {what}, "
                                    "so not every island could take it")
            for rank in missing:
                refusals.refuse(rank, f"it says the {what} of the member at replica rank {sender} did not arrive "
                                      "intact, which the other members' receipts contradict (a claim without "
                                      "evidence)")
    return refusals


# ---- the reduce-scatter's tables ------------------------------------------------------


@dataclass
class Statement:
    """One member's table frame, opened (`read_table`): its summer's table of its segment
    ([members, COLUMNS]), the evidence of the segment it received from each member, and its
    own word on what it sent: each segment's evidence and float64 sum of squares (NaN:
    none, or it sent weight 0)."""

    table: torch.Tensor
    received: list[bytes]
    sent: list[bytes]
    sent_sumsq: list[float]


def table_payload(table: torch.Tensor, received: list[bytes], sent: list[bytes], sent_sumsq: list[float]) -> bytes:
    """A summer's table frame's payload (`Statement`'s parts, in that order)."""
    count = table.shape[0]
    assert len(received) == len(sent) == len(sent_sumsq) == count
    return (table.to(torch.float64).contiguous().numpy().tobytes() + b"".join(received) + b"".join(sent)
            + struct.pack(f"<{count}d", *sent_sumsq))


def table_payload_bytes(count: int, columns: int) -> int:
    return count * (8 * columns + 2 * EVIDENCE_BYTES + 8)


def read_table(payload: bytes, count: int, columns: int) -> Statement | None:
    """A table frame's `Statement`, None when the payload is not one."""
    if len(payload) != table_payload_bytes(count, columns):
        return None
    cut = 8 * columns * count
    table = torch.frombuffer(bytearray(payload[:cut]), dtype=torch.float64).view(count, columns).clone()
    received = split_evidence(payload[cut:cut + count * EVIDENCE_BYTES], count)
    sent = split_evidence(payload[cut + count * EVIDENCE_BYTES:cut + 2 * count * EVIDENCE_BYTES], count)
    sent_sumsq = list(struct.unpack(f"<{count}d", payload[cut + 2 * count * EVIDENCE_BYTES:]))
    return Statement(table, received, sent, sent_sumsq)


# A summer's report of a sum of squares and its sender's own: the same fp32 values, their
# float64 squares added in another order (sums.REPORT_TOLERANCE).
REPORT_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Columns:
    """Where the table (exchange.COLUMNS) keeps what `judge_tables` compares."""

    tokens: int
    weight: int
    frame: int
    nonfinite: int
    sumsq: int
    island: int


def claims(header: bytes) -> tuple[float, float, int]:
    """(tokens, weight, island) a signed header claims."""
    fields = _HEADER.unpack(header)
    return float(fields[7]), float(fields[8]), int(fields[5])


def stated_report(header: bytes, sumsq: float, cols: Columns, width: int) -> torch.Tensor:
    """The table row an honest summer reports of a segment with this signed `header` whose
    sender says its sum of squares is `sumsq` (NaN: weight 0, nothing decoded)."""
    tokens, weight, island = claims(header)
    row = torch.zeros(width, dtype=torch.float64)
    row[cols.tokens], row[cols.weight], row[cols.island] = tokens, weight, island
    if weight != 0:
        finite = math.isfinite(sumsq)
        row[cols.nonfinite], row[cols.sumsq] = float(not finite), sumsq if finite else 0.0
    return row


def _contradicts(report: torch.Tensor, truth: torch.Tensor, cols: Columns) -> bool:
    """Whether a summer's report of a segment is not what its sender's statement says."""
    exact = (cols.tokens, cols.weight, cols.island, cols.frame, cols.nonfinite)
    if any(float(report[c]) != float(truth[c]) for c in exact):
        return True
    own, got = float(truth[cols.sumsq]), float(report[cols.sumsq])
    return not abs(got - own) <= REPORT_TOLERANCE * own if own else got != 0


def judge_tables(framing, statements: list[Statement | None], kind: int, cols: Columns) -> Refusals:  # noqa: ANN001
    """The verdicts the members' table frames give (by replica rank = summer = segment).
    See the module doc."""
    shown, refusals = _Shown(framing), Refusals()
    for rank, statement in enumerate(statements):
        if statement is None:
            refusals.refuse(rank, "its first-phase table is not signed by it")
            refusals.summers[rank] = "its first-phase table is not signed by it"
    disputes: dict[int, list[int]] = {}
    for summer, by_summer in enumerate(statements):
        for sender, own in enumerate(statements):
            if sender == summer or own is None or by_summer is None:
                continue
            stated = shown(own.sent[summer], sender, kind, summer)
            received = shown(by_summer.received[sender], sender, kind, summer)
            if stated is None:
                refusals.refuse(sender, f"its own statement shows no signed segment {summer}, the one its summer "
                                        "needs")
            elif received is None:
                _censor(refusals, summer, sender, "says it received no intact segment from the member at replica "
                                                  f"rank {sender}, whose signed statement shows one")
            elif received != stated:
                refusals.refuse(sender, f"it signed two different versions of its segment {summer} (equivocation: "
                                        "its statement and its summer's receipt)")
            elif _contradicts(by_summer.table[sender], stated_report(stated, own.sent_sumsq[summer], cols,
                                                                      by_summer.table.shape[1]), cols):
                disputes.setdefault(sender, []).append(summer)
    for sender, summers in disputes.items():
        if len(summers) >= 2:
            refusals.refuse(sender, f"its statement of its segments contradicts {len(summers)} summers' reports "
                                    f"(replica ranks {summers}): one liar cannot be all of them")
        else:
            _censor(refusals, summers[0], sender, f"reported the segment of the member at replica rank {sender} "
                                                  "other than its sender's signed statement (its claims, a flag, "
                                                  "finiteness or its norm)")
    return refusals


def corrected_reports(reports: torch.Tensor, statements: list[Statement | None], refusals: Refusals,
                      cols: Columns) -> torch.Tensor:
    """The summers' tables ([summer, sender, COLUMNS]) with a refused summer's reports of the
    other members' segments replaced by what those members signed they sent: a summer that
    is not believed must not take their norms or flags with it."""
    fixed = reports.clone()
    for summer in refusals.summers:
        for sender, own in enumerate(statements):
            if sender == summer or own is None or own.sent[summer][0] != 1:
                continue
            fixed[summer, sender] = stated_report(own.sent[summer][1:1 + HEADER_BYTES], own.sent_sumsq[summer],
                                                  cols, reports.shape[2])
    return fixed


def _censor(refusals: Refusals, summer: int, sender: int, what: str) -> None:
    reason = f"as the summer of segment {summer} it {what}: the summer is refused, not the sender"
    refusals.refuse(summer, reason)
    refusals.summers.setdefault(summer, reason)


def log_refusals(refusals: Refusals, islands: tuple[int, ...], step: int) -> None:
    """One warning per refusal the receipts gave, naming the island."""
    def name(rank: int) -> str:
        island = islands[rank] if rank < len(islands) else -1
        return f"island {island}" if island >= 0 else f"the member at replica rank {rank}"

    for rank, reason in sorted(refusals.rows.items()):
        log.warning("receipts of outer step %d: refused %s: %s", step + 1, name(rank), reason)
    for rank in sorted(refusals.summers):
        log.warning("receipts of outer step %d: the sum of segment %d (by %s) is not used: that segment of the "
                    "outer step is zero on every island", step + 1, rank, name(rank))
