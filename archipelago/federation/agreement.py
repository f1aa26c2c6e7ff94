"""Did a round's exchange go through on every member? Settled after each exchange
(`settle_exchange`), so that every island commits the same rows or none does.

torchft's commit vote is a vote inside one island, and an island can finish an exchange
(all rows arrived) while another's fails, so the members all-gather one signed flag each
(`agree_on_exchange`); a member that saw its own exchange fail closes the group instead,
which fails the others' agreement. A failed exchange's group is closed at once
(`abandon_group`), its collectives released first (`release_works`), so that a member
blocked on this island fails now rather than at the group's timeout (docs/rounds.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import torch

from archipelago.config.errors import ConfigError
from archipelago.federation.codecs import PayloadError
from archipelago.federation.exchange import (
    ROUND_AGREE,
    ROUND_SUM,
    Framing,
    Gathered,
    SkippedWork,
    completion_stamps,
    gather_start,
    hand_over,
    stamp_completion,
    stamping,
    stamps_list,
)
from archipelago.federation.give_up import Collective, announce, wait_for
from archipelago.federation.policy import EXCHANGE_COMPLETED, FRAME_OK, exchange_agreed
from archipelago.federation.receipts import (
    EVIDENCE_BYTES,
    ROUND_RECEIPT,
    ROUND_TABLE,
    Shown,
    judge_receipts,
    log_refusals,
    split_evidence,
)
from archipelago.federation.sums import SumRefused
from archipelago.federation.trust import FrameRefused

log = logging.getLogger("archipelago.federation")

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
        gathered = exchanges[0] if exchanges else None
        groups = gathered.shown if gathered is not None else []
        evidence = [piece for group in groups for piece in group.evidence]
        shown: list[list[bytes] | None] = []
        flags = agree_on_exchange(manager, framing, device, measured, overlapped, facts, evidence, shown)
        failed = not exchange_agreed(flags, max(manager.num_participants(), 1))
        if not failed and evidence:
            failed = arrived_differently(framing, groups, shown)
    if failed:  # members blocked on this island fail now, not at process_group_timeout_ms
        abandon_group(manager, *exchanges)
        announce(manager, framing)  # ... also those whose transport would not tell them (give_up.py)
    return failed


def arrived_differently(framing: Framing, groups: list[Shown], shown: list[list[bytes] | None]) -> bool:
    """Whether the members' agreement flags (`shown`: each member's evidence of every frame
    in `groups`, in their order) show that a receipt, table or summed segment did not reach
    every member as the same signed frame (two versions, or a member without a valid one):
    then no member may apply the round. The same verdict on every member that holds the
    same flags; a member that sent two signed versions is named in the log."""
    if not shown or any(s is None for s in shown):
        return True
    differing, at = False, 0
    for group in groups:
        count = len(group.evidence)
        receipts: list[list[bytes] | None] = [s[at:at + count] for s in shown if s is not None]
        at += count
        refusals = judge_receipts(framing, receipts, group.kind, segment=group.segment, skip=group.skip)
        if refusals.rows:
            log.error("the %s of outer step %d did not reach every member alike: no member applies the round",
                      _WHAT.get(group.kind, f"frames of kind {group.kind}"), framing.step + 1)
            log_refusals(refusals, framing.islands, framing.step)
            differing = True
    return differing


_WHAT = {ROUND_SUM: "summed segments", ROUND_RECEIPT: "receipts", ROUND_TABLE: "first-phase tables"}


def agree_on_exchange(manager: Any, framing: Framing, device: torch.device, measured: float = 0.0,
                      overlapped: bool = False, facts: list[tuple[float, float]] | None = None,
                      evidence: list[bytes] | None = None,
                      shown: list[list[bytes] | None] | None = None) -> list[float | None] | None:
    """Every member's flag, by replica rank: EXCHANGE_COMPLETED where its exchange went
    through, 0 where it says it failed, None where the flag is not signed with the
    federation's key for this round (another key's island, a replay); None instead of a
    list when this collective failed (a member died, or closed the group because its own
    exchange failed: attempts.ExchangeAttempts._failed).

    Decoupled rounds (federation/decoupled.py) add two facts to each flag, at no extra
    byte: `measured` (a non-negative number in the frame's tokens field) and `overlapped`
    (its weight field); with `facts` given, each signed member's pair is appended to it, by
    replica rank ((0, 0) for a flag that is not signed for this round).

    Runs on torchft's process group even after the manager saw an error, unlike the
    exchange's own collectives: a refusal of rows is a verdict every member reached alike,
    so all of them skipped the same collectives and meet here. The collective's error is
    reported to the manager, so that the round does not commit unless it is run again."""
    participants = max(manager.num_participants(), 1)
    evidence = evidence or []
    flag = torch.frombuffer(bytearray(b"\x01" + b"".join(evidence)), dtype=torch.uint8)
    size = framing.row_bytes(flag.numel())
    claim = float(min(max(round(measured), 0), 2 ** 53))  # an integer either header carries exactly
    row = replace(framing, forge=None).frame(claim, float(overlapped), flag, size, ROUND_AGREE).to(device)
    try:
        outputs = _gathered_flags(manager, participants, row, framing, device)
        if outputs is None:
            return None  # another member gave the exchange up (reported to the manager)
    except Exception as exc:  # noqa: BLE001 - any transport failure: no agreement, the round is not committed
        if manager.errored() is None:
            manager.report_error(exc)
        return None
    opened = [_flag(framing, out, len(evidence), k) for k, out in enumerate(outputs)]
    if facts is not None:
        facts.extend(fact for _, fact, _ in opened)
    if shown is not None:
        shown.extend(receipt for _, _, receipt in opened)
    return [value for value, _, _ in opened]


def _gathered_flags(manager: Any, participants: int, row: torch.Tensor, framing: Framing,
                    device: torch.device) -> list[torch.Tensor] | None:
    """Every member's flag row, all-gathered (exchange.gather_start); None when another
    member gave the exchange up while this one waited (give_up.wait_for: a wire that does
    not fail a dead member's pending transfer would otherwise hold this member until the
    group's timeout)."""
    stamps = completion_stamps(device)
    start, outputs, handed = gather_start(manager, row, participants)
    hand_over(manager, *handed, *outputs)  # they outlive a failed all-gather (exchange.hand_over)
    flags = Collective(start(), stamps_list(stamps))
    if stamps is not None:
        stamp_completion(flags.work, stamps)
    flags.stamped = stamping(stamps)
    wait_for(manager, flags, framing)
    return None if isinstance(flags.work, SkippedWork) else outputs


def release_works(gathered: Gathered | None) -> None:
    """Let go of a failed exchange's collectives before `abandon_group` (the rows stay): a
    gloo work still referenced keeps the process group's connections open after the abort,
    and a member blocked on this island in a ring then waits for the process group's
    timeout instead of failing at once (measured: bench/gloo_abort.py)."""
    if gathered is None:
        return
    gathered.work = SkippedWork()
    if gathered.second is not None:
        gathered.second.work = SkippedWork()


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


def _flag(framing: Framing, row: torch.Tensor, shown: int,
          sender: int) -> tuple[float | None, tuple[float, float], list[bytes] | None]:
    """(flag, decoupled facts, the evidence of the `shown` sums it holds) of a member's flag row."""
    size = 1 + shown * EVIDENCE_BYTES
    tokens, weight, _, payload, frame = framing.open(row, size, ROUND_AGREE, sender=sender)
    if frame != FRAME_OK or payload is None or payload.numel() != size:
        return None, (0.0, 0.0), None
    facts = (tokens if math.isfinite(tokens) and tokens > 0 else 0.0, float(weight == 1.0))
    receipt = split_evidence(payload[1:].cpu().numpy().tobytes(), shown)
    return (EXCHANGE_COMPLETED if int(payload[0]) == 1 else 0.0), facts, receipt
