"""The island planner's decisions, from measured profiles: pure functions, no torch.

Two questions, each answered exactly:

* **Layers per pipeline stage.** Stage s runs a contiguous run of the model's layers on
  its device; a micro-batch takes the sum of those layers' times there (plus the embedding
  on the first stage, the head on the last). The pipeline's steady state moves at the pace
  of its slowest stage, so the split minimises the slowest stage's time, subject to each
  stage's memory. `split_layers` solves it by dynamic programming over (stage, first layer)
  in O(S x L^2); `split_layers_brute` enumerates every split, for the tests.
* **Samples per data-parallel rank.** Rank r takes n_r samples at sample_s_r seconds each;
  the step ends when the slowest rank does, so the split minimises max(n_r x sample_s_r)
  with the n_r summing to the global batch. Giving each next sample to the rank that would
  finish it earliest is optimal for this (a sample's cost on a rank never changes, so an
  exchange argument shows no later choice can undo an earlier one's advantage);
  `split_batch_brute` checks it. Each rank's share is then cut into the fewest equal
  micro-batches that fit its memory.

Ties (equal slowest-stage time) go to the split whose stage times have the smallest sum of
squares (the most even), then to the smallest layer tuple, so the DP and brute force agree;
for samples, to the smallest sum of squared rank times, then the larger shares first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from archipelago.config.counts import parse_counts

__all__ = ["BatchSplit", "IslandPlan", "PlanError", "RankSpeed", "StageCosts", "StageSplit", "bubble_fraction",
           "explain", "parse_counts", "predict_pipeline_step_s", "split_batch", "split_batch_brute", "split_layers",
           "split_layers_brute", "to_toml"]

GIB = 2**30


class PlanError(ValueError):
    """A plan that cannot be made; the message names the fix."""


@dataclass(frozen=True)
class StageCosts:
    """What one pipeline stage's device would spend on each layer, per micro-batch."""

    layer_s: tuple[float, ...]
    first_extra_s: float = 0.0
    last_extra_s: float = 0.0
    memory_bytes: float = math.inf
    layer_bytes: tuple[float, ...] = ()  # empty: layers take no memory the planner counts
    first_extra_bytes: float = 0.0
    last_extra_bytes: float = 0.0

    def time(self, lo: int, hi: int, first: bool, last: bool) -> float:
        return sum(self.layer_s[lo:hi]) + (self.first_extra_s if first else 0.0) + (self.last_extra_s if last else 0.0)

    def bytes(self, lo: int, hi: int, first: bool, last: bool) -> float:
        return (sum(self.layer_bytes[lo:hi]) + (self.first_extra_bytes if first else 0.0)
                + (self.last_extra_bytes if last else 0.0))

    def fits(self, lo: int, hi: int, first: bool, last: bool) -> bool:
        return self.bytes(lo, hi, first, last) <= self.memory_bytes


@dataclass(frozen=True)
class StageSplit:
    """Layers per stage and each stage's time per micro-batch."""

    layers: tuple[int, ...]
    stage_s: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_s)

    @property
    def idle(self) -> tuple[float, ...]:
        """Each stage's idle fraction in the steady state (waiting for the slowest)."""
        return tuple(1 - s / self.bottleneck_s if self.bottleneck_s > 0 else 0.0 for s in self.stage_s)

    def ranges(self) -> Iterator[tuple[int, int]]:
        lo = 0
        for n in self.layers:
            yield lo, lo + n
            lo += n


def _sum_of_squares(stage_s: Sequence[float]) -> float:
    """Summed from the last stage back, as split_layers adds them (the same float rounding)."""
    total = 0.0
    for t in reversed(stage_s):
        total = t * t + total
    return total


def _check_stages(stages: Sequence[StageCosts]) -> int:
    if not stages:
        raise PlanError("no pipeline stages to plan; pass at least one")
    layers = len(stages[0].layer_s)
    if any(len(s.layer_s) != layers for s in stages):
        raise PlanError("every stage must be measured on the same layers")
    if len(stages) > layers:
        raise PlanError(f"{len(stages)} pipeline stages for {layers} layers: each stage needs a layer; lower "
                        "parallelism.pipeline_stages")
    return layers


def _no_fit(stages: Sequence[StageCosts]) -> PlanError:
    need = sum(stages[0].layer_bytes) + stages[0].first_extra_bytes + stages[0].last_extra_bytes
    have = sum(s.memory_bytes for s in stages)
    return PlanError(f"the model does not fit: it needs {need / GIB:.1f} GiB with its optimizer state and the "
                     f"{len(stages)} stage(s) hold {have / GIB:.1f} GiB in all; add pipeline stages, or lower "
                     "--training.micro_batch_size")


def _choices(stages: Sequence[StageCosts], n_layers: int, s: int, lo: int) -> Iterator[tuple[int, float]]:
    """(hi, time) for each way stage s can take layers lo..hi-1 and fit in its memory."""
    n_stages = len(stages)
    first, last = s == 0, s == n_stages - 1
    his = [n_layers] if last else range(lo + 1, n_layers - (n_stages - s - 1) + 1)
    for hi in his:
        if stages[s].fits(lo, hi, first, last):
            yield hi, stages[s].time(lo, hi, first, last)


def _slowest_stage_s(stages: Sequence[StageCosts], n_layers: int) -> float:
    """The smallest achievable slowest-stage time (minimax DP; inf when nothing fits)."""
    n_stages = len(stages)
    best = [[math.inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[n_stages][n_layers] = 0.0
    for s in range(n_stages - 1, -1, -1):
        for lo in range(n_layers - (n_stages - s) + 1):
            best[s][lo] = min((max(t, best[s + 1][hi]) for hi, t in _choices(stages, n_layers, s, lo)),
                              default=math.inf)
    return best[0][0]


def split_layers(stages: Sequence[StageCosts]) -> StageSplit:
    """The contiguous split minimising the slowest stage (module docstring), exactly: a
    minimax DP finds the slowest-stage time, then a second DP, over the splits no slower
    than it, the most even one (smallest sum of squared stage times, then smallest layers)."""
    n_layers, n_stages = _check_stages(stages), len(stages)
    bound = _slowest_stage_s(stages, n_layers)
    if math.isinf(bound):
        raise _no_fit(stages)
    # best[s][lo]: (sum of squares, layers, times) of the best split of layers lo.. over stages s..
    Best = tuple[float, tuple[int, ...], tuple[float, ...]]
    best: list[list[Best | None]] = [[None] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[n_stages][n_layers] = (0.0, (), ())
    for s in range(n_stages - 1, -1, -1):
        for lo in range(n_layers - (n_stages - s) + 1):
            for hi, t in _choices(stages, n_layers, s, lo):
                rest = best[s + 1][hi]
                if rest is None or t > bound:
                    continue
                here: Best = (t * t + rest[0], (hi - lo, *rest[1]), (t, *rest[2]))
                current = best[s][lo]
                if current is None or here[:2] < current[:2]:
                    best[s][lo] = here
    found = best[0][0]
    assert found is not None  # the minimax DP found a split within the bound
    return StageSplit(found[1], found[2])


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def split_layers_brute(stages: Sequence[StageCosts]) -> StageSplit:
    """Every contiguous split tried (for tests: exponential in the stage count)."""
    n_layers, n_stages = _check_stages(stages), len(stages)
    best: tuple[tuple[float, float, tuple[int, ...]], StageSplit] | None = None
    for layers in _compositions(n_layers, n_stages):
        split = StageSplit(layers, ())
        ranges = list(split.ranges())
        flags = [(s == 0, s == n_stages - 1) for s in range(n_stages)]
        if not all(st.fits(lo, hi, *f) for st, (lo, hi), f in zip(stages, ranges, flags)):
            continue
        times = tuple(st.time(lo, hi, *f) for st, (lo, hi), f in zip(stages, ranges, flags))
        key = (max(times), _sum_of_squares(times), layers)
        if best is None or key < best[0]:
            best = (key, StageSplit(layers, times))
    if best is None:
        raise _no_fit(stages)
    return best[1]


@dataclass(frozen=True)
class RankSpeed:
    """One data-parallel rank: seconds of forward and backward per sample, and the largest
    micro-batch its memory holds (0 = no limit)."""

    sample_s: float
    max_micro_batch: int = 0


@dataclass(frozen=True)
class BatchSplit:
    """Each rank's micro-batch size and count, with the speeds they were planned for."""

    micro_batch_size: tuple[int, ...]
    num_micro_batches: tuple[int, ...]
    sample_s: tuple[float, ...]

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(size * count for size, count in zip(self.micro_batch_size, self.num_micro_batches))

    @property
    def rank_s(self) -> tuple[float, ...]:
        """Each rank's predicted busy time per step."""
        return tuple(n * s for n, s in zip(self.samples, self.sample_s))

    @property
    def step_s(self) -> float:
        return max(self.rank_s)

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(1 - r / self.step_s if self.step_s > 0 else 0.0 for r in self.rank_s)


def _check_batch(ranks: Sequence[RankSpeed], global_batch: int) -> None:
    if not ranks:
        raise PlanError("no ranks to plan")
    if global_batch < len(ranks):
        raise PlanError(f"training.batch_size = {global_batch} gives some of the {len(ranks)} ranks no sample; "
                        f"raise it to at least {len(ranks)}")
    if any(r.sample_s <= 0 for r in ranks):
        raise PlanError("every rank needs a positive measured time per sample")


def _samples_by_earliest_finish(ranks: Sequence[RankSpeed], global_batch: int) -> list[int]:
    counts = [1] * len(ranks)  # every rank takes part: at least one sample each
    for _ in range(global_batch - len(ranks)):
        r = min(range(len(ranks)), key=lambda i: ((counts[i] + 1) * ranks[i].sample_s, i))
        counts[r] += 1
    return counts


def _micro_batches(samples: int, cap: int) -> tuple[int, int]:
    """(size, count): the fewest equal micro-batches of `samples` no larger than `cap`."""
    for count in range(1, samples + 1):
        if samples % count == 0 and (cap <= 0 or samples // count <= cap):
            return samples // count, count
    raise PlanError(f"no micro-batch fits: the largest that fits is {cap} samples")  # unreachable for cap >= 1


def _with_micro_batches(ranks: Sequence[RankSpeed], samples: Sequence[int]) -> BatchSplit:
    for r, rank in enumerate(ranks):
        if rank.max_micro_batch < 0:
            raise PlanError(f"rank {r} cannot hold even one sample beside the model; give it fewer layers (a "
                            "pipeline stage) or leave it out of the island")
    pairs = [_micro_batches(n, r.max_micro_batch) for n, r in zip(samples, ranks)]
    return BatchSplit(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), tuple(r.sample_s for r in ranks))


def split_batch(ranks: Sequence[RankSpeed], global_batch: int) -> BatchSplit:
    """Samples per rank minimising the slowest rank's time (module docstring), exactly."""
    _check_batch(ranks, global_batch)
    return _with_micro_batches(ranks, _samples_by_earliest_finish(ranks, global_batch))


def split_batch_brute(ranks: Sequence[RankSpeed], global_batch: int) -> BatchSplit:
    """Every split of the batch tried (for tests), the same tie-break: the smallest sum of
    squared rank times, then the largest shares first."""
    _check_batch(ranks, global_batch)
    best: tuple[tuple[float, float, tuple[int, ...]], tuple[int, ...]] | None = None
    for samples in _compositions(global_batch, len(ranks)):
        times = [n * r.sample_s for n, r in zip(samples, ranks)]
        key = (max(times), sum(t * t for t in times), tuple(-n for n in samples))
        if best is None or key < best[0]:
            best = (key, samples)
    assert best is not None
    return _with_micro_batches(ranks, best[1])


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a GPipe or 1F1B step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def predict_pipeline_step_s(split: StageSplit, micro_batches: int, schedule: str = "1f1b") -> float:
    """(M + S - 1) x the slowest stage's micro-batch time: the standard bubble model for
    GPipe and 1F1B (both fill and drain the pipeline once per step; 1F1B holds fewer
    activations, not less time). It leaves out the sends between stages."""
    if schedule not in ("gpipe", "1f1b"):
        raise PlanError(f"no step-time model for schedule {schedule!r}; use gpipe or 1f1b")
    return (micro_batches + len(split.layers) - 1) * split.bottleneck_s


@dataclass(frozen=True)
class IslandPlan:
    """What the planner chose: a batch split, and a stage split when the island pipelines."""

    batch: BatchSplit
    stages: StageSplit | None = None
    pipeline_micro_batches: int = 1
    schedule: str = "1f1b"

    @property
    def step_s(self) -> float:
        if self.stages is None:
            return self.batch.step_s
        return predict_pipeline_step_s(self.stages, self.pipeline_micro_batches, self.schedule)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def explain(plan: IslandPlan, rank_names: Sequence[str]) -> str:
    """The plan in plain words and numbers, one line per stage and rank."""
    lines = []
    if plan.stages is not None:
        s = plan.stages
        lines.append(f"pipeline of {len(s.layers)} stages, {plan.pipeline_micro_batches} micro-batches per step "
                     f"({plan.schedule}), bubble {bubble_fraction(len(s.layers), plan.pipeline_micro_batches):.0%}:")
        for k, ((lo, hi), t, idle) in enumerate(zip(s.ranges(), s.stage_s, s.idle)):
            name = rank_names[k] if k < len(rank_names) else f"stage {k}"
            lines.append(f"  stage {k} ({name}): layers {lo}-{hi - 1}, {_ms(t)} per micro-batch, idle {idle:.0%}")
    b = plan.batch
    lines.append(f"batch of {sum(b.samples)} samples:")
    for r, (size, count, t, idle) in enumerate(zip(b.micro_batch_size, b.num_micro_batches, b.rank_s, b.idle)):
        name = rank_names[r] if r < len(rank_names) else f"rank {r}"
        lines.append(f"  rank {r} ({name}): {size} samples x {count} micro-batches = {size * count}, "
                     f"{_ms(t)} per step, idle {idle:.0%}")
    lines.append(f"predicted step time {_ms(plan.step_s)}")
    return "\n".join(lines)


def _csv(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def to_toml(plan: IslandPlan) -> str:
    """The plan as a TOML fragment of our `[parallelism]` keys."""
    lines = ["[parallelism]"]
    if plan.stages is not None:
        lines.append(f'stage_layers = "{_csv(plan.stages.layers)}"')
    lines.append(f'micro_batch_size_per_rank = "{_csv(plan.batch.micro_batch_size)}"')
    lines.append(f'num_micro_batches_per_rank = "{_csv(plan.batch.num_micro_batches)}"')
    return "\n".join(lines) + "\n"
