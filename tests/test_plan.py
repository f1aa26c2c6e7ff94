"""The planner's solvers against brute force, and its outputs (explanation, TOML, counts)."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest
import tomllib

from archipelago.island.plan import (
    BatchSplit,
    IslandPlan,
    PlanError,
    RankSpeed,
    StageCosts,
    bubble_fraction,
    calibrate,
    explain,
    fsdp_step_s,
    parse_counts,
    predict_pipeline_step_s,
    split_batch,
    split_batch_brute,
    split_batch_fsdp,
    split_batch_sized,
    split_layers,
    split_layers_brute,
    to_toml,
)
from archipelago.island.profile import RankProfile

GIB = 2**30


def _random_stages(rng: random.Random, layers: int, stages: int, memory: bool, whole: bool) -> list[StageCosts]:
    """Unlike devices on one model; `whole`: costs in whole seconds, so many splits tie exactly."""
    def cost(lo: float, hi: float) -> float:
        return float(rng.randint(int(lo), int(hi) + 1)) if whole else rng.uniform(lo, hi)

    base = [cost(0.5, 2.0) for _ in range(layers)]
    weights = [float(rng.randint(1, 4)) for _ in range(layers)]
    out = []
    for _ in range(stages):
        speed = rng.choice([0.5, 1.0, 1.0, 2.0, 3.0])  # seconds multiplier: unlike devices
        out.append(StageCosts(tuple(b * speed for b in base), first_extra_s=cost(0, 1), last_extra_s=cost(0, 2),
                              memory_bytes=rng.uniform(3, 12) if memory else float("inf"),
                              layer_bytes=tuple(weights), first_extra_bytes=1.0, last_extra_bytes=1.0))
    return out


def _count_splits_at(stages: list[StageCosts], bottleneck_s: float) -> int:
    """How many contiguous splits fit memory and reach this slowest-stage time (the tie-break's work)."""
    n_layers, last = len(stages[0].layer_s), len(stages) - 1
    count = 0
    for cuts in itertools.combinations(range(1, n_layers), last):
        bounds = (0, *cuts, n_layers)
        spans = list(zip(bounds, bounds[1:]))
        if all(st.fits(lo, hi, k == 0, k == last) for k, (st, (lo, hi)) in enumerate(zip(stages, spans))):
            count += max(st.time(lo, hi, k == 0, k == last) for k, (st, (lo, hi)) in enumerate(zip(stages, spans))) \
                == bottleneck_s
    return count


def test_the_layer_split_equals_brute_force_with_binding_memory_infeasible_cases_and_ties():
    rng = random.Random(0)
    seen = {"infeasible": 0, "memory binds": 0, "several best splits": 0}
    for case in range(600):
        layers = rng.randint(1, 8)
        stages = _random_stages(rng, layers, rng.randint(1, min(4, layers)), memory=case % 2 == 0,
                                whole=case % 3 == 0)
        try:
            expected = split_layers_brute(stages)
        except PlanError as exc:
            assert "does not fit" in str(exc)
            with pytest.raises(PlanError, match="does not fit"):
                split_layers(stages)
            seen["infeasible"] += 1
            continue
        got = split_layers(stages)
        assert got == expected  # the same split, by the same tie-break, not only the same bottleneck
        assert sum(got.layers) == layers and min(got.layers) >= 1 and len(got.layers) == len(stages)
        for k, (stage, (lo, hi)) in enumerate(zip(stages, got.ranges())):
            assert stage.fits(lo, hi, k == 0, k == len(stages) - 1)
        unlimited = [StageCosts(s.layer_s, s.first_extra_s, s.last_extra_s) for s in stages]
        seen["memory binds"] += split_layers(unlimited).bottleneck_s < got.bottleneck_s
        seen["several best splits"] += _count_splits_at(stages, got.bottleneck_s) > 1
    assert min(seen.values()) >= 20, seen  # every kind of case was exercised


def test_the_layer_split_beats_random_splits_at_model_scale():
    rng = random.Random(7)
    n_layers, n_stages = 48, 6
    stages = _random_stages(rng, n_layers, n_stages, memory=False, whole=False)
    best = split_layers(stages)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, n_layers), n_stages - 1))
        bounds = (0, *cuts, n_layers)
        spans = enumerate(zip(bounds, bounds[1:]))
        times = [stages[k].time(lo, hi, k == 0, k == n_stages - 1) for k, (lo, hi) in spans]
        assert best.bottleneck_s <= max(times)


def test_a_slower_stage_gets_fewer_layers_and_every_stage_a_layer():
    fast, slow = StageCosts((1.0,) * 6), StageCosts((2.0,) * 6)
    split = split_layers([fast, slow])
    assert split.layers == (4, 2) and split.stage_s == (4.0, 4.0) and split.bottleneck_s == 4.0
    assert split.idle == (0.0, 0.0)
    assert split_layers([slow, fast]).layers == (2, 4)
    # 5 layers cannot balance: (3, 2) takes (3, 4) s and (4, 1) takes (4, 2) s, both a 4 s bottleneck;
    # the tie-break's smaller sum of squares (20 against 25) keeps the slow device idle, not busy.
    uneven = split_layers([StageCosts((1.0,) * 5), StageCosts((2.0,) * 5)])
    assert uneven.layers == (4, 1) and uneven.idle == (0.0, 0.5)
    with pytest.raises(PlanError, match="each stage needs a layer"):
        split_layers([fast] * 7)


def test_the_embedding_and_head_count_on_the_first_and_last_stage():
    stages = [StageCosts((1.0,) * 6, first_extra_s=2.0, last_extra_s=2.0)] * 2
    split = split_layers(stages)
    assert split.layers == (3, 3) and split.stage_s == (5.0, 5.0)
    head_heavy = [StageCosts((1.0,) * 6, last_extra_s=4.0)] * 2
    assert split_layers(head_heavy).layers == (5, 1)


def test_a_split_that_does_not_fit_memory_is_refused_naming_the_fix():
    stages = [StageCosts((1.0,) * 4, memory_bytes=2 * GIB, layer_bytes=(GIB,) * 4)] * 2
    assert split_layers(stages).layers == (2, 2)
    lopsided = [StageCosts((1.0,) * 4, memory_bytes=3 * GIB, layer_bytes=(GIB,) * 4),
                StageCosts((3.0,) * 4, memory_bytes=1 * GIB, layer_bytes=(GIB,) * 4)]
    assert split_layers(lopsided).layers == (3, 1)  # memory, not speed, decides: (2, 2) would be faster
    small = [StageCosts((1.0,) * 4, memory_bytes=1.5 * GIB, layer_bytes=(GIB,) * 4)] * 2
    with pytest.raises(PlanError, match=r"needs 4.0 GiB and the 2 stage\(s\) hold 3.0 GiB in all; add pipeline stages"):
        split_layers(small)
    big_layer = [StageCosts((1.0,) * 4, memory_bytes=10 * GIB, layer_bytes=(GIB, GIB, 12 * GIB, GIB))] * 2
    with pytest.raises(PlanError, match="layer 2 alone needs 12.0 GiB on stage .*; add pipeline stages"):
        split_layers(big_layer)
    with pytest.raises(PlanError, match="same model"):
        split_layers([StageCosts((1.0,) * 4), StageCosts((1.0,) * 3)])
    with pytest.raises(PlanError, match="negative or non-finite"):
        split_layers([StageCosts((1.0, -1.0))])


def _brute_makespan(ranks: list[RankSpeed], batch: int) -> float:
    """The smallest step time over every split (independent of split_batch_brute)."""
    return min(max(n * r.sample_s for n, r in zip(samples, ranks))
               for samples in itertools.product(range(1, batch + 1), repeat=len(ranks)) if sum(samples) == batch)


def test_the_batch_split_reaches_brute_forces_step_time():
    rng = random.Random(100)
    for _ in range(200):
        ranks = [RankSpeed(rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) * rng.uniform(0.9, 1.1), rng.choice([0, 0, 3, 5]))
                 for _ in range(rng.randint(1, 4))]
        batch = rng.randint(len(ranks), 12)
        got = split_batch(ranks, batch)
        assert sum(got.samples) == batch and min(got.samples) >= 1
        assert got.step_s == _brute_makespan(ranks, batch) == split_batch_brute(ranks, batch).step_s
        for size, count, rank in zip(got.micro_batch_size, got.num_micro_batches, ranks):
            cap = rank.max_micro_batch or size * count
            assert size <= cap  # fits, in the fewest equal micro-batches that do
            assert not any((size * count) % fewer == 0 and (size * count) // fewer <= cap for fewer in range(1, count))


def test_the_batch_split_equals_brute_force_where_times_are_exact():
    rng = random.Random(200)  # speeds in eighths of a second: every product and sum exact, so ties are real
    for _ in range(300):
        ranks = [RankSpeed(rng.randint(1, 24) / 8, rng.choice([0, 2, 3, 5])) for _ in range(rng.randint(1, 4))]
        batch = rng.randint(len(ranks), 16)
        assert split_batch(ranks, batch) == split_batch_brute(ranks, batch)


def test_a_rank_twice_as_slow_gets_a_third_of_the_batch():
    # 21 + 11 ends at max(21, 22) = 22 and 22 + 10 at max(22, 20) = 22; 20 + 12 at 24, 23 + 9 at 23.
    # The tie goes to the faster rank: the same step in fewer device-seconds.
    split = split_batch([RankSpeed(1.0), RankSpeed(2.0)], 32)
    assert split.samples == (22, 10) and split.step_s == 22.0 and split.idle == (0.0, pytest.approx(1 / 11))
    assert split_batch([RankSpeed(2.0), RankSpeed(1.0)], 32).samples == (10, 22)
    capped = split_batch([RankSpeed(1.0, max_micro_batch=6), RankSpeed(2.0, max_micro_batch=4)], 32)
    assert capped.micro_batch_size == (2, 2) and capped.num_micro_batches == (11, 5)  # 22 = 2 x 11, 10 = 2 x 5
    assert split_batch([RankSpeed(1.0, max_micro_batch=4)], 7).num_micro_batches == (7,)  # a prime share: ones
    with pytest.raises(PlanError, match="raise it to at least 3"):
        split_batch([RankSpeed(1.0)] * 3, 2)
    with pytest.raises(PlanError, match="rank 1 has no positive measured time"):
        split_batch([RankSpeed(1.0), RankSpeed(0.0)], 4)


def _sized_rank(rng: random.Random) -> RankSpeed:
    """Times per sample in eighths of a second at sizes 1, 2, 4 and 8: every interpolated
    time, product and sum is exact in floats, so ties are real."""
    times = tuple((size, rng.randint(4, 24) / 8) for size in (1, 2, 4, 8))
    return RankSpeed(times[-1][1], rng.choice([0, 0, 3, 6]), times)


def _exhaustive_sized(ranks: list[RankSpeed], batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every share of the batch and every equal micro-batch size of every share: the split
    with the smallest step, then least busy time, then larger shares first; each rank's
    fastest size, the larger on a tie. Shares and sizes, independent of the planner's solver."""
    best = None
    for samples in itertools.product(range(1, batch + 1), repeat=len(ranks)):
        if sum(samples) != batch:
            continue
        picks = []
        for n, rank in zip(samples, ranks):
            cap = rank.max_micro_batch or n
            picks.append(min((n * rank.sample_s_at(b), -b) for b in range(1, n + 1) if n % b == 0 and b <= cap))
        times = [t for t, _ in picks]
        key = (max(times), math.fsum(times), tuple(-n for n in samples))
        if best is None or key < best[0]:
            best = (key, samples, tuple(-b for _, b in picks))
    assert best is not None
    return best[1], best[2]


def test_times_per_sample_are_interpolated_between_the_measured_micro_batch_sizes():
    rank = RankSpeed(2.0, sample_s_by_size=((1, 1.0), (4, 1.6), (8, 2.0)))
    assert [rank.sample_s_at(b) for b in (1, 2, 4, 6, 8, 32)] == [1.0, 1.2, 1.6, 1.8, 2.0, 2.0]
    assert RankSpeed(0.5).sample_s_at(7) == 0.5 and RankSpeed(0.5, 0, ((4, 1.0),)).sample_s_at(7) == 0.5
    with pytest.raises(PlanError, match="increasing sizes; measure it again"):
        split_batch([RankSpeed(1.0, 0, ((4, 1.0), (2, 1.0)))], 4)
    with pytest.raises(PlanError, match="rank 1's times by micro-batch size"):
        split_batch([RankSpeed(1.0), RankSpeed(1.0, 0, ((1, 1.0), (2, 0.0)))], 4)


def test_the_sized_batch_split_equals_an_exhaustive_search_over_shares_and_sizes():
    rng = random.Random(300)
    for _ in range(150):
        ranks = [_sized_rank(rng) if rng.random() < 0.8 else RankSpeed(rng.randint(4, 24) / 8)
                 for _ in range(rng.randint(1, 3))]
        batch = rng.randint(len(ranks), 14)
        got = split_batch(ranks, batch)
        samples, sizes = _exhaustive_sized(ranks, batch)
        assert (got.samples, got.micro_batch_size) == (samples, sizes), (ranks, batch)
        assert got == split_batch_brute(ranks, batch) or not any(len(r.sample_s_by_size) > 1 for r in ranks)
        assert got.step_s == max(n * r.sample_s_at(b) for n, b, r in zip(got.samples, got.micro_batch_size, ranks))


def test_a_rank_faster_at_small_micro_batches_takes_its_share_in_them():
    # A CPU-like rank: 1.0 s per sample up to micro-batches of 8, 1.25 s at 16; the other 2x slower.
    cpu = ((1, 1.0), (8, 1.0), (16, 1.25))
    ranks = [RankSpeed(1.25, 0, cpu), RankSpeed(2.5, 0, tuple((b, 2 * t) for b, t in cpu))]
    split = split_batch_sized(ranks, 48)
    assert split.samples == (32, 16) and split.step_s == 32.0  # 4 x 8 and 2 x 8: a third to the slow rank
    assert split.micro_batch_size == (8, 8) and split.num_micro_batches == (4, 2)
    # Planned from one time per sample (at an even share of 24), both ranks take one micro-batch each
    # and the step costs 25% more at the sizes' real times.
    linear = split_batch([RankSpeed(r.sample_s_at(24)) for r in ranks], 48)
    assert linear.micro_batch_size == (32, 16) and linear.num_micro_batches == (1, 1)
    assert max(n * r.sample_s_at(n) for n, r in zip(linear.samples, ranks)) == 40.0


def _fsdp_step(ranks: list[RankSpeed], samples: tuple[int, ...], sizes: tuple[int, ...]) -> float:
    """The FSDP step model written out: the slowest micro-batch (first forward and last
    backward in lockstep) plus the longest time a rank runs alone."""
    micro = [b * r.sample_s_at(b) for b, r in zip(sizes, ranks)]
    return max(micro) + max(n * r.sample_s_at(b) - m for n, b, r, m in zip(samples, sizes, ranks, micro))


def test_the_fsdp_step_model_counts_one_micro_batch_in_lockstep():
    fast, slow = RankSpeed(1.0), RankSpeed(2.0)
    assert fsdp_step_s([24, 48], [24, 48]) == 48  # one micro-batch each: the slow rank's whole step
    assert split_batch([fast, slow], 48).samples == (32, 16)
    # 32 and 16 in micro-batches of 8: both end their own micro-batches at 24, then the
    # slow rank's 16 s micro-batch paces the lockstep: 40 s, each rank idle a fifth.
    planned = dict(micro_batch_size=(8, 8), num_micro_batches=(4, 2), sample_s=(1.0, 2.0), fsdp=True)
    assert BatchSplit(**planned).step_s == 40 and BatchSplit(**planned).idle == pytest.approx((0.2, 0.2))
    assert BatchSplit((12, 4), (3, 3), (1.0, 2.0), fsdp=True).step_s == 36  # 12 + max(24, 16)
    best = split_batch([fast, slow], 48, fsdp=True)
    # Times per sample that do not depend on the size: micro-batches as small as can be, of
    # equal time on both ranks (2 and 1 samples, 2 s), leave 30 s alone each: 32 s, no idle.
    assert best.fsdp and best.samples == (32, 16) and best.micro_batch_size == (2, 1) and best.step_s == 32


def test_the_fsdp_split_reaches_an_exhaustive_searchs_step_time():
    rng = random.Random(400)
    for _ in range(150):
        ranks = [_sized_rank(rng) if rng.random() < 0.7 else RankSpeed(rng.randint(4, 24) / 8, rng.choice([0, 2]))
                 for _ in range(rng.randint(1, 3))]
        batch = rng.randint(len(ranks), 12)
        got = split_batch_fsdp(ranks, batch)
        assert sum(got.samples) == batch and min(got.samples) >= 1
        for n, b, rank in zip(got.samples, got.micro_batch_size, ranks):
            assert n % b == 0 and b <= (rank.max_micro_batch or b)
        exhaustive = math.inf
        for samples in itertools.product(range(1, batch + 1), repeat=len(ranks)):
            if sum(samples) == batch:
                cuts = [[b for b in range(1, n + 1) if n % b == 0 and b <= (r.max_micro_batch or b)]
                        for n, r in zip(samples, ranks)]
                for sizes in itertools.product(*cuts):
                    exhaustive = min(exhaustive, _fsdp_step(ranks, samples, sizes))
        assert got.step_s == exhaustive == _fsdp_step(ranks, got.samples, got.micro_batch_size), (ranks, batch)


def test_an_fsdp_island_of_cpu_like_ranks_takes_mid_sized_micro_batches():
    # Seconds per sample as a CPU measured them (fastest at 6-12, slower at 1 and at 24);
    # the second rank twice as slow at every size.
    cpu = ((1, 1.2), (6, 1.04), (12, 1.0), (24, 1.08))
    ranks = [RankSpeed(1.08, 0, cpu), RankSpeed(2.16, 0, tuple((b, 2 * t) for b, t in cpu))]
    plan = split_batch(ranks, 48, fsdp=True)
    whole = BatchSplit((32, 16), (1, 1), (ranks[0].sample_s_at(32), ranks[1].sample_s_at(16)), fsdp=True)
    hand = BatchSplit((12, 4), (3, 3), (ranks[0].sample_s_at(12), ranks[1].sample_s_at(4)), fsdp=True)
    assert plan.step_s < min(hand.step_s, whole.step_s)
    assert 1 < plan.micro_batch_size[1] < plan.samples[1] and plan.samples[0] > plan.samples[1]


def test_the_micro_batch_sizes_timed_are_fractions_of_the_share_within_memory():
    import torch
    from torch import nn

    from archipelago.island.profile import candidate_sizes, measure_sizes

    assert candidate_sizes(24) == (1, 6, 12, 24) and candidate_sizes(24, cap=10) == (1, 6)
    assert candidate_sizes(1) == (1,) and candidate_sizes(3) == (1, 3)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    batch = (torch.randn(12, 16), torch.randint(0, 4, (12,)))
    timed = measure_sizes(model, batch, nn.functional.cross_entropy, torch.device("cpu"), (1, 6, 12), slowdown=2.0)
    assert [size for size, _ in timed] == [1, 6, 12] and all(t > 0 for _, t in timed)
    assert all(p.grad is None for p in model.parameters())  # timing leaves no gradient behind


def test_bubble_model():
    split = split_layers([StageCosts((1.0,) * 4), StageCosts((1.0,) * 4)])
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5) and bubble_fraction(1, 8) == 0.0
    assert predict_pipeline_step_s(split, 4, "gpipe") == predict_pipeline_step_s(split, 4, "1f1b") == 5 * 2.0
    with pytest.raises(PlanError, match="use one of gpipe, 1f1b"):
        predict_pipeline_step_s(split, 4, "interleaved")
    plan = IslandPlan(split_batch([RankSpeed(1.0)], 8), split, pipeline_micro_batches=4)
    assert plan.step_s == 10.0


@pytest.mark.parametrize(("text", "expected", "values"), [
    ("6,2", 2, (6, 2)), (" 6, 2 ", 2, (6, 2)), ("1 6 1 2", 2, (6, 2)), ("2 3", 2, (3, 3)), ("7", 1, (7,)),
    ("2 4 1 8", 3, (4, 4, 8)),
])
def test_counts_are_read_in_our_form_and_synerfuses(text, expected, values):
    assert parse_counts(text, expected, "parallelism.stage_layers") == values


@pytest.mark.parametrize(("text", "expected"), [
    ("6,2", 3), ("2 3", 3), ("1 6 1", 2), ("6,0", 2), ("6,-2", 2), ("a,b", 2), ("", 1), ("1.5,2", 2), ("0 4 2 3", 2),
])
def test_bad_counts_are_refused_naming_both_forms(text, expected):
    with pytest.raises(PlanError, match="parallelism.stage_layers") as refused:
        parse_counts(text, expected, "parallelism.stage_layers")
    assert '"6,2"' in str(refused.value) and '"1 6 1 2"' in str(refused.value)


def _two_rank_plan(pipelined: bool) -> IslandPlan:
    stages = split_layers([StageCosts((0.01,) * 6), StageCosts((0.02,) * 6)]) if pipelined else None
    return IslandPlan(split_batch([RankSpeed(0.01, 6), RankSpeed(0.02, 4)], 32), stages, pipeline_micro_batches=4)


def test_the_plan_is_explained_in_words_with_every_rank_and_stage():
    text = explain(_two_rank_plan(True), ["cpu", "cpu (EMULATED 2x)"])
    assert "stage 0 (cpu): layers 0-3, 40.0 ms per micro-batch, idle 0%" in text
    assert "stage 1 (cpu (EMULATED 2x)): layers 4-5, 40.0 ms per micro-batch" in text
    assert "rank 0 (cpu): 2 samples x 11 micro-batches = 22 of 32 samples, 220.0 ms per step, idle 0%" in text
    assert ("rank 1 (cpu (EMULATED 2x)): 2 samples x 5 micro-batches = 10 of 32 samples, 200.0 ms per step, "
            "idle 9%") in text
    assert "predicted step time 200.0 ms" in text  # the pipeline's: (4 + 2 - 1) x 40 ms
    plain = explain(_two_rank_plan(False), ["cuda H100", "cuda A100"])
    assert "stage" not in plain and "rank 0 (cuda H100)" in plain and "rank 1 (cuda A100)" in plain
    assert "predicted step time 220.0 ms" in plain


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_toml_fragment_parses_and_round_trips_through_parse_counts(pipelined):
    plan = _two_rank_plan(pipelined)
    text = to_toml(plan)
    fragment = tomllib.loads(text)["parallelism"]
    if pipelined:  # a pipeline's batch is cut by pipeline_micro_batches (the config refuses per-rank shares)
        assert plan.stages is not None
        assert set(fragment) == {"stage_layers", "pipeline_micro_batches"}
        assert parse_counts(fragment["stage_layers"], 2, "stage_layers") == plan.stages.layers == (4, 2)
        return
    assert set(fragment) == {"micro_batch_size_per_rank", "num_micro_batches_per_rank"}
    assert 'micro_batch_size_per_rank = "2,2"' in text and 'num_micro_batches_per_rank = "11,5"' in text
    assert parse_counts(fragment["micro_batch_size_per_rank"], 2, "x") == plan.batch.micro_batch_size
    assert parse_counts(fragment["num_micro_batches_per_rank"], 2, "x") == plan.batch.num_micro_batches


@pytest.mark.timeout(400)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_plan_gives_an_emulated_slow_rank_fewer_samples_and_auto_trains_with_it(shakespeare, tmp_path):
    from conftest import TINY, run_cli

    out = tmp_path / "plan.toml"
    planned = run_cli(["plan", *TINY, "--nproc", "2", "--training.batch_size", "12", "--island.rank_slowdown", "1,2",
                       "--out", str(out)], timeout=300)
    assert planned.returncode == 0, planned.output[-3000:]
    assert "EMULATED 2x slower" in planned.output and "predicted step time" in planned.output
    fragment = tomllib.loads(out.read_text())["parallelism"]
    sizes = parse_counts(fragment["micro_batch_size_per_rank"], 2, "x")
    counts = parse_counts(fragment["num_micro_batches_per_rank"], 2, "x")
    samples = [s * c for s, c in zip(sizes, counts)]
    assert sum(samples) == 12 and samples[1] < samples[0], samples
    trained = run_cli(["train", *TINY, "--nproc", "2", "--training.steps", "3", "--training.val_every", "0",
                       "--checkpoint.no_enable", "--parallelism.auto", "--island.rank_slowdown", "1,2",
                       "--job.run_dir", str(tmp_path / "auto")], timeout=300)
    assert trained.returncode == 0, trained.output[-3000:]
    assert "parallelism.auto: rank 1 (cpu (EMULATED 2x slower))" in trained.output
    piped = run_cli(["train", *TINY, "--nproc", "2", "--training.steps", "3", "--training.val_every", "0",
                     "--checkpoint.no_enable", "--parallelism.pipeline_stages", "2", "--parallelism.auto",
                     "--island.rank_slowdown", "1,2", "--job.run_dir", str(tmp_path / "piped")], timeout=300)
    assert piped.returncode == 0, piped.output[-3000:]
    stage0 = re.search(r"pipeline of 2 stages \(stage 0: layers 0-(\d+), stage 1", piped.output)
    assert stage0 and int(stage0.group(1)) + 1 > 3, piped.output[-3000:]  # the fast stage takes more of the 6
    # Interleaved, 2 stages per rank: the fast rank's two stages hold more of the 6 layers.
    interleaved = run_cli(["train", *TINY, "--nproc", "2", "--training.steps", "3", "--training.val_every", "0",
                           "--checkpoint.no_enable", "--parallelism.pipeline_stages", "2", "--parallelism.auto",
                           "--parallelism.pipeline_schedule", "interleaved_1f1b", "--parallelism.stages_per_rank",
                           "2", "--island.rank_slowdown", "1,2", "--job.run_dir", str(tmp_path / "interleaved")],
                          timeout=300)
    assert interleaved.returncode == 0, interleaved.output[-3000:]
    spans = re.findall(r"stage \d \(rank (\d)\): layers (\d+)-(\d+)", interleaved.output)
    held = [sum(int(hi) - int(lo) + 1 for r, lo, hi in spans[:4] if int(r) == rank) for rank in (0, 1)]
    assert len(spans) >= 4 and sum(held) == 6 and held[0] > held[1], interleaved.output[-3000:]


def test_a_pipelined_island_is_planned_from_its_ranks_profiles_and_the_fragment_configures_it():
    import math

    from archipelago.config import load_config
    from archipelago.island.pipeline import pipeline_layout
    from archipelago.island.profile import RankProfile
    from archipelago.planning import plan_pipeline

    def profile(rank, per_layer_s):
        return RankProfile(rank=rank, device="cpu", sample_s=6 * per_layer_s, layer_s=(per_layer_s,) * 6,
                           first_s=0.0, last_s=0.0, memory_bytes=math.inf, layer_bytes=(1.0,) * 6,
                           activation_bytes=0.0, micro_batch=4)

    plan = plan_pipeline([profile(0, 0.001), profile(1, 0.002)], global_batch=8, micro_batches=4, schedule="gpipe")
    assert plan.stages.layers == (4, 2)  # the rank twice as slow takes half as many layers
    fragment = tomllib.loads(to_toml(plan))["parallelism"]
    assert fragment == {"stage_layers": "4,2", "pipeline_micro_batches": 4}
    flags = [f"--parallelism.{k}={v}" for k, v in fragment.items()]
    cfg = load_config(["--training.batch_size", "8", "--parallelism.pipeline_stages", "2", *flags])
    assert pipeline_layout(cfg, 6, 2).layers == (4, 2)


def _profile(rank: int, per_layer_s: float, memory: float = math.inf) -> RankProfile:
    return RankProfile(rank=rank, device=f"cpu{rank}", sample_s=6 * per_layer_s, layer_s=(per_layer_s,) * 6,
                       first_s=0.0, last_s=0.0, memory_bytes=memory, layer_bytes=(1.0,) * 6,
                       activation_bytes=0.0, micro_batch=4)


def test_a_stage_sharded_over_ranks_runs_at_its_slowest_ranks_pace_and_holds_a_share_of_its_layers():
    from archipelago.planning import describe_plan, plan_pipeline

    # Pipeline rank 0 = island ranks 0 and 1 (alike); pipeline rank 1 = ranks 2 and 3, rank 3 2x slower.
    profiles = [_profile(0, 0.001), _profile(1, 0.001), _profile(2, 0.001), _profile(3, 0.002)]
    plan = plan_pipeline(profiles, global_batch=16, micro_batches=4, schedule="1f1b", data=2)
    # Each data rank's pipeline takes 16 / 2 = 8 samples in micro-batches of 2: a layer costs
    # 2 x 1 ms on stage 0 and 2 x 2 ms on stage 1 (its slow rank sets the pace).
    expected = split_layers_brute([StageCosts(layer_s=(0.002,) * 6), StageCosts(layer_s=(0.004,) * 6)])
    assert plan.stages.layers == expected.layers == (4, 2)
    assert plan.batch.samples == (8, 8)
    assert plan.step_s == pytest.approx((4 + 2 - 1) * 0.008)
    text = describe_plan(plan, profiles)
    assert "stage 1 (pipeline rank 1: cpu2 + cpu3)" in text and "data rank 1's pipeline" in text
    # Two ranks per stage hold half of each layer's weights: 6 layers (1 byte each) fit on two
    # stages of devices of 2.5 bytes; with one rank per stage they need 3 bytes a stage.
    small = [_profile(k, 0.001, memory=2.5) for k in range(4)]
    assert sum(plan_pipeline(small, 16, 4, "1f1b", data=2).stages.layers) == 6
    with pytest.raises(PlanError, match="needs"):
        plan_pipeline(small[:2], 16, 4, "1f1b")


def test_interleaved_stages_are_costed_on_their_ranks_and_the_step_uses_the_interleaved_bubble():
    from archipelago.planning import plan_pipeline

    fast, slow = _profile(0, 0.001), _profile(1, 0.002)
    plan = plan_pipeline([fast, slow], global_batch=8, micro_batches=4, schedule="interleaved_1f1b",
                         stages_per_rank=2)
    # Stages 0 and 2 on rank 0, 1 and 3 on rank 1 (micro-batches of 2 samples).
    costs = [StageCosts(layer_s=(0.002,) * 6), StageCosts(layer_s=(0.004,) * 6)] * 2
    assert plan.stages.layers == split_layers_brute(costs).layers
    ranks_layers = (plan.stages.layers[0] + plan.stages.layers[2], plan.stages.layers[1] + plan.stages.layers[3])
    assert ranks_layers[0] > ranks_layers[1]  # the fast rank holds more of the model
    busiest = max(plan.stages.stage_s[0] + plan.stages.stage_s[2], plan.stages.stage_s[1] + plan.stages.stage_s[3])
    assert plan.step_s == pytest.approx((4 + (2 - 1) / 2) * busiest)
    assert plan.bubble == pytest.approx(1 / (2 * 4 + 1))
    assert predict_pipeline_step_s(plan.stages, 4, "1f1b") == pytest.approx((4 + 4 - 1) * plan.stages.bottleneck_s)


# Re-planning from a run's measurements (calibrate, `archipelago plan --from-run`).

def _ran(times: tuple[float, ...], samples: tuple[int, ...], overhead_s: float = 0.0) -> tuple[list[float], float]:
    """What a DDP run of ranks with these true times per sample records for this split:
    each rank's idle share of the step and the step time (the slowest rank's busy time,
    plus an `overhead_s` every rank spends busy, a reduction's copies)."""
    busy = [n * t + overhead_s for n, t in zip(samples, times)]
    step = max(busy)
    return [1 - b / step for b in busy], step


@pytest.mark.parametrize("times,samples", [((0.125, 0.25), (24, 24)), ((0.125, 0.375), (32, 16)),
                                           ((0.25, 0.125, 0.5), (10, 10, 12))])
def test_calibrate_recovers_each_ranks_time_per_sample_and_the_replan_is_the_optimal_split(times, samples):
    idle, step = _ran(times, samples)
    speeds = calibrate(samples, (1,) * len(samples), idle, step)
    assert [s.sample_s for s in speeds] == pytest.approx(times, rel=1e-12)
    truth = split_batch_brute([RankSpeed(t) for t in times], sum(samples))
    replanned = split_batch(speeds, sum(samples))
    assert replanned.samples == truth.samples and replanned.step_s == pytest.approx(truth.step_s)


def test_calibrate_keeps_a_size_the_run_cut_into_several_micro_batches_as_the_cap():
    speeds = calibrate((4, 16), (6, 1), [0.0, 0.5], 2.4)
    assert [s.max_micro_batch for s in speeds] == [4, 0]  # 4 x 6 may have been memory's cut; 16 x 1 says nothing
    assert [s.sample_s for s in speeds] == pytest.approx([0.1, 0.075])


@pytest.mark.parametrize("sizes,counts,idle,step,needle", [
    ((4, 4), (1,), [0.1, 0.2], 1.0, "one of each per rank"), ((4, 4), (1, 1), [0.1, 1.0], 1.0, "idle share in [0, 1)"),
    ((4, 4), (1, 1), [0.1, 0.2], 0.0, "must be positive")])
def test_calibrate_refuses_what_does_not_describe_a_run(sizes, counts, idle, step, needle):
    with pytest.raises(PlanError, match=re.escape(needle)):
        calibrate(sizes, counts, idle, step)


def _write_run(run_dir, idle_per_record, step_s, tokens_per_step=512, log_every=2, resumed_at=None):
    """A training run's metrics.jsonl: a validation record, then step records every
    `log_every` steps whose windows took `step_s` seconds a step; from record `resumed_at`
    on, a second session (its clock, elapsed_s, starting again)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines, elapsed, started = [{"step": 0, "val_loss": 9.0, "tokens": 0}], 0.0, 1.8e9
    for k, idle in enumerate(idle_per_record, start=1):
        if k == resumed_at:  # the new session starts a minute after the old one's last record
            started, elapsed = started + elapsed + 60.0, 0.0
        elapsed += log_every * step_s[k - 1]
        lines.append({"step": k * log_every, "loss": 5.0, "tokens": k * log_every * tokens_per_step,
                      "tokens_per_s": tokens_per_step / step_s[k - 1], "rank_idle": idle, "elapsed_s": elapsed,
                      "time": started + elapsed})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_run_measurements_take_medians_of_the_step_records_after_the_first(tmp_path):
    from archipelago.planning import run_measurements

    # The first record (its window holds the warm-up) says nothing; then three windows.
    _write_run(tmp_path / "run", [[0.9, 0.0], [0.5, 0.0], [0.4, 0.1], [0.6, 0.0]], [9.0, 1.0, 2.0, 1.5])
    idle, step = run_measurements(tmp_path / "run")
    assert idle == pytest.approx([0.5, 0.0]) and step == pytest.approx(1.5)
    # A resumed run: the new session's first record holds its warm-up again, and is left out too.
    _write_run(tmp_path / "resumed", [[0.9, 0.0], [0.5, 0.0], [0.9, 0.0], [0.4, 0.1]], [9.0, 1.0, 9.0, 2.0],
               resumed_at=3)
    idle, step = run_measurements(tmp_path / "resumed")
    assert idle == pytest.approx([0.45, 0.05]) and step == pytest.approx(1.5)


def test_plan_from_run_moves_samples_to_the_rank_that_waited(tmp_path):
    """A 2:1 split of 48 that ran with the fast rank idle a third of the step (it was 3x
    faster): the re-plan gives it the 36 samples that balance the two, and the CLI prints
    and writes it."""
    from conftest import TINY, run_cli_here

    idle, step = _ran((0.125, 0.375), (32, 16))
    _write_run(tmp_path / "run", [idle] * 3, [step] * 3)
    out = tmp_path / "plan.toml"
    options = [*TINY, "--training.batch_size", "48", "--parallelism.micro_batch_size_per_rank", "32,16"]
    done = run_cli_here(["plan", *options, "--from-run", str(tmp_path / "run"), "--out", str(out)])
    assert done.returncode == 0, done.output[-2000:]
    fragment = tomllib.loads(out.read_text())["parallelism"]
    assert fragment["micro_batch_size_per_rank"] == "36,12"
    assert "rank 0: 32 x 1 samples, idle 33%, 125.00 ms per sample" in done.output
    assert "micro_batch_size_per_rank 36,12" in done.output
    # The options must be the run's: a split of 3 ranks does not describe its 2.
    wrong = run_cli_here(["plan", *options[:-2], "--parallelism.micro_batch_size_per_rank", "16,16,16",
                          "--from-run", str(tmp_path / "run"), "--out", str(out)])
    assert wrong.returncode != 0 and "give the options the run trained with" in wrong.output
    empty = run_cli_here(["plan", *options, "--from-run", str(tmp_path / "nothing"), "--out", str(out)])
    assert empty.returncode != 0 and "has no metrics.jsonl" in empty.output
    # A run directory with its config.json needs no options: the split is the run's own.
    from archipelago.config import config_to_dict, load_config

    saved = load_config(options)
    (tmp_path / "run" / "config.json").write_text(json.dumps(config_to_dict(saved)))
    alone = run_cli_here(["plan", "--from-run", str(tmp_path / "run"), "--out", str(tmp_path / "alone.toml")])
    assert alone.returncode == 0, alone.output[-2000:]
    assert tomllib.loads((tmp_path / "alone.toml").read_text()) == tomllib.loads(out.read_text())
    # A run that chose its split at start saved only `auto`: the split given replaces it.
    auto = load_config([*TINY, "--training.batch_size", "48", "--parallelism.auto"])
    (tmp_path / "run" / "config.json").write_text(json.dumps(config_to_dict(auto)))
    refused = run_cli_here(["plan", "--from-run", str(tmp_path / "run"), "--out", str(tmp_path / "auto.toml")])
    assert refused.returncode != 0 and "parallelism.auto" in refused.output
    given = run_cli_here(["plan", "--from-run", str(tmp_path / "run"), "--parallelism.micro_batch_size_per_rank",
                          "32,16", "--out", str(tmp_path / "auto.toml")])
    assert given.returncode == 0, given.output[-2000:]
    assert tomllib.loads((tmp_path / "auto.toml").read_text()) == tomllib.loads(out.read_text())
    _write_run(tmp_path / "short", [idle], [step])
    short = run_cli_here(["plan", *options, "--from-run", str(tmp_path / "short"), "--out", str(out)])
    assert short.returncode != 0 and "--metrics.log_every" in short.output


@pytest.mark.timeout(300)
@pytest.mark.slow  # a 2-rank run: make test-slow
def test_plan_from_a_real_run_gives_the_emulated_slow_rank_fewer_samples(shakespeare, tmp_path):
    from conftest import TINY, run_cli, run_cli_here

    options = [*TINY, "--training.batch_size", "12", "--island.rank_slowdown", "1,2"]
    trained = run_cli(["train", *options, "--nproc", "2", "--training.steps", "6", "--training.val_every", "0",
                       "--checkpoint.no_enable", "--metrics.log_every", "1", "--job.run_dir", str(tmp_path / "even")],
                      timeout=240)
    assert trained.returncode == 0, trained.output[-3000:]
    out = tmp_path / "plan.toml"
    replanned = run_cli_here(["plan", *options, "--from-run", str(tmp_path / "even"), "--out", str(out)])
    assert replanned.returncode == 0, replanned.output[-3000:]
    fragment = tomllib.loads(out.read_text())["parallelism"]
    sizes = parse_counts(fragment["micro_batch_size_per_rank"], 2, "x")
    counts = parse_counts(fragment["num_micro_batches_per_rank"], 2, "x")
    samples = [s * c for s, c in zip(sizes, counts)]
    assert sum(samples) == 12 and samples[1] < samples[0], replanned.output


def test_calibrate_scales_each_ranks_profile_to_what_the_run_measured_at_its_size():
    """With the profile parallelism.auto took, the run's time at the size it ran scales the
    whole curve: the profile still says which size is faster, the run how fast the rank is."""
    profile = (RankSpeed(0.1, 32, ((8, 0.12), (16, 0.1), (32, 0.11))), RankSpeed(0.2, 0, ((8, 0.24), (16, 0.2))))
    # Ran 16 x 2 and 8 x 2 in a step of 4 s: rank 0 busy 3.2 s (0.1 s a sample, as profiled),
    # rank 1 busy 4 s (0.25 s a sample at size 8, where the profile said 0.24).
    speeds = calibrate((16, 8), (2, 2), [0.2, 0.0], 4.0, profiled=profile)
    assert [n for n, _ in speeds[0].sample_s_by_size] == [8, 16, 32]
    assert [s for _, s in speeds[0].sample_s_by_size] == pytest.approx([0.12, 0.1, 0.11])
    assert speeds[0].max_micro_batch == 32 and speeds[1].sample_s_at(8) == pytest.approx(0.25)
    assert speeds[1].sample_s_at(16) == pytest.approx(0.2 * 0.25 / 0.24)
    with pytest.raises(PlanError, match="one of each per rank"):
        calibrate((16, 8), (2, 2), [0.2, 0.0], 4.0, profiled=profile[:1])
