"""The receipts' collectives: what a member received, confirmed with every other member
before anything is summed (the rules are receipts.py's; this moves their frames).

`inspect_gather` is exchange.inspect_gather with them: `confirm_rows` runs after an
all-gather exchange's rows arrived and `confirm_tables` replaces the reduce-scatter's table
all-gather; both leave the receipts' verdicts in the
exchange's table (FRAME_DISPUTED: the row is refused on every island alike) and, for the
reduce-scatter, the summers whose sums are not used in `Gathered.refused_summers`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from archipelago.federation import receipts
from archipelago.federation.codecs import Codec
from archipelago.federation.exchange import (
    COLUMNS,
    FRAME,
    ISLAND,
    NONFINITE,
    ROUND_ROW,
    ROUND_SEGMENT,
    SUMSQ,
    TOKENS,
    WEIGHT,
    Gathered,
    allgather,
    empty_table,
    merge_segment_tables,
)
from archipelago.federation.exchange import inspect_gather as inspect_unconfirmed
from archipelago.federation.policy import FRAME_DISPUTED, FRAME_UNSIGNED

CONFIRMED_COLUMNS = receipts.Columns(tokens=TOKENS, weight=WEIGHT, frame=FRAME, nonfinite=NONFINITE, sumsq=SUMSQ,
                                     island=ISLAND)


def _exchange_signed(gathered: Gathered, manager: Any, payload: bytes, kind: int, segment: int,
                     count: int) -> list[bytes | None] | None:
    """Every member's `payload` (all of one length), each in a frame it signed: by replica
    rank, None where a frame is not its member's; None instead of a list when the
    collective failed (reported to the manager: the round will not commit)."""
    framing = gathered.framing
    size = framing.row_bytes(len(payload))
    row = framing.frame(0.0, 0.0, torch.frombuffer(bytearray(payload), dtype=torch.uint8), size, kind, segment)
    if framing.forge == "split_receipt" and kind == receipts.ROUND_RECEIPT:  # a dishonest member's drill
        work, outputs = _split_receipt(gathered, manager, payload, row, size, count)
    else:
        work, outputs = allgather(manager, row.to(gathered.outputs[0].device), count)
    work.wait()
    gathered.sent += size
    gathered.received += size * (count - 1)
    if manager.errored() is not None:
        return None
    by_rank = kind == receipts.ROUND_TABLE  # each member's table is of its own segment
    opened = [framing.open(out, len(payload), kind, k if by_rank else segment, sender=k)
              for k, out in enumerate(outputs)]
    intact = [body is not None and frame == 0 for _, _, _, body, frame in opened]
    # Shown again in the agreement: a receipt or table that reached members two ways fails the round.
    gathered.shown.append(receipts.Shown(kind, None if by_rank else segment,
                                         [framing.evidence(out, len(payload)) if ok else receipts.NO_EVIDENCE
                                          for out, ok in zip(outputs, intact)]))
    return [bytes(body.cpu().numpy().tobytes()) if ok and body is not None else None
            for (_, _, _, body, _), ok in zip(opened, intact)]


def _split_receipt(gathered: Gathered, manager: Any, payload: bytes, row: torch.Tensor, size: int,
                   count: int) -> tuple[Any, list[torch.Tensor]]:
    """The `split_receipt` drill: the member with the lowest replica rank other than this
    one gets a receipt that says the next member's row never arrived; everyone else the
    true one. The receipts ride again in the agreement's flags (`Shown`), so every member
    must see that it reached them two ways and fail the attempt."""
    from archipelago.federation.exchange import start_managed

    rank = manager.participating_rank() or 0
    others = [k for k in range(count) if k != rank]
    fooled, victim = others[0], others[-1]
    lie = bytearray(payload)
    lie[victim * receipts.EVIDENCE_BYTES:(victim + 1) * receipts.EVIDENCE_BYTES] = receipts.NO_EVIDENCE
    framing = gathered.framing
    rows = {k: framing.frame(0.0, 0.0, torch.frombuffer(bytearray(lie if k == fooled else payload),
                                                        dtype=torch.uint8), size, receipts.ROUND_RECEIPT, 0)
            for k in others}
    outputs = [torch.zeros_like(row) for _ in range(count)]
    return start_managed(manager, lambda: manager._pg.allgather_each(outputs, row, rows), outputs,
                         inputs=(row, *rows.values())), outputs


def _mark(table: torch.Tensor, refusals: receipts.Refusals) -> None:
    for rank in refusals.rows:
        table[rank, FRAME] = max(float(table[rank, FRAME]), float(FRAME_DISPUTED))


def confirm_rows(gathered: Gathered, codec: Codec, manager: Any, table: torch.Tensor) -> None:
    """The all-gather exchange's receipts: every member shows the signed header of every row
    it holds (receipts.judge_receipts); the refused rows are marked in `table`."""
    framing, count = gathered.framing, table.shape[0]
    evidence = [framing.evidence(row, codec.payload_bytes()) if float(table[k, FRAME]) != FRAME_UNSIGNED
                else receipts.NO_EVIDENCE for k, row in enumerate(gathered.outputs)]
    got = _exchange_signed(gathered, manager, b"".join(evidence), receipts.ROUND_RECEIPT, 0, count)
    if got is None:
        return
    shown = [receipts.split_evidence(payload, count) if payload is not None else None for payload in got]
    refusals = receipts.judge_receipts(framing, shown, ROUND_ROW)
    receipts.log_refusals(refusals, framing.islands, framing.step)
    _mark(table, refusals)
    for rank in refusals.rows:
        gathered.payloads[rank] = None


def confirm_tables(gathered: Gathered, piece: Codec, manager: Any, mine: torch.Tensor) -> torch.Tensor:
    """The reduce-scatter's first-phase tables as signed frames with the summer's receipts
    and each member's statement of what it sent (receipts.judge_tables): the merged table,
    with the refused rows marked; the summers' tables as believed go to `gathered.reports`."""
    assert gathered.segments is not None
    framing, count = gathered.framing, len(gathered.segments)
    received = [framing.evidence(row, piece.payload_bytes()) if float(mine[k, FRAME]) != FRAME_UNSIGNED
                else receipts.NO_EVIDENCE for k, row in enumerate(gathered.outputs[0])]
    own = gathered.own_sumsq.cpu().tolist() if gathered.own_sumsq is not None else [math.nan] * count
    sent = gathered.sent_evidence or [receipts.NO_EVIDENCE] * count
    payload = receipts.table_payload(mine, received, sent, own)
    got = _exchange_signed(gathered, manager, payload, receipts.ROUND_TABLE, gathered.rank, count)
    if got is None:
        return empty_table(count)
    statements = [receipts.read_table(body, count, len(COLUMNS)) if body is not None else None for body in got]
    refusals = receipts.judge_tables(framing, statements, ROUND_SEGMENT, CONFIRMED_COLUMNS)
    receipts.log_refusals(refusals, framing.islands, framing.step)
    reports = torch.stack([st.table if st is not None else empty_table(count) for st in statements])
    gathered.reports = receipts.corrected_reports(reports, statements, refusals, CONFIRMED_COLUMNS)
    gathered.refused_summers = set(refusals.summers)
    merged = merge_segment_tables(list(gathered.reports))
    _mark(merged, refusals)
    return merged


class _Confirm:
    rows = staticmethod(confirm_rows)
    tables = staticmethod(confirm_tables)


def inspect_gather(gathered: Gathered, codec: Codec, manager: Any, participants: int) -> torch.Tensor:
    """exchange.inspect_gather with the members' receipts (signing members only): the table
    the exchange's rows are judged by."""
    return inspect_unconfirmed(gathered, codec, manager, participants, _Confirm())
