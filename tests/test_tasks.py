"""Image classification through the same trainer: ResNet on Fashion-MNIST, alone and in a federation.

The trainer gets the task (tasks.py) through its build hook; these tests train the small
ResNet on the real images and check what the task adds (accuracy, the dataset/family
pairing) and that everything else (resume, the federation) holds for it unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, events, losses, records, run_cli, run_cli_here

from archipelago.config import Config, ConfigError, load_config, parse_overrides
from archipelago.tasks import ImageClassification, build_task, check_model

RESNET = ["--config", "configs/resnet/debug.toml", "--metrics.progress", "plain", "--metrics.no_tensorboard"]


def _config(*overrides: str) -> Config:
    return parse_overrides(Config(), list(overrides))


def test_the_model_family_and_the_dataset_must_match():
    with pytest.raises(ConfigError, match="--data.dataset fashion_mnist"):
        check_model(_config("--model.name", "resnet", "--model.flavor", "debug"))
    with pytest.raises(ConfigError, match="language model"):
        check_model(_config("--data.dataset", "fashion_mnist"))
    with pytest.raises(ConfigError, match="did you mean 'resnet18'"):
        check_model(_config("--model.name", "resnet", "--model.flavor", "resnet-18",
                            "--data.dataset", "fashion_mnist"))
    check_model(_config("--model.name", "resnet", "--model.flavor", "debug", "--data.dataset", "fashion_mnist"))
    assert isinstance(build_task(_config("--model.name", "resnet", "--data.dataset", "fashion_mnist")),
                      ImageClassification)


def test_an_imagenet_shaped_flavor_is_refused_for_fashion_mnist(fashion_mnist):
    task = build_task(_config("--model.name", "resnet", "--model.flavor", "resnet50", "--data.dataset",
                              "fashion_mnist"))
    task.prepare(lambda _m: None)
    with pytest.raises(ConfigError, match="--model.flavor fashion_mnist"):
        task.build_model()


def test_validation_metrics_sum_over_batches_to_the_whole_sets_accuracy():
    task = ImageClassification(_config("--model.name", "resnet", "--data.dataset", "fashion_mnist"))
    logits = torch.randn(10, 10, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (10,), generator=torch.Generator().manual_seed(1))
    sums = task.eval_sums(logits[:4], labels[:4]) + task.eval_sums(logits[4:], labels[4:])
    metrics = task.eval_metrics(sums)
    hits = sum(int(max(range(10), key=lambda c: logits[i, c].item()) == labels[i].item()) for i in range(10))
    assert metrics["val_accuracy"] == pytest.approx(hits / 10)
    expected = -sum(torch.log_softmax(logits[i], -1)[labels[i]].item() for i in range(10)) / 10
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow  # over 30 s on 2 cores: make test-slow
def test_resnet_learns_fashion_mnist_and_reports_accuracy(fashion_mnist, tmp_path):
    run = tmp_path / "run"
    done = run_cli_here(["train", *RESNET, "--training.steps", "300", "--training.val_every", "150",
                         "--checkpoint.no_enable", "--job.run_dir", str(run)])
    assert done.returncode == 0, done.output[-3000:]
    logged = records(run)
    vals = [r["val_accuracy"] for r in logged if "val_accuracy" in r]
    # Before the first step: 10 classes, about a tenth right; after 300 steps of 64 images (a third of an epoch), most.
    assert len(vals) == 3 and vals[0] < 0.3 and vals[-1] > 0.8, vals
    assert all(0 <= r["accuracy"] <= 1 for r in logged if "accuracy" in r)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_accuracy"] == vals[-1] and summary["tokens"] == 300 * 64  # a token is an image
    assert "val acc" in done.output and "img/s" in done.output


def test_a_resnet_run_resumes_to_the_same_losses(fashion_mnist, tmp_path):
    common = [*RESNET, "--training.steps", "6", "--lr_scheduler.warmup_steps", "2", "--training.val_every", "0",
              "--metrics.log_every", "1",
              "--checkpoint.interval", "3"]
    reference = run_cli_here(["train", *common, "--job.run_dir", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.output[-3000:]
    run = tmp_path / "broken"
    broken = run_cli_here(["train", *common, "--job.run_dir", str(run)], env={"ARCHIPELAGO_FAULT": "error@5"})
    assert broken.returncode != 0
    resumed = run_cli_here(["train", *common, "--job.run_dir", str(run)])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [e["step"] for e in events(run) if e["event"] == "resume"] == [3]
    want, got = losses(tmp_path / "reference"), losses(run)
    for step in range(4, 7):  # weights, BatchNorm statistics, optimizer, data order and augmentation
        assert got[step] == want[step], (step, want, got)


@pytest.mark.timeout(300)
@pytest.mark.slow  # 22 s on 2 cores: make test-slow
def test_two_resnet_islands_agree_on_their_global_weights(fashion_mnist, tmp_path):
    run = tmp_path / "federation"
    done = run_cli(["local", "--islands", "1,1", "--config", "configs/resnet/federation.toml",
                    "--training.steps", "40", "--training.val_every", "20", "--metrics.no_tensorboard",
                    "--metrics.progress", "plain", "--job.run_dir", str(run)], timeout=280)
    assert done.returncode == 0, done.output[-3000:]
    fed = json.loads((run / "federation.json").read_text())
    assert fed["global_hash_agree"], fed["islands"]
    # The first outer step (the start from island 0's weights), then a round every sync_steps of
    # the config, both islands in each.
    sync = load_config(["--config", str(ROOT / "configs/resnet/federation.toml")]).fault_tolerance.sync_steps
    assert [o["participants"] for o in fed["outer_steps"]] == [2] * (1 + 40 // sync), fed["outer_steps"]
    for island in ("island-0", "island-1"):
        summary = json.loads((run / island / "summary.json").read_text())
        assert summary["steps"] == 40 and 0.3 < summary["val_accuracy"] <= 1, summary
    # Each island keeps its own BatchNorm statistics (of its own images): the same global
    # weights evaluate differently on each island.
    first, second = (island["final_val_loss"] for island in fed["islands"])
    assert first != second
