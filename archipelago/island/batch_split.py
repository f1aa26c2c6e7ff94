"""Samples per data-parallel rank, from measured speeds: the island planner's batch split
(plan.py re-exports it beside the stage split); pure functions, stdlib only (no torch).

Rank r takes n_r samples at sample_s_r seconds each; the step ends when the slowest rank
does, so the split minimises max(n_r x sample_s_r) with the n_r summing to the global batch.
`split_batch` finds that time by giving each next sample to the rank that would finish it
earliest; `split_batch_brute` enumerates every split, for the tests. Each rank's share is
then cut into the fewest equal micro-batches that fit its memory. Where ranks were measured
at several micro-batch sizes (a CPU's time per sample grows with the micro-batch as it falls
out of cache, a GPU's shrinks as kernels fill), a rank's time for n samples is that of its
best equal micro-batches, which is not linear in n; `split_batch_sized` then solves the
split exactly (a reachability search, then dynamic programming over (rank, samples left) in
O(R x N^2)), each rank's size with it. That is the step of ranks that meet only at its end
(DDP). Ranks of an FSDP island meet at every block of their first forward and last backward,
so the step is the slowest micro-batch plus the longest time a rank runs alone
(`fsdp_step_s`; for an even split it is the plain per-micro-batch lockstep);
`split_batch_fsdp` minimises that exactly, one reachability search per candidate slowest
micro-batch.

Why earliest-finish is optimal: rank r's k-th sample ends at k x sample_s_r, which grows
with k. Any split of N samples (at least one per rank) runs every rank's first sample, and
N - R further samples, each ending no earlier than the next-earliest end not yet taken; the
greedy takes exactly the N - R earliest ends, so no split ends sooner. This holds with the
float products too (rounding keeps k x s non-decreasing in k).

Ties, which decide the split whenever the slowest rank is fixed by something else (a rank
that is slow for every share): among the splits with the smallest step time, samples go to
the fastest ranks first (the same step in the fewest device-seconds), and between equally
fast ranks to the lower-numbered one. `split_batch_brute` ranks by (step time, total busy
time, larger shares first); they agree exactly whenever the times are exact in floats (the
tests use speeds in eighths of a second), and on the step time always.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["BatchSplit", "PlanError", "RankSpeed", "calibrate", "compositions", "fsdp_step_s", "micro_batches_for",
           "split_batch", "split_batch_brute", "split_batch_fsdp", "split_batch_sized"]


class PlanError(ValueError):
    """A plan that cannot be made; the message names the fix."""


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of `parts` positive integers summing to `total` (the brute-force splits
    of samples over ranks here, of layers over stages in plan.py)."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class RankSpeed:
    """One data-parallel rank: seconds of forward and backward per sample, and the largest
    micro-batch its memory holds beside the model (0 = no limit). `sample_s_by_size`, where
    measured, holds (micro-batch size, seconds per sample) at several sizes, by size: a
    device's time per sample depends on the micro-batch (caches on a CPU, kernel shapes on
    a GPU), and with two sizes or more the split chooses each rank's size as well."""

    sample_s: float
    max_micro_batch: int = 0
    sample_s_by_size: tuple[tuple[int, float], ...] = ()

    def sample_s_at(self, size: int) -> float:
        """Seconds per sample in micro-batches of `size`: the measured value, linear between
        the two measured sizes around it, the nearest measured size's beyond them; sample_s
        where fewer than two sizes were measured."""
        points = self.sample_s_by_size
        if len(points) < 2:
            return self.sample_s
        if size <= points[0][0]:
            return points[0][1]
        for (lo, lo_s), (hi, hi_s) in zip(points, points[1:]):
            if size <= hi:
                return lo_s + (hi_s - lo_s) * (size - lo) / (hi - lo)
        return points[-1][1]


@dataclass(frozen=True)
class BatchSplit:
    """Each rank's micro-batch size and count, with the speeds they were planned for."""

    micro_batch_size: tuple[int, ...]
    num_micro_batches: tuple[int, ...]
    sample_s: tuple[float, ...]
    fsdp: bool = False  # the ranks meet at every block of the first forward and the last backward

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(size * count for size, count in zip(self.micro_batch_size, self.num_micro_batches))

    @property
    def rank_s(self) -> tuple[float, ...]:
        """Each rank's predicted busy time per step (linear in its samples)."""
        return tuple(n * s for n, s in zip(self.samples, self.sample_s))

    @property
    def step_s(self) -> float:
        if not self.fsdp:
            return max(self.rank_s)
        micro_batch_s = [size * s for size, s in zip(self.micro_batch_size, self.sample_s)]
        return fsdp_step_s(micro_batch_s, self.rank_s)

    @property
    def idle(self) -> tuple[float, ...]:
        """Each rank's idle fraction per step, waiting for the slowest before the gradient reduction."""
        return tuple(1 - r / self.step_s if self.step_s > 0 else 0.0 for r in self.rank_s)


def calibrate(micro_batch_size: Sequence[int], num_micro_batches: Sequence[int], rank_idle: Sequence[float],
              step_s: float, profiled: Sequence[RankSpeed] | None = None) -> tuple[RankSpeed, ...]:
    """Each rank's speed as a training run measured it, from the split it ran (micro-batch
    size and count per rank), each rank's idle share of a step and the step time: rank r was
    busy (1 - idle_r) x step_s for its n_r samples. A profile times each rank before
    training, alone; in the run the ranks share what they share (a CPU's memory bandwidth, a
    node's links) and the re-plan from these speeds corrects for it. A rank that ran several
    micro-batches keeps its size as the cap (its memory may have set it); one that ran one
    gets none. Times per sample are taken as constant in the share (one size was run).
    With the ranks' `profiled` speeds (what parallelism.auto measured at start), each rank's
    profile is scaled instead, to the time the run measured at the size it ran: the profile
    keeps saying which micro-batch size is faster, the run says how fast the rank is there."""
    ranks = len(micro_batch_size)
    if not ranks or len(num_micro_batches) != ranks or len(rank_idle) != ranks or \
            (profiled is not None and len(profiled) != ranks):
        raise PlanError(f"calibrate: {ranks} micro-batch sizes, {len(num_micro_batches)} counts and "
                        f"{len(rank_idle)} idle shares; give one of each per rank")
    if not step_s > 0:
        raise PlanError(f"calibrate: step time {step_s} s; it must be positive")
    speeds = []
    for r, (size, count, idle) in enumerate(zip(micro_batch_size, num_micro_batches, rank_idle)):
        if size < 1 or count < 1 or not 0 <= idle < 1:
            raise PlanError(f"calibrate: rank {r} ran {size} x {count} samples idle {idle:.0%}; a rank needs at "
                            "least one sample and an idle share in [0, 1) to be measured")
        measured = (1 - idle) * step_s / (size * count)
        if profiled is None:
            speeds.append(RankSpeed(measured, max_micro_batch=size if count > 1 else 0))
            continue
        base = profiled[r]
        scale = measured / base.sample_s_at(size)
        speeds.append(RankSpeed(base.sample_s * scale, base.max_micro_batch,
                                tuple((n, s * scale) for n, s in base.sample_s_by_size)))
    return tuple(speeds)


def _check_batch(ranks: Sequence[RankSpeed], global_batch: int) -> None:
    if not ranks:
        raise PlanError("no ranks to plan")
    if global_batch < len(ranks):
        raise PlanError(f"training.batch_size = {global_batch} gives some of the {len(ranks)} ranks no sample; "
                        f"raise it to at least {len(ranks)}")
    for r, rank in enumerate(ranks):
        if not (rank.sample_s > 0 and math.isfinite(rank.sample_s)):
            raise PlanError(f"rank {r} has no positive measured time per sample ({rank.sample_s}); measure it again")
        sizes = [size for size, _ in rank.sample_s_by_size]
        if sizes != sorted(set(sizes)) or any(size < 1 or not (t > 0 and math.isfinite(t))
                                                for size, t in rank.sample_s_by_size):
            raise PlanError(f"rank {r}'s times by micro-batch size {rank.sample_s_by_size} are not positive times "
                            "at increasing sizes; measure it again")
        if rank.max_micro_batch < 0:
            raise PlanError(f"rank {r} cannot hold even one sample beside the model; give it fewer layers (a "
                            "pipeline stage) or leave it out of the island")


def _slowest_rank_s(ranks: Sequence[RankSpeed], global_batch: int) -> float:
    """The smallest step time: each next sample to the rank that would finish it earliest
    (module docstring). A heap of next finish times: O(N log R)."""
    ends = [(2 * r.sample_s, i, 2) for i, r in enumerate(ranks)]  # every rank already holds one sample
    heapq.heapify(ends)
    step = max(r.sample_s for r in ranks)
    for _ in range(global_batch - len(ranks)):
        end, i, k = heapq.heappop(ends)
        step = max(step, end)
        heapq.heappush(ends, ((k + 1) * ranks[i].sample_s, i, k + 1))
    return step


def _most_samples_within(rank: RankSpeed, step_s: float) -> int:
    """The largest n with n x sample_s <= step_s, computed as the products are (float)."""
    n = max(1, int(step_s / rank.sample_s))
    while n > 1 and n * rank.sample_s > step_s:
        n -= 1
    while (n + 1) * rank.sample_s <= step_s:
        n += 1
    return n


def _micro_batches(samples: int, cap: int) -> tuple[int, int]:
    """(size, count): the fewest equal micro-batches of `samples` no larger than `cap` (0: none).
    A prime share above the cap ends as micro-batches of one sample."""
    for count in range(1, samples + 1):
        if samples % count == 0 and (cap <= 0 or samples // count <= cap):
            return samples // count, count
    raise AssertionError("count = samples always fits a cap of 1 or more")


def _with_micro_batches(ranks: Sequence[RankSpeed], samples: Sequence[int]) -> BatchSplit:
    pairs = [_micro_batches(n, r.max_micro_batch) for n, r in zip(samples, ranks)]
    return BatchSplit(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), tuple(r.sample_s for r in ranks))


def split_batch(ranks: Sequence[RankSpeed], global_batch: int, fsdp: bool = False) -> BatchSplit:
    """Samples per rank (each at least one, summing to global_batch) minimising the slowest
    rank's time, exactly; of the splits that do, the fastest ranks filled first (module
    docstring). Then each rank's fewest equal micro-batches within its max_micro_batch.
    Ranks measured at several micro-batch sizes are split with their sizes (split_batch_sized);
    ranks of an FSDP island by its step model (split_batch_fsdp)."""
    _check_batch(ranks, global_batch)
    if fsdp and len(ranks) > 1:
        return split_batch_fsdp(ranks, global_batch)
    if any(len(rank.sample_s_by_size) > 1 for rank in ranks):
        return split_batch_sized(ranks, global_batch)
    step = _slowest_rank_s(ranks, global_batch)
    samples, left = [1] * len(ranks), global_batch - len(ranks)
    for i in sorted(range(len(ranks)), key=lambda i: (ranks[i].sample_s, i)):
        extra = min(_most_samples_within(ranks[i], step) - 1, left)
        samples[i] += extra
        left -= extra
    assert left == 0, "the greedy's step time admits the whole batch"
    return _with_micro_batches(ranks, samples)


def split_batch_brute(ranks: Sequence[RankSpeed], global_batch: int) -> BatchSplit:
    """Every split of the batch tried, ranked by (step time, total busy time, larger shares
    first). For tests: C(N-1, R-1) splits."""
    _check_batch(ranks, global_batch)
    sized = any(len(rank.sample_s_by_size) > 1 for rank in ranks)
    best: tuple[tuple[float, float, tuple[int, ...]], tuple[int, ...]] | None = None
    for samples in compositions(global_batch, len(ranks)):
        times = [micro_batches_for(r, n)[0] if sized else n * r.sample_s for n, r in zip(samples, ranks)]
        key = (max(times), math.fsum(times), tuple(-n for n in samples))
        if best is None or key < best[0]:
            best = (key, samples)
    assert best is not None  # global_batch >= ranks: at least one split
    if not sized:
        return _with_micro_batches(ranks, best[1])
    return _sized_split(ranks, best[1], [micro_batches_for(r, n)[1] for r, n in zip(ranks, best[1])])


def _sized_split(ranks: Sequence[RankSpeed], samples: Sequence[int], sizes: Sequence[int],
                 fsdp: bool = False) -> BatchSplit:
    """The split of these shares in micro-batches of these sizes, timed at those sizes."""
    return BatchSplit(tuple(sizes), tuple(n // size for n, size in zip(samples, sizes)),
                      tuple(rank.sample_s_at(size) for rank, size in zip(ranks, sizes)), fsdp=fsdp)


def _options(rank: RankSpeed, samples: int) -> list[tuple[float, float, int]]:
    """(micro-batch seconds, rank seconds, size) of every equal cut of `samples` in memory."""
    cap = min(samples, rank.max_micro_batch or samples)
    return [(size * rank.sample_s_at(size), samples * rank.sample_s_at(size), size)
            for size in range(1, cap + 1) if samples % size == 0]


def micro_batches_for(rank: RankSpeed, samples: int) -> tuple[float, int]:
    """(seconds, size): `samples` cut into the equal micro-batches, within the rank's memory,
    that finish soonest at its measured times per sample; the larger size on a tie."""
    _, seconds, size = min(_options(rank, samples), key=lambda cut: (cut[1], -cut[2]))
    return seconds, size


def _least_busy_table(times: list[list[float]], total: int, limit: float) -> list[list[float]]:
    """table[r][m]: the least summed time of ranks r.. holding m samples (each at least one,
    no rank above `limit`); inf where none. O(R x N^2)."""
    ranks = len(times)
    table = [[math.inf] * (total + 1) for _ in range(ranks + 1)]
    table[ranks][0] = 0.0
    for r in reversed(range(ranks)):
        for m in range(ranks - r, total + 1):
            for n in range(1, min(m, len(times[r]) - 1) + 1):
                rest = table[r + 1][m - n]
                if rest < math.inf and times[r][n] <= limit:
                    table[r][m] = min(table[r][m], times[r][n] + rest)
    return table


def split_batch_sized(ranks: Sequence[RankSpeed], global_batch: int) -> BatchSplit:
    """Samples and micro-batch size per rank, where a rank's time per sample depends on its
    micro-batch size (RankSpeed.sample_s_by_size): rank r's time for n samples is the best of
    its equal micro-batches (micro_batches_for), which is not linear in n, so the greedy of
    split_batch does not apply. The smallest slowest-rank time (_least_max), then, among
    splits within it, the least total busy time (a dynamic programme over (rank, samples
    left), O(R x N^2)), the larger shares to the lower-numbered ranks on a tie
    (split_batch_brute's order)."""
    _check_batch(ranks, global_batch)
    most = global_batch - len(ranks) + 1
    options = [[(0.0, 0)] + [micro_batches_for(rank, n) for n in range(1, most + 1)] for rank in ranks]
    times = [[seconds for seconds, _ in row] for row in options]
    step = _least_max(times, global_batch)
    busy = _least_busy_table(times, global_batch, step)
    samples, left = [], global_batch
    for r in range(len(ranks)):
        n = next(n for n in range(min(left, most), 0, -1)
                 if times[r][n] <= step and busy[r + 1][left - n] < math.inf
                 and times[r][n] + busy[r + 1][left - n] == busy[r][left])
        samples.append(n)
        left -= n
    return _sized_split(ranks, samples, [options[r][n][1] for r, n in enumerate(samples)])


def fsdp_step_s(micro_batch_s: Sequence[float], rank_s: Sequence[float]) -> float:
    """An FSDP step of unlike ranks: with the parameters kept gathered through the
    accumulation (island/batches.py), every rank joins each block's gather in its first
    forward and each block's reduction in its last backward, so those two run at the slowest
    rank's pace, and together take one micro-batch's time (a forward and a backward); the
    rest each rank runs alone. Step: the largest micro-batch time + the largest rest."""
    return max(micro_batch_s) + max(r - m for r, m in zip(rank_s, micro_batch_s))


def _rest_table(options: list[list[list[tuple[float, float, int]]]], limit: float) -> list[list[float]]:
    """rest[r][n]: rank r's least time outside its lockstep micro-batch, for n samples in
    micro-batches of at most `limit` seconds (inf where none)."""
    return [[math.inf] + [min((total - mb for mb, total, _ in cuts if mb <= limit), default=math.inf)
                          for cuts in row[1:]] for row in options]


def _reachable(rows: list[list[float]], limit: float, total: int) -> list[int]:
    """suffix[r]: a bitset of the sample totals ranks r.. can hold (each at least one) with
    every rank's value at most `limit`; suffix[R] holds only 0. Python integers as bitsets:
    R x N shifts of N-bit integers."""
    mask = (1 << (total + 1)) - 1
    suffix = [0] * len(rows) + [1]
    for r in reversed(range(len(rows))):
        reach = 0
        for n, value in enumerate(rows[r]):
            if n and value <= limit:
                reach |= suffix[r + 1] << n
        suffix[r] = reach & mask
    return suffix


def _least_max(rows: list[list[float]], total: int) -> float:
    """The least possible max over ranks of rows[r][n_r], with the n_r (each at least one)
    summing to `total`: a binary search over the values for the smallest that admits a split
    (inf where none does)."""
    values = sorted({v for row in rows for v in row[1:] if v < math.inf})
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if _reachable(rows, values[mid], total)[0] >> total & 1:
            hi = mid
        else:
            lo = mid + 1
    return values[lo] if lo < len(values) else math.inf


def split_batch_fsdp(ranks: Sequence[RankSpeed], global_batch: int) -> BatchSplit:
    """Samples and micro-batch size per rank minimising fsdp_step_s, exactly: for each
    candidate slowest micro-batch time M (every rank's every cut, ascending), the least
    largest rest with micro-batches within M (_least_max); stop once M with the least rest
    of any M cannot win. Of the best, the larger shares to the lower-numbered ranks, each
    rank's least busy cut (the larger micro-batch on a tie)."""
    _check_batch(ranks, global_batch)
    most = global_batch - len(ranks) + 1
    none: list[tuple[float, float, int]] = []  # no cut of 0 samples
    options = [[none] + [_options(rank, n) for n in range(1, most + 1)] for rank in ranks]
    least_rest = _least_max(_rest_table(options, math.inf), global_batch)
    best: tuple[float, float, float] | None = None
    for limit in sorted({mb for row in options for cuts in row for mb, _, _ in cuts}):
        if best is not None and limit + least_rest >= best[0]:
            break
        rest = _least_max(_rest_table(options, limit), global_batch)
        if rest < math.inf and (best is None or limit + rest < best[0]):
            best = (limit + rest, limit, rest)
    assert best is not None  # one sample per micro-batch always fits
    _, limit, most_rest = best
    rest_rows = _rest_table(options, limit)
    suffix = _reachable(rest_rows, most_rest, global_batch)
    samples, sizes, left = [], [], global_batch
    for r in range(len(ranks)):
        n = next(n for n in range(min(left, most), 0, -1)
                 if rest_rows[r][n] <= most_rest and suffix[r + 1] >> (left - n) & 1)
        _, _, size = min((total, -size, size) for mb, total, size in options[r][n]
                         if mb <= limit and total - mb <= most_rest)
        samples.append(n)
        sizes.append(size)
        left -= n
    return _sized_split(ranks, samples, sizes, fsdp=True)
