"""Heterogeneous data parallelism: ranks take unequal shares of the batch, and every sample
weighs the same in the gradient, whichever rank computed it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import rank_manager, spawn_ranks
from test_island import _free_port, tiny_model, two_rank_island

from archipelago.config import ConfigError, load_config
from archipelago.config.counts import parse_counts
from archipelago.data.loader import ShardOrder
from archipelago.island.batches import RankBatches, forward_backward, rank_batches
from archipelago.island.parallelize import parallelize


def test_counts_parse_in_our_form_and_synerfuses():
    assert parse_counts("6,2", 2, "x") == (6, 2)
    assert parse_counts("1 6 1 2", 2, "x") == (6, 2)
    assert parse_counts("2 3 1 5", 3, "x") == (3, 3, 5)
    assert parse_counts(" 4 ", 1, "x") == (4,)
    for bad, match in [("6,0", "positive"), ("1 6 1", "pairs"), ("6,2,1", "3 entries for 2"), ("a,b", "positive"),
                       ("", "empty")]:
        with pytest.raises(ValueError, match=match):
            parse_counts(bad, 2, "parallelism.micro_batch_size_per_rank")


def _cfg(*flags: str):
    return load_config(["--training.batch_size", "32", *flags])


def test_rank_batches_add_up_or_name_the_fix():
    split = rank_batches(_cfg("--parallelism.micro_batch_size_per_rank", "1 6 1 2",
                              "--parallelism.num_micro_batches_per_rank", "4,4"), 2)
    assert split == RankBatches((6, 2), (4, 4)) and split.samples == (24, 8) and not split.uneven_counts
    assert split.loss_weight(6) == 2 * 6 / 32
    even = rank_batches(_cfg("--training.micro_batch_size", "4"), 2)
    assert even == RankBatches((4, 4), (4, 4)) and even.even and even.loss_weight(4) == 1 / 4
    with pytest.raises(ConfigError, match="sum to 28 samples, not training.batch_size = 32"):
        rank_batches(_cfg("--parallelism.micro_batch_size_per_rank", "6,1", "--parallelism.num_micro_batches_per_rank",
                          "4,4"), 2)
    with pytest.raises(ConfigError, match="needs parallelism.micro_batch_size_per_rank"):
        rank_batches(_cfg("--parallelism.num_micro_batches_per_rank", "4,4"), 2)
    with pytest.raises(ConfigError, match="keep one"):
        rank_batches(_cfg("--training.micro_batch_size", "4", "--parallelism.micro_batch_size_per_rank", "16,16"), 2)


def test_unequal_shares_cover_the_one_rank_batch_and_resume():
    one = ShardOrder(1000, 32, 0, 1, seed=3)
    ranks = [ShardOrder(1000, 32, r, 2, seed=3, shares=[24, 8]) for r in range(2)]
    for _ in range(40):  # past an epoch boundary (31 steps of 32 in 1000)
        parts = [order.next_indices() for order in ranks]
        assert [len(p) for p in parts] == [24, 8]
        assert np.array_equal(np.concatenate(parts), one.next_indices())
    resumed = ShardOrder(1000, 32, 1, 2, seed=3, shares=[24, 8])
    resumed.load_state_dict(ranks[0].state_dict())  # the state is the island's, not the rank's
    assert np.array_equal(resumed.next_indices(), ranks[1].next_indices())
    with pytest.raises(ValueError, match="sum to the global batch"):
        ShardOrder(1000, 32, 0, 2, seed=3, shares=[24, 4])


class _NextToken:
    """The language-modelling objective, written out for the test."""

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())

    def auxiliary_loss(self, model):
        return None

    def step_metrics(self, outputs, targets, model):
        return {}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(11))
    return tokens[:, :-1], tokens[:, 1:]


def _full_batch_gradients() -> dict[str, torch.Tensor]:
    model = tiny_model("cpu", seed=2)
    inputs, targets = _batch()
    _NextToken().loss(model(inputs), targets).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, port: int, strategy: str, split: RankBatches, out: dict) -> None:
    with two_rank_island(rank, port) as ctx:
        model = parallelize(tiny_model("cpu", seed=2), ctx, strategy, "fp32",
                            broadcast_buffers=not split.uneven_counts)
        inputs, targets = _batch()
        first = sum(split.samples[:rank])
        mine = slice(first, first + split.samples[rank])
        size = split.micro_batch_size[rank]
        micro = list(zip(inputs[mine].split(size), targets[mine].split(size)))
        for _ in range(2):  # a second step: the parameters were resharded after the first
            model.module.zero_grad()
            loss, _ = forward_backward(model, micro, split, _NextToken())
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.module.named_parameters()}
        logged = loss.clone()
        torch.distributed.all_reduce(logged, op=torch.distributed.ReduceOp.AVG)
        out[rank] = {k.removeprefix("module."): v for k, v in grads.items()}, float(logged)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.parametrize("split", [RankBatches((6, 2), (4, 4)), RankBatches((4, 2), (6, 4))],
                         ids=["sizes-6x4-2x4", "counts-4x6-2x4"])
def test_unequal_shares_give_the_full_batch_gradient(strategy, split):
    """6x4 + 2x4 samples (SynerFuse's example) and unequal micro-batch counts too: the
    island's gradient equals the mean-loss gradient of all 32 samples on one rank, where
    averaging the two ranks' mean losses would weigh rank 1's samples 3x too much."""
    with rank_manager() as manager:
        out = manager.dict()
        spawn_ranks(_worker, args=(_free_port(), strategy, split, out), nprocs=2)
        results = dict(out)
    reference = _full_batch_gradients()
    inputs, targets = _batch()
    with torch.no_grad():
        full_loss = float(_NextToken().loss(tiny_model("cpu", seed=2)(inputs), targets))
    for rank in (0, 1):
        grads, logged = results[rank]
        assert logged == pytest.approx(full_loss, abs=1e-6)
        for name, expected in reference.items():
            torch.testing.assert_close(grads[name], expected, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.timeout(300)
@pytest.mark.slow  # 15 s on 2 cores: make test-slow (the gradient sum is checked in-process above)
def test_a_two_rank_island_with_unequal_shares_trains_like_one_rank(shakespeare, tmp_path):
    from conftest import TINY, losses, records, run_cli, run_cli_here

    common = ["train", *TINY, "--training.steps", "4", "--training.val_every", "0", "--metrics.log_every", "1",
              "--checkpoint.no_enable", "--training.seed", "1"]
    one = run_cli_here([*common, "--job.run_dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.output[-3000:]
    # FSDP with unequal micro-batch counts (3 x 2 and 2 x 1 of a batch of 8), rank 1 emulated 2x slower.
    two = run_cli([*common, "--nproc", "2", "--parallelism.micro_batch_size_per_rank", "1 3 1 2",
                   "--parallelism.num_micro_batches_per_rank", "2,1", "--island.rank_slowdown", "1,2",
                   "--metrics.tensorboard",  # its step records carry per-rank lists (rank_idle)
                   "--job.run_dir", str(tmp_path / "two")])
    assert two.returncode == 0, two.output[-3000:]
    assert "rank 0: 3 x 2 = 6, rank 1: 2 x 1 = 2" in two.output and "EMULATED slow rank 1" in two.output
    expected, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    # A CPU island of several ranks records each rank's idle share of the step.
    idle = [r["rank_idle"] for r in records(tmp_path / "two") if "rank_idle" in r]
    assert len(idle) == 4 and all(len(shares) == 2 and all(0 <= x <= 1 for x in shares) for shares in idle)
    assert "rank_idle" not in next(r for r in records(tmp_path / "one") if "loss" in r)
    assert list((tmp_path / "two" / "tensorboard").glob("events.out.tfevents.*"))
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), (step, got, expected)
    bad = run_cli_here([*common, "--parallelism.micro_batch_size_per_rank", "3,2", "--job.run_dir",
                        str(tmp_path / "bad")])
    assert bad.returncode != 0 and "gives 2 entries for 1" in bad.output


@pytest.mark.timeout(400)
@pytest.mark.slow  # a 2-rank run and a 1-rank one: make test-slow
def test_auto_rebalances_from_its_own_records_and_trains_like_one_rank(shakespeare, tmp_path):
    """parallelism.rebalance_after: the island splits its batch again from its own step records
    part-way through; every step's loss still equals one rank's on the whole batch, so no
    sample was skipped, repeated or weighted wrongly across the change."""
    from conftest import TINY, losses, run_cli, run_cli_here

    common = ["train", *TINY, "--training.batch_size", "12", "--training.steps", "8", "--training.val_every", "0",
              "--metrics.log_every", "1", "--checkpoint.no_enable", "--training.seed", "1"]
    one = run_cli_here([*common, "--job.run_dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.output[-3000:]
    # An even split beside a 3x slower rank 1: the fast rank waits half of every step until
    # the records move samples to it.
    two = run_cli([*common, "--nproc", "2", "--parallelism.rebalance_after", "4", "--island.rank_slowdown", "1,3",
                   "--job.run_dir", str(tmp_path / "two")], timeout=360)
    assert two.returncode == 0, two.output[-3000:]
    moved = re.search(r"rebalance_after: at step 4, from rank 0: 6 x 1 = 6, rank 1: 6 x 1 = 6 to "
                      r"rank 0: (\d+) x 1 = \d+, rank 1: (\d+) x 1", two.output)
    assert moved and int(moved.group(1)) > 6 > int(moved.group(2)), two.output[-3000:]
    # With parallelism.auto it starts from the profile's split and scales its curves to the run.
    auto = run_cli([*common, "--nproc", "2", "--parallelism.auto", "--parallelism.rebalance_after", "4",
                    "--island.rank_slowdown", "1,3", "--job.run_dir", str(tmp_path / "auto")], timeout=360)
    assert auto.returncode == 0 and "parallelism.rebalance_after: " in auto.output, auto.output[-3000:]
    expected = losses(tmp_path / "one")
    for run in ("two", "auto"):
        got = losses(tmp_path / run)
        assert sorted(got) == sorted(expected) == list(range(1, 9))
        for step, loss in expected.items():
            assert got[step] == pytest.approx(loss, abs=1e-4), (run, step, got, expected)
    refused = run_cli_here([*common, "--parallelism.rebalance_after", "1", "--job.run_dir", str(tmp_path / "r")])
    assert refused.returncode != 0 and "comes before two step records" in refused.output
