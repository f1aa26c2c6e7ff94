"""The sum of an exchange's accepted rows: every island's own (the all-gather), or the
reduce-scatter's second phase, where island j sums segment j of the accepted rows,
encodes that sum again and the islands all-gather the summed segments.

Island j is trusted with the sum of segment j only as far as every island can check it
(`check_sum`): its values must be finite and its norm within what the accepted
segments' norms allow (the first phase's table, per island and segment), and each island
checks that what its own segments were reported to be is what it sent
(`_misreported_segment`). A sum that fails is refused alike on every island (`SumRefused`):
they all read the same bytes against the same table.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import torch

from archipelago.federation.codecs import Codec, PayloadError, pack_sum, sum_bytes_bound, unpack_sum
from archipelago.federation.exchange import (
    FRAME,
    NONFINITE,
    ROUND_SUM,
    SUMSQ,
    WEIGHT,
    Gathered,
    SecondPhase,
    allgather,
    completion_stamps,
    stamping,
    stamps_list,
    wire_device,
)
from archipelago.federation.give_up import wait_for
from archipelago.federation.outer_core import aggregate
from archipelago.federation.policy import FRAME_OK
from archipelago.federation.receipts import NO_EVIDENCE, Shown
from archipelago.federation.trust import FrameRefused


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
        into[:-2] = weighted_sum(gathered.payloads, codec, weights, into.numel() - 2, into.device, trimmed)
    else:
        if gathered.second is None:
            start_sums(gathered, codec, weights, manager, into.device, trimmed)
        _read_second_phase(gathered, codec, into, manager, trimmed)
    into[-2], into[-1] = tokens, sum(weights)
    return time.perf_counter() - began


def weighted_sum(payloads: list[torch.Tensor | None], codec: Codec, weights: list[float], numel: int,
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
    total = weighted_sum(gathered.payloads, mine, weights, mine.numel, device, trimmed)
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
    stamps, second.started = completion_stamps(wire), time.perf_counter()
    second.work, second.outputs = allgather(manager, row.to(wire), len(segments), stamps)
    second.pieces, second.sizes, second.failed, second.done_at = pieces, sizes, False, stamps_list(stamps)
    second.stamped = stamping(stamps)
    gathered.sent += size
    gathered.received += size * (len(segments) - 1)


def _read_second_phase(gathered: Gathered, codec: Codec, into: torch.Tensor, manager: Any, trimmed: bool) -> None:
    """Wait for the summed segments and write them, checked, into `into` (zeros when the
    second phase failed: the round will not commit)."""
    second = gathered.second
    assert second is not None, "the second phase was started"
    if not second.failed:
        wait_for(manager, second, gathered.framing)  # or a member's give-up
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
    shown = None
    if gathered.framing.checks_signers:  # the sums every member got, shown in the agreement
        shown = Shown(ROUND_SUM, None, [NO_EVIDENCE] * len(gathered.segments), set(gathered.refused_summers))
        gathered.shown.append(shown)
    framing = gathered.framing
    for j, (piece, (start, end), out) in enumerate(zip(pieces, gathered.segments, outputs)):
        if j in gathered.refused_summers:  # the receipts refused its summer: that segment does not move
            into[start:end] = 0.0
            continue
        complaint, _, _, opened, frame = framing.open(out, sizes[j], ROUND_SUM, j, sender=j)
        if opened is None or frame != FRAME_OK:
            return FrameRefused(f"the sum of segment {j} is not signed by the federation's key")
        if shown is not None:
            shown.evidence[j] = framing.evidence(out, sizes[j])
        if complaint:
            return SumRefused(f"the island at replica rank {j} says the island at replica rank "
                              f"{int(complaint) - 1}, which summed segment {int(complaint) - 1}, misreported "
                              f"the norm of its segment {int(complaint) - 1} in the first phase's table")
        try:
            values = unpack_sum(opened, end - start) if codec.sparse else piece.decode(opened)
        except PayloadError as exc:
            return exc
        why = check_sum(values, gathered.reports[j], weights, trimmed, None if codec.sparse else piece)
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
    island for the norm limits); None when all match or this island sent weight 0. With
    signing members every member checks that already, from each sender's own signed
    statement, and refuses the summer (receipts.judge_tables): no complaint is needed."""
    if gathered.own_sumsq is None or gathered.reports is None or gathered.framing.checks_signers:
        return None
    return misreported(gathered.reports, gathered.own_sumsq, gathered.rank)


def misreported(reports: torch.Tensor, own_sumsq: torch.Tensor, rank: int) -> int | None:
    """The first segment j whose summer's table (`reports[j]`) gives this island's row
    (`rank`) another sum of squares than `own_sumsq[j]`, what it sent; None when all match."""
    own = own_sumsq.cpu().tolist()
    for j, report in enumerate(reports[:, rank].tolist()):
        if report[FRAME] != FRAME_OK or report[NONFINITE] or report[WEIGHT] == 0 or not math.isfinite(own[j]):
            continue  # it says it read nothing of it (or nothing finite): the row is refused anyway
        if not abs(report[SUMSQ] - own[j]) <= REPORT_TOLERANCE * own[j]:  # a NaN report fails too
            return j
    return None


def summed_norm_bound(norms: list[float], weights: list[float], trimmed: bool) -> float:
    """The largest norm the exact `aggregate` of rows of these norms can have, with these
    weights (0: left out, as `weighted_sum` leaves them out; the receivers' weights are
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


def check_sum(values: torch.Tensor, reported: torch.Tensor, weights: list[float], trimmed: bool,
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
