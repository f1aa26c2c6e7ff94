"""The planner's solvers against brute force, and its outputs (explanation, TOML)."""

from __future__ import annotations

import random

import pytest
import tomllib

from archipelago.config.counts import parse_counts
from archipelago.island.plan import (
    IslandPlan,
    PlanError,
    RankSpeed,
    StageCosts,
    bubble_fraction,
    explain,
    predict_pipeline_step_s,
    split_batch,
    split_batch_brute,
    split_layers,
    split_layers_brute,
    to_toml,
)


def _random_stages(rng: random.Random, layers: int, stages: int, memory: bool) -> list[StageCosts]:
    base = [rng.uniform(0.5, 2.0) for _ in range(layers)]
    weights = [float(rng.randint(1, 4)) for _ in range(layers)]
    out = []
    for _ in range(stages):
        speed = rng.choice([0.5, 1.0, 1.0, 2.0, 3.0])  # seconds multiplier: unlike devices
        out.append(StageCosts(tuple(b * speed for b in base), first_extra_s=rng.uniform(0, 1),
                              last_extra_s=rng.uniform(0, 2),
                              memory_bytes=rng.uniform(3, 12) if memory else float("inf"),
                              layer_bytes=tuple(weights), first_extra_bytes=1.0, last_extra_bytes=1.0))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_the_layer_split_equals_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(25):
        layers = rng.randint(1, 8)
        stages = _random_stages(rng, layers, rng.randint(1, min(4, layers)), memory=rng.random() < 0.5)
        try:
            expected = split_layers_brute(stages)
        except PlanError:
            with pytest.raises(PlanError, match="does not fit"):
                split_layers(stages)
            continue
        got = split_layers(stages)
        assert got.layers == expected.layers and got.stage_s == expected.stage_s
        assert sum(got.layers) == layers and min(got.layers) >= 1
        for stage, (lo, hi), k in zip(stages, got.ranges(), range(len(stages))):
            assert stage.fits(lo, hi, k == 0, k == len(stages) - 1)


def test_a_slower_stage_gets_fewer_layers_and_every_stage_a_layer():
    fast, slow = StageCosts((1.0,) * 6), StageCosts((2.0,) * 6)
    split = split_layers([fast, slow])
    assert split.layers == (4, 2) and split.bottleneck_s == 4.0 and split.idle == (0.0, 0.0)
    assert split_layers([slow, fast]).layers == (2, 4)
    with pytest.raises(PlanError, match="each stage needs a layer"):
        split_layers([fast] * 7)


def test_a_split_that_does_not_fit_memory_is_refused_naming_the_fix():
    stages = [StageCosts((1.0,) * 4, memory_bytes=2 * 2**30, layer_bytes=(2**30,) * 4)] * 2
    assert split_layers(stages).layers == (2, 2)
    small = [StageCosts((1.0,) * 4, memory_bytes=1.5 * 2**30, layer_bytes=(2**30,) * 4)] * 2
    with pytest.raises(PlanError, match=r"needs 4.0 GiB .* hold 3.0 GiB in all; add pipeline stages"):
        split_layers(small)


@pytest.mark.parametrize("seed", range(10))
def test_the_batch_split_equals_brute_force(seed):
    rng = random.Random(100 + seed)
    for _ in range(20):
        ranks = [RankSpeed(rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) * rng.uniform(0.9, 1.1),
                           rng.choice([0, 0, 3, 5])) for _ in range(rng.randint(1, 4))]
        batch = rng.randint(len(ranks), 14)
        got, expected = split_batch(ranks, batch), split_batch_brute(ranks, batch)
        assert sum(got.samples) == batch and min(got.samples) >= 1
        assert got.step_s == pytest.approx(expected.step_s, rel=1e-12)
        for size, count, rank in zip(got.micro_batch_size, got.num_micro_batches, ranks):
            cap = rank.max_micro_batch or size * count
            assert size <= cap  # fits, in the fewest equal micro-batches that do
            assert not any((size * count) % fewer == 0 and (size * count) // fewer <= cap for fewer in range(1, count))


def test_a_rank_twice_as_slow_gets_a_third_of_the_batch():
    split = split_batch([RankSpeed(1.0), RankSpeed(2.0)], 32)
    assert split.samples == (21, 11) or split.samples == (22, 10)
    assert split.step_s == 22.0  # 21 x 1 vs 11 x 2, or 22 x 1 vs 10 x 2: both end at 22
    capped = split_batch([RankSpeed(1.0, max_micro_batch=6), RankSpeed(2.0, max_micro_batch=4)], 32)
    assert all(size <= cap for size, cap in zip(capped.micro_batch_size, (6, 4)))
    with pytest.raises(PlanError, match="raise it to at least 3"):
        split_batch([RankSpeed(1.0)] * 3, 2)


def test_bubble_model():
    split = split_layers([StageCosts((1.0,) * 4), StageCosts((1.0,) * 4)])
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert predict_pipeline_step_s(split, 4, "gpipe") == pytest.approx(5 * 2.0)


def test_the_plan_is_explained_and_written_as_toml_our_loader_reads():
    plan = IslandPlan(split_batch([RankSpeed(0.01), RankSpeed(0.02)], 32),
                      split_layers([StageCosts((0.01,) * 6), StageCosts((0.02,) * 6)]), pipeline_micro_batches=4)
    text = explain(plan, ["cpu", "cpu (EMULATED 2x)"])
    assert "stage 0 (cpu): layers 0-3" in text and "stage 1 (cpu (EMULATED 2x)): layers 4-5" in text
    assert "rank 1 (cpu (EMULATED 2x))" in text and "predicted step time" in text
    fragment = tomllib.loads(to_toml(plan))["parallelism"]
    assert parse_counts(fragment["stage_layers"], 2, "x") == plan.stages.layers
    assert parse_counts(fragment["micro_batch_size_per_rank"], 2, "x") == plan.batch.micro_batch_size
    assert parse_counts(fragment["num_micro_batches_per_rank"], 2, "x") == plan.batch.num_micro_batches


@pytest.mark.timeout(400)
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
