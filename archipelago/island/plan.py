"""The island planner's decisions, from measured profiles: pure functions, stdlib only (no torch).

Two questions, each answered exactly:

* **Layers per pipeline stage.** Stage s runs a contiguous run of the model's layers on
  its device; a micro-batch takes the sum of those layers' times there (plus the embedding
  on the first stage, the head and loss on the last). The pipeline's steady state moves at
  the pace of its slowest stage, so the split minimises the slowest stage's time, subject to
  each stage's memory. `split_layers` solves it by dynamic programming over (stage, first
  layer) in O(S x L^2); `split_layers_brute` enumerates every split, for the tests.
* **Samples per data-parallel rank**: `batch_split.py` (its names are re-exported here,
  so the planner's callers import one module).

Ties, which decide the split whenever the slowest stage is fixed by something else (a heavy
output head on the last stage): among the splits with the smallest slowest-stage time, the one whose stage times
have the smallest sum of squares (a quadratic penalty on each stage's time, which favours
less device time in all and an even spread; 4+1 layers at (4, 2) s beats 3+2 at (3, 4) s),
summed exactly as fractions so float rounding decides nothing; then the lexicographically
smallest layer tuple. `split_layers_brute` ranks splits by the same key, so the two return
the same split, not only the same bottleneck.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

from archipelago.config.counts import parse_counts as _parse_counts
from archipelago.island.batch_split import (
    BatchSplit,
    PlanError,
    RankSpeed,
    calibrate,
    compositions,
    fsdp_step_s,
    micro_batches_for,
    split_batch,
    split_batch_brute,
    split_batch_fsdp,
    split_batch_sized,
)

__all__ = ["BatchSplit", "IslandPlan", "PlanError", "RankSpeed", "StageCosts", "StageSplit", "bubble_fraction",
           "calibrate", "explain", "fsdp_step_s", "micro_batches_for", "parse_counts", "predict_pipeline_step_s",
           "split_batch", "split_batch_brute", "split_batch_fsdp", "split_batch_sized", "split_layers",
           "split_layers_brute", "to_toml"]

GIB = 2**30
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_FORMS = 'write one value per entry separated by commas ("6,2") or SynerFuse\'s pairs of count and value ("1 6 1 2")'


def parse_counts(text: str, ranks_or_stages: int, what: str) -> tuple[int, ...]:
    """`ranks_or_stages` positive integers from our `"6,2"` or SynerFuse's pairs `"1 6 1 2"`
    (`"2 3"` is (3, 3)), the same parser the config uses; PlanError naming both forms otherwise."""
    try:
        return _parse_counts(text, ranks_or_stages, what)
    except ValueError as exc:
        message = str(exc)
        raise PlanError(message if "1 6 1 2" in message else f"{message}; {_FORMS}, {ranks_or_stages} entries in all"
                        ) from exc


def _span(values: Sequence[float], lo: int, hi: int) -> float:
    """values[lo] + ... + values[hi - 1], added left to right: the order the DP's running sums
    use, so the DP and brute force see bit-identical stage times (sum() may round otherwise)."""
    total = 0.0
    for v in values[lo:hi]:
        total += v
    return total


def _with_extras(span: float, first_extra: float, last_extra: float, first: bool, last: bool) -> float:
    """A stage's layers plus the embedding if it is first and the head if last (in that order, everywhere)."""
    return span + (first_extra if first else 0.0) + (last_extra if last else 0.0)


@dataclass(frozen=True)
class StageCosts:
    """What one pipeline stage's device would spend on each layer, per micro-batch: seconds of
    forward and backward, and bytes held (parameters, optimizer state, activations)."""

    layer_s: tuple[float, ...]
    first_extra_s: float = 0.0  # embedding, when this stage is the first
    last_extra_s: float = 0.0  # final norm, output head and loss, when it is the last
    memory_bytes: float = math.inf
    layer_bytes: tuple[float, ...] = ()  # empty: layers take no memory the planner counts
    first_extra_bytes: float = 0.0
    last_extra_bytes: float = 0.0

    def time(self, lo: int, hi: int, first: bool, last: bool) -> float:
        """Seconds per micro-batch for layers lo..hi-1 on this stage's device."""
        return _with_extras(_span(self.layer_s, lo, hi), self.first_extra_s, self.last_extra_s, first, last)

    def bytes(self, lo: int, hi: int, first: bool, last: bool) -> float:
        return _with_extras(_span(self.layer_bytes, lo, hi), self.first_extra_bytes, self.last_extra_bytes,
                                 first, last)

    def fits(self, lo: int, hi: int, first: bool, last: bool) -> bool:
        return self.bytes(lo, hi, first, last) <= self.memory_bytes


@dataclass(frozen=True)
class StageSplit:
    """Layers per stage (contiguous, in order) and each stage's time per micro-batch."""

    layers: tuple[int, ...]
    stage_s: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time: the pipeline's pace in its steady state."""
        return max(self.stage_s)

    @property
    def idle(self) -> tuple[float, ...]:
        """Each stage's idle fraction in the steady state, waiting for the slowest."""
        return tuple(1 - s / self.bottleneck_s if self.bottleneck_s > 0 else 0.0 for s in self.stage_s)

    def ranges(self) -> Iterator[tuple[int, int]]:
        """(first layer, one past the last layer) of each stage."""
        lo = 0
        for n in self.layers:
            yield lo, lo + n
            lo += n


def _check_stages(stages: Sequence[StageCosts]) -> int:
    """The layer count, after refusing profiles the solvers cannot plan from."""
    if not stages:
        raise PlanError("no pipeline stages to plan; pass at least one")
    n_layers = len(stages[0].layer_s)
    for k, stage in enumerate(stages):
        if len(stage.layer_s) != n_layers or len(stage.layer_bytes) not in (0, n_layers):
            raise PlanError(f"stage {k} is measured on {len(stage.layer_s)} layers ({len(stage.layer_bytes)} "
                            f"memory sizes) and stage 0 on {n_layers}; measure every stage on the same model")
        # Non-negative costs make a stage's time and memory grow with its layers, which lets the
        # DP stop extending a stage once it is too slow or too big.
        measured = (*stage.layer_s, *stage.layer_bytes, stage.first_extra_s, stage.last_extra_s,
                    stage.first_extra_bytes, stage.last_extra_bytes)
        if not all(math.isfinite(v) and v >= 0 for v in measured):
            raise PlanError(f"stage {k} has a negative or non-finite measured time or size; measure it again")
    if len(stages) > n_layers:
        raise PlanError(f"{len(stages)} pipeline stages for {n_layers} layers: each stage needs a layer; lower "
                        "parallelism.pipeline_stages")
    return n_layers


def _no_fit(stages: Sequence[StageCosts], n_layers: int) -> PlanError:
    """The refusal when no contiguous split fits every stage's memory, naming the shortfall."""
    n_stages = len(stages)
    need = stages[0].bytes(0, n_layers, True, True)
    have = sum(s.memory_bytes for s in stages)
    shortfall = f"it needs {need / GIB:.1f} GiB and the {n_stages} stage(s) hold {have / GIB:.1f} GiB in all"
    for i in range(n_layers):  # a layer no stage that could run it can hold, even alone, is the likeliest cause
        able = [k for k in range(n_stages) if k <= i <= n_layers - n_stages + k]
        if not any(stages[k].fits(i, i + 1, k == 0, k == n_stages - 1) for k in able):
            k = min(able, key=lambda k: stages[k].bytes(i, i + 1, k == 0, k == n_stages - 1) - stages[k].memory_bytes)
            shortfall = (f"layer {i} alone needs {stages[k].bytes(i, i + 1, k == 0, k == n_stages - 1) / GIB:.1f} "
                         f"GiB on stage {k}, which holds {stages[k].memory_bytes / GIB:.1f} GiB ({shortfall})")
            break
    return PlanError(f"the model does not fit: {shortfall}; add pipeline stages, or lower "
                     "--training.micro_batch_size")


def _choices(stages: Sequence[StageCosts], n_layers: int, s: int, lo: int, bound: float) -> Iterator[tuple[int, float]]:
    """(hi, time) for each way stage s can take layers lo..hi-1, fit in its memory and take no
    longer than `bound`, leaving a layer for each later stage. Running sums: O(L) per call."""
    stage, n_stages = stages[s], len(stages)
    first, last = s == 0, s == n_stages - 1
    span_s = span_b = 0.0
    for hi in range(lo + 1, n_layers - (n_stages - s - 1) + 1):
        span_s += stage.layer_s[hi - 1]
        span_b += stage.layer_bytes[hi - 1] if stage.layer_bytes else 0.0
        t = _with_extras(span_s, stage.first_extra_s, stage.last_extra_s, first, last)
        b = _with_extras(span_b, stage.first_extra_bytes, stage.last_extra_bytes, first, last)
        if b > stage.memory_bytes or t > bound:
            return  # more layers only cost more
        if not last or hi == n_layers:
            yield hi, t


def _slowest_stage_s(stages: Sequence[StageCosts], n_layers: int) -> float:
    """The smallest achievable slowest-stage time (minimax DP, O(S x L^2); inf when nothing fits)."""
    n_stages = len(stages)
    # best[s][lo]: the smallest slowest-stage time for layers lo.. over stages s..
    best = [[math.inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[n_stages][n_layers] = 0.0
    for s in range(n_stages - 1, -1, -1):
        for lo in range(s, n_layers - (n_stages - s) + 1):
            best[s][lo] = min((max(t, best[s + 1][hi]) for hi, t in _choices(stages, n_layers, s, lo, math.inf)),
                              default=math.inf)
    return best[0][0]


def split_layers(stages: Sequence[StageCosts]) -> StageSplit:
    """The contiguous split minimising the slowest stage's time under each stage's memory,
    exactly, with the module docstring's tie-break. Two DPs over (stage, first layer): the
    first finds the smallest slowest-stage time; the second, over splits no slower than it,
    the smallest exact sum of squares. Its ties are between different first-stage sizes, so
    the smaller first size is the lexicographically smaller tuple. O(S x L^2) steps, fewer as
    stages stop at the bound or their memory; the second DP's exact Fraction sums cost a few
    microseconds each (0.06 s in all at S = 16, L = 128 on one CPU core; 0.25 s at 32, 256)."""
    n_layers, n_stages = _check_stages(stages), len(stages)
    bound = _slowest_stage_s(stages, n_layers)
    if math.isinf(bound):
        raise _no_fit(stages, n_layers)
    # best[s][lo]: (exact sum of squares, this stage's end, its time) of the best split of layers lo.. over stages s..
    Best = tuple[Fraction, int, float]
    best: list[list[Best | None]] = [[None] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[n_stages][n_layers] = (Fraction(0), n_layers, 0.0)
    for s in range(n_stages - 1, -1, -1):
        for lo in range(s, n_layers - (n_stages - s) + 1):
            for hi, t in _choices(stages, n_layers, s, lo, bound):
                rest = best[s + 1][hi]
                if rest is None:
                    continue
                here = (Fraction(t) ** 2 + rest[0], hi, t)
                current = best[s][lo]
                if current is None or here[:2] < current[:2]:
                    best[s][lo] = here
    layers, times, lo = [], [], 0
    for s in range(n_stages):
        found = best[s][lo]
        assert found is not None  # the minimax DP found a split within the bound
        layers.append(found[1] - lo)
        times.append(found[2])
        lo = found[1]
    return StageSplit(tuple(layers), tuple(times))


def split_layers_brute(stages: Sequence[StageCosts]) -> StageSplit:
    """Every contiguous split tried, ranked by split_layers' key: (slowest stage, exact sum of
    squares, layer tuple). For tests: C(L-1, S-1) splits."""
    n_layers, n_stages = _check_stages(stages), len(stages)
    best: tuple[tuple[float, Fraction, tuple[int, ...]], StageSplit] | None = None
    for layers in compositions(n_layers, n_stages):
        flags = [(k == 0, k == n_stages - 1) for k in range(n_stages)]
        ranges = list(StageSplit(layers, ()).ranges())
        if not all(st.fits(lo, hi, *f) for st, (lo, hi), f in zip(stages, ranges, flags)):
            continue
        times = tuple(st.time(lo, hi, *f) for st, (lo, hi), f in zip(stages, ranges, flags))
        key = (max(times), sum((Fraction(t) ** 2 for t in times), Fraction(0)), layers)
        if best is None or key < best[0]:
            best = (key, StageSplit(layers, times))
    if best is None:
        raise _no_fit(stages, n_layers)
    return best[1]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a GPipe or 1F1B step: (S - 1) / (M + S - 1)."""
    if stages < 1 or micro_batches < 1:
        raise PlanError(f"a pipeline needs at least one stage and one micro-batch, not {stages} and {micro_batches}")
    return (stages - 1) / (micro_batches + stages - 1)


def predict_pipeline_step_s(split: StageSplit, num_micro_batches: int, schedule: str = "1f1b",
                            stages_per_rank: int = 1) -> float:
    """(M + S - 1) x the slowest stage's micro-batch time: the standard bubble model for GPipe
    and 1F1B alike (both fill and drain the pipeline once per step; 1F1B holds fewer
    activations, not less time). Interleaved, with V stages per rank on R ranks (stage k on
    rank k % R): (M + (R - 1) / V) x the busiest rank's time for its V stages, the bubble
    (R - 1) / (V M + R - 1). An approximation: it counts every stage at the slowest's pace
    during fill and drain, and leaves out the sends between stages and the optimizer step."""
    if schedule not in SCHEDULES:
        raise PlanError(f"no step-time model for schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if num_micro_batches < 1:
        raise PlanError(f"a pipeline step needs at least one micro-batch, not {num_micro_batches}")
    if stages_per_rank == 1:
        return (num_micro_batches + len(split.layers) - 1) * split.bottleneck_s
    ranks = len(split.layers) // stages_per_rank
    busiest = max(math.fsum(split.stage_s[r::ranks]) for r in range(ranks))
    return (num_micro_batches + (ranks - 1) / stages_per_rank) * busiest


@dataclass(frozen=True)
class IslandPlan:
    """What the planner chose: a batch split, and a stage split when the island pipelines."""

    batch: BatchSplit
    stages: StageSplit | None = None
    pipeline_micro_batches: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1  # interleaved_1f1b: stage k on pipeline rank k % (stages / stages_per_rank)

    @property
    def step_s(self) -> float:
        """The predicted step time: the slowest rank's, or the pipeline's bubble model."""
        if self.stages is None:
            return self.batch.step_s
        return predict_pipeline_step_s(self.stages, self.pipeline_micro_batches, self.schedule, self.stages_per_rank)

    @property
    def bubble(self) -> float:
        """The pipeline's modelled idle share of a step (0 without a pipeline)."""
        if self.stages is None:
            return 0.0
        ranks = len(self.stages.layers) // self.stages_per_rank
        return bubble_fraction(ranks, self.stages_per_rank * self.pipeline_micro_batches)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _name(names: Sequence[str], k: int, fallback: str) -> str:
    return names[k] if k < len(names) else fallback


def explain(plan: IslandPlan, rank_names: Sequence[str], stage_names: Sequence[str] | None = None) -> str:
    """The plan in plain words and numbers: one line per stage and per rank, then the
    predicted step time. rank_names[k] names the device of rank k (and of stage k, unless
    `stage_names` are given)."""
    stage_names = rank_names if stage_names is None else stage_names
    lines = []
    if plan.stages is not None:
        s = plan.stages
        lines.append(f"pipeline of {len(s.layers)} stages, {plan.pipeline_micro_batches} micro-batches per step "
                     f"({plan.schedule}), bubble {plan.bubble:.0%}:")
        for k, ((lo, hi), t, idle) in enumerate(zip(s.ranges(), s.stage_s, s.idle)):
            lines.append(f"  stage {k} ({_name(stage_names, k, f'rank {k}')}): layers {lo}-{hi - 1}, {_ms(t)} per "
                         f"micro-batch, idle {idle:.0%}")
    b = plan.batch
    total = sum(b.samples)
    lines.append(f"batch of {total} samples:")
    for r, (size, count, t, idle) in enumerate(zip(b.micro_batch_size, b.num_micro_batches, b.rank_s, b.idle)):
        lines.append(f"  rank {r} ({_name(rank_names, r, 'unnamed')}): {size} samples x {count} micro-batches = "
                     f"{size * count} of {total} samples, {_ms(t)} per step, idle {idle:.0%}")
    if b.fsdp and plan.stages is None:
        lockstep = max(size * t for size, t in zip(b.micro_batch_size, b.sample_s))
        lines.append(f"  (FSDP: the ranks meet at every block of their first forward and last backward, "
                     f"{_ms(lockstep)} at the slowest micro-batch's pace, and run the rest each alone)")
    lines.append(f"predicted step time {_ms(plan.step_s)}")
    return "\n".join(lines)


def _csv(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def to_toml(plan: IslandPlan) -> str:
    """The plan as a TOML fragment of our `[parallelism]` keys, each value a comma-separated
    string (the form parse_counts and the config read)."""
    lines = ["[parallelism]"]
    if plan.stages is not None:
        lines.append(f'stage_layers = "{_csv(plan.stages.layers)}"')
        lines.append(f"pipeline_micro_batches = {plan.pipeline_micro_batches}")
    if plan.stages is None:  # a pipeline's batch is cut by pipeline_micro_batches
        lines.append(f'micro_batch_size_per_rank = "{_csv(plan.batch.micro_batch_size)}"')
        lines.append(f'num_micro_batches_per_rank = "{_csv(plan.batch.num_micro_batches)}"')
    return "\n".join(lines) + "\n"
