"""Pipeline stages inside an island: uneven layer splits reproduce one rank's training."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, assert_crash_resume_reproduces, losses, records, run_cli, run_cli_here

from archipelago.config import ConfigError, load_config
from archipelago.island.pipeline import PassThrough, keep_stage, pipeline_layout, stage_modules
from archipelago.models import build_model, get_model_args


def _layout(*flags: str, ranks: int = 2, layers: int = 6):
    return pipeline_layout(load_config(["--training.batch_size", "8", *flags]), layers, ranks)


def test_stage_layers_in_our_form_and_synerfuses_or_an_error_naming_the_fix():
    assert _layout() is None
    even = _layout("--parallelism.pipeline_stages", "2")
    assert even.layers == (3, 3) and even.micro_batches == 4 and even.schedule == "1f1b"
    assert _layout("--parallelism.pipeline_stages", "2", "--parallelism.stage_layers", "4,2").layers == (4, 2)
    assert _layout("--parallelism.pipeline_stages", "2", "--parallelism.hetero_pipeline_stages", "1 4 1 2",
                   "--parallelism.pipeline_schedule", "gpipe").layers == (4, 2)
    for flags, match in [
        (["--parallelism.stage_layers", "4,3"], "sums to 7 layers; the model has 6"),
        (["--parallelism.stage_layers", "4,1,1"], "3 entries for 2"),
        (["--parallelism.hetero_pipeline_stages", "2 3"], "one device per stage"),
        (["--parallelism.pipeline_micro_batches", "3"], "does not divide training.batch_size = 8"),
        (["--training.micro_batch_size", "2"], "pipeline_micro_batches; leave out"),
        (["--parallelism.pipeline_schedule", "interleaved_1f1b"], "needs parallelism.stages_per_rank >= 2"),
        (["--parallelism.stages_per_rank", "2"], "needs parallelism.pipeline_schedule"),
        (["--parallelism.pipeline_schedule", "interleaved_1f1b", "--parallelism.stages_per_rank", "2",
          "--parallelism.pipeline_micro_batches", "3", "--training.batch_size", "6"], "multiple of the 2 pipeline"),
        (["--parallelism.pipeline_schedule", "interleaved_1f1b", "--parallelism.stages_per_rank", "2",
          "--parallelism.stage_layers", "4,2"], "2 entries for 4"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _layout("--parallelism.pipeline_stages", "2", *flags)
    with pytest.raises(ConfigError, match="start it with --nproc 2 or 4"):
        _layout("--parallelism.pipeline_stages", "2", ranks=3)
    with pytest.raises(ConfigError, match="exceed the model's 6 layers"):
        _layout("--parallelism.pipeline_stages", "7", ranks=7)
    interleaved = _layout("--parallelism.pipeline_stages", "2", "--parallelism.pipeline_schedule", "interleaved_1f1b",
                          "--parallelism.stages_per_rank", "3")
    assert interleaved.layers == (1,) * 6 and interleaved.ranks == 2 and interleaved.stages_of(1) == [1, 3, 5]


def test_interleaved_stages_share_their_ranks_parameters_and_chain_to_the_whole_model():
    """Rank r holds stages r and r + 2 as copies of one kept model: each copy's parameters
    are the rank's own, and running the four stages in order gives the whole model's output."""
    import torch

    def model():
        torch.manual_seed(0)
        return build_model(get_model_args("llama3", "debug", vocab_size=256), device="cpu")

    layout = _layout("--parallelism.pipeline_stages", "2", "--parallelism.pipeline_schedule", "interleaved_1f1b",
                     "--parallelism.stages_per_rank", "2", "--parallelism.stage_layers", "2,1,2,1")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model()(tokens)
    ranks = [model(), model()]
    chunks = {}
    for rank, kept in enumerate(ranks):
        keep_stage(kept, rank, layout)
        own = {id(p) for p in kept.parameters()}
        for stage, chunk in zip(layout.stages_of(rank), stage_modules(kept, rank, layout)):
            assert {id(p) for p in chunk.parameters()} <= own
            chunks[stage] = chunk
    assert not isinstance(ranks[0].layers[3], PassThrough) and isinstance(ranks[0].layers[2], PassThrough)
    assert isinstance(chunks[0].layers[3], PassThrough) and not isinstance(chunks[2].layers[3], PassThrough)
    assert isinstance(chunks[2].tok_embeddings, PassThrough) and not isinstance(ranks[0].tok_embeddings, PassThrough)
    hidden = tokens
    for stage in range(4):
        hidden = chunks[stage](hidden)
    torch.testing.assert_close(hidden, want, rtol=0, atol=0)


def test_stages_keep_the_models_names_and_together_hold_every_parameter():
    def model():
        return build_model(get_model_args("llama3", "debug", vocab_size=256), device="cpu")

    layout = _layout("--parallelism.pipeline_stages", "2", "--parallelism.stage_layers", "4,2")
    whole = dict(model().named_parameters())
    stages = []
    for k in range(2):
        stage = model()
        keep_stage(stage, k, layout)
        stages.append(dict(stage.named_parameters()))
    assert not set(stages[0]) & set(stages[1])
    assert set(stages[0]) | set(stages[1]) == set(whole)
    assert "layers.3.attention.wq.weight" in stages[0] and "layers.4.attention.wq.weight" in stages[1]
    assert "tok_embeddings.weight" in stages[0] and "output.weight" in stages[1]
    tied = build_model(get_model_args("qwen3", "debug", vocab_size=256), device="cpu")
    if tied.args.tie_embeddings:
        with pytest.raises(ConfigError, match="ties the output to the embedding"):
            keep_stage(tied, 0, layout)
    assert isinstance(stage.layers[0], PassThrough) and not isinstance(stage.layers[4], PassThrough)


COMMON = ["train", *TINY, "--training.val_every", "10", "--metrics.log_every", "1", "--checkpoint.no_enable"]


@pytest.fixture(scope="module")
def one_rank_20_steps(shakespeare, tmp_path_factory) -> Path:
    """The reference: one rank, 20 steps, every step's loss and the validation losses."""
    run = tmp_path_factory.mktemp("one-rank") / "one"
    one = run_cli_here([*COMMON, "--training.steps", "20", "--job.run_dir", str(run)])
    assert one.returncode == 0, one.output[-3000:]
    return run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule,layers,stages", [
    pytest.param("gpipe", "4,2", "stage 0: layers 0-3, stage 1: layers 4-5", marks=pytest.mark.slow),  # 25 s
    ("1f1b", "4,2", "stage 0: layers 0-3, stage 1: layers 4-5"),
    pytest.param("interleaved_1f1b", "2,1,2,1", "stage 0 (rank 0): layers 0-1, stage 1 (rank 1): layers 2-2, "
                 "stage 2 (rank 0): layers 3-4, stage 3 (rank 1): layers 5-5", marks=pytest.mark.slow),
])
def test_an_uneven_two_stage_pipeline_reproduces_one_rank_for_20_steps(one_rank_20_steps, tmp_path, schedule, layers,
                                                                       stages):
    want = losses(one_rank_20_steps)
    want_val = [r["val_loss"] for r in _records(one_rank_20_steps)]
    run = tmp_path / schedule
    per_rank = "2" if schedule == "interleaved_1f1b" else "1"
    done = run_cli([*COMMON, "--training.steps", "20", "--nproc", "2", "--parallelism.pipeline_stages", "2",
                    "--parallelism.stage_layers", layers, "--parallelism.pipeline_schedule", schedule,
                    "--parallelism.stages_per_rank", per_rank, "--job.run_dir", str(run)], timeout=280)
    assert done.returncode == 0, done.output[-3000:]
    assert stages in done.output
    got = losses(run)
    assert sorted(got) == list(range(1, 21))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), (schedule, step, got[step], loss)
    # validation runs through the pipeline too (forward only)
    assert [r["val_loss"] for r in _records(run)] == pytest.approx(want_val, abs=1e-4)


@pytest.mark.timeout(600)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_fsdp_inside_each_stage_reproduces_one_rank(shakespeare, tmp_path):
    """4 ranks as 2 pipeline ranks x 2 data ranks: each stage sharded by FSDP over its 2
    ranks, each data rank reading half the batch; losses and validation as on one rank."""
    common = [*COMMON, "--training.steps", "8", "--training.val_every", "4"]
    one = run_cli_here([*common, "--job.run_dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.output[-3000:]
    run = tmp_path / "grid"
    done = run_cli([*common, "--nproc", "4", "--parallelism.pipeline_stages", "2", "--parallelism.stage_layers", "4,2",
                    "--parallelism.pipeline_micro_batches", "2", "--job.run_dir", str(run)], timeout=400)
    assert done.returncode == 0, done.output[-3000:]
    assert "2 data ranks per stage" in done.output
    got, want = losses(run), losses(tmp_path / "one")
    assert sorted(got) == list(range(1, 9))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), (step, got[step], loss)
    assert [r["val_loss"] for r in _records(run)] == pytest.approx([r["val_loss"] for r in _records(tmp_path / "one")],
                                                                    abs=1e-4)
    with pytest.raises(ConfigError, match="needs a multiple of 2 ranks"):
        _layout("--parallelism.pipeline_stages", "2", ranks=3)
    with pytest.raises(ConfigError, match="shard it with FSDP"):
        _layout("--parallelism.pipeline_stages", "2", "--parallelism.data_parallel", "ddp", ranks=4)


def _records(run):
    return [r for r in records(run) if "val_loss" in r]


@pytest.mark.timeout(600)
@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_a_crashed_pipelined_run_resumes_to_the_uninterrupted_losses(shakespeare, tmp_path):
    common = [*COMMON[:-1], "--training.steps", "8", "--checkpoint.interval", "3", "--training.val_every", "0",
              "--nproc", "2", "--parallelism.pipeline_stages", "2", "--parallelism.stage_layers", "2,4"]
    assert_crash_resume_reproduces(lambda run, env=None: run_cli([*common, "--job.run_dir", str(run)], env=env),
                                   tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks,options,data_ranks", [
    pytest.param("2", "", 1, marks=pytest.mark.slow),  # about a minute: make test-slow
    # FSDP inside each stage: 5 processes on the machine, so run by `make test-slow`.
    pytest.param("4", " --parallelism.pipeline_micro_batches 2", 2, marks=pytest.mark.slow),
], ids=["one-rank-per-stage", "fsdp-inside-stages"])
def test_a_pipelined_island_federates_with_a_one_rank_island_and_heals_after_a_kill(shakespeare, tmp_path, ranks,
                                                                                     options, data_ranks):
    """Island 0 is an uneven 2-stage pipeline (with FSDP inside each stage on 4 ranks),
    island 1 one rank: the bridge takes each parameter (or its shards) from the ranks of the
    stage holding it, so both hold the same global weights after the outer steps; killed and
    restarted, the pipelined island resumes from its checkpoint and heals. The kill lands at
    inner step 6 (its last checkpoint at 4), whatever the machine's load made of the
    start-up: a kill at a wall-clock second could land before the island's ranks began,
    and a later one (step 14) let the one-rank island finish alone before a loaded
    machine had restarted the pipelined one."""
    import json

    run = tmp_path / "federation"
    done = run_cli(["local", "--islands", f"{ranks},1", "--no-table", *TINY, "--training.steps", "40",
                    "--fault_tolerance.sync_steps", "4", "--training.val_every", "0", "--checkpoint.interval", "4",
                    "--island-options", "0:--parallelism.pipeline_stages 2 --parallelism.stage_layers 4,2" + options,
                    "--kill", "0@step6", "--restart-after", "1", "--job.run_dir", str(run)], timeout=560)
    assert done.returncode == 0, done.output[-4000:]
    fed = json.loads((run / "federation.json").read_text())
    assert fed["global_hash_agree"], fed["islands"]
    assert all(i["final_step"] == 40 for i in fed["islands"]), fed["islands"]
    log = (run / "island-0" / "train.log").read_text()
    assert "pipeline of 2 stages (stage 0: layers 0-3, stage 1: layers 4-5)" in log
    assert ("2 data ranks per stage (FSDP)" in log) == (data_ranks == 2)
    assert fed["islands"][0]["restarts"] == 1, fed["islands"]
