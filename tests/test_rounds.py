"""Heterogeneous rounds: the weighted outer average and the guard, on real islands.

Each test runs one process per rank of every island (torch.multiprocessing), islands of
different rank counts as separate gloo groups, each bridge rank with its own torchft
Manager, and an in-process lighthouse. Local progress is set by hand (known deltas), so
the expected global weights are computed here, independently of the outer loop.
"""

from __future__ import annotations

import os
from datetime import timedelta
from itertools import accumulate

import pytest
import torch
import torch.distributed as dist
from conftest import rank_manager, spawn_ranks
from test_island import _free_port
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.diloco import OuterLoop, OuterReport
from archipelago.federation.guard import Poison, PseudoGradientGuard, poisons_from_env
from archipelago.federation.membership import fingerprint
from archipelago.federation.trust import FederationKey, new_secret

ROUND = 2           # inner steps per round
TOKENS = [100, 300, 50, 200]  # tokens per inner step of island 0, 1, 2, 3
# The inner learning rate the islands declare: the receivers' absolute norm bound is then
# 10 x 2 steps x 0.1 x (sqrt(53) + |global|), about 20; an honest round's delta is about 0.7.
INNER_LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _delta(island: int, round_: int, numel: int) -> torch.Tensor:
    """The local progress island `island` makes in round `round_` (known to the test)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * island + round_)) * 0.1


def _train_round(outer: OuterLoop, model: nn.Module, island: int, round_: int, step: int) -> tuple[OuterReport, int]:
    """One round of ROUND inner steps, each setting the weights to the round's start plus the
    island's known delta; the round's report and the step count after it."""
    start = _flat(model)
    report = None
    for _ in range(ROUND):
        step += 1
        _set_flat(model, start + _delta(island, round_, start.numel()))
        report = outer.after_inner_step(step, TOKENS[island])
    assert report is not None
    return report, step


def _set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat, model.parameters())


def _manager(lighthouse: str, island: int, bridge: int, width: int, store_port: int, init_sync: bool = True):
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    return Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=None, state_dict=None,
                   min_replica_size=2, use_async_quorum=False, timeout=timedelta(seconds=30),
                   quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=10),
                   rank=bridge, world_size=width, store_addr="127.0.0.1", store_port=store_port,
                   lighthouse_addr=lighthouse, replica_id=f"island_{island}", init_sync=init_sync)


def _worker(proc: int, port: int, sizes: list[int], width: int, weighting: str, rounds: int,
            lighthouse: str, store_ports: list[int], poisons: dict, codec: str, init_sync: bool,
            block: int, moments: bool, secret: str | list[str] | None, aggregation: str,
            lying_moments: tuple[int, int] | None, moments_dtype: str, extra: dict, out: dict) -> None:
    torch.set_num_threads(1)  # up to 4 processes on 2 cores: more threads only wait for each other
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=proc, world_size=sum(sizes))
    starts = [0, *accumulate(sizes)]
    groups = [dist.new_group(list(range(a, a + n))) for a, n in zip(starts, sizes)]  # every process makes all
    island = max(k for k, a in enumerate(starts[:-1]) if proc >= a)
    rank = proc - starts[island]
    manager = _manager(lighthouse, island, rank, width, store_ports[island], init_sync) if rank < width else None
    try:
        ft = FaultToleranceConfig(enable=True, group_size=len(sizes), min_replica_size=len(sizes),
                                  replica_id=island, sync_steps=ROUND, semi_sync_method="local_sgd",
                                  outer_weighting=weighting, sync_width=width, codec=codec,
                                  topk_fraction=0.1, codec_block_size=block, topk_chunk_size=block,
                                  init_sync=init_sync,
                                  average_optimizer_state=moments, outer_aggregation=aggregation,
                                  moments_dtype=moments_dtype, **extra)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters()) if moments else None
        secret = secret[island] if isinstance(secret, list) else secret  # one per island: an outsider
        key = FederationKey(bytes.fromhex(secret)) if secret else None
        fp = fingerprint("two-linears", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, sizes[island],
                         tokens_per_step=TOKENS[island], inner_lr=INNER_LR, key=key)
        outer = OuterLoop(ft, [list(model.parameters())], rank, sizes[island], manager, fp, groups[island],
                          poisons=[poisons[island]] if island in poisons else [], optimizer=optimizer, key=key)
        if not init_sync:  # as the trainer does: a join round first
            joined = outer.join(len(sizes), 30)
            out[(proc, 0)] = (_flat(model), joined.healed, joined.bytes_sent, joined.committed)
        step = 0
        for round_ in range(1, rounds + 1):
            if optimizer is not None:  # known moments, as if the island had stepped
                _set_moments(optimizer, model, island, round_)
                if island in poisons and poisons[island].round == round_:  # its moments are bad too
                    next(iter(optimizer.state.values()))["exp_avg"].fill_(float("nan"))
                if lying_moments == (island, round_):  # finite, but no Adam state: m^2 far above C * v
                    next(iter(optimizer.state.values()))["exp_avg"].mul_(1e4)
            report, step = _train_round(outer, model, island, round_, step)
            out[(proc, round_)] = (_flat(model), report.weight, report.own_refused, report.committed,
                                   report.federation_tokens)
            out[(proc, round_, "bytes")] = (report.bytes_sent, report.bytes_received)
            out[(proc, round_, "refused")] = report.refused
            out[(proc, round_, "codec")] = report.codec
            if optimizer is not None:
                out[(proc, round_, "moments")] = [_flat_moment(optimizer, model, key) for key in MOMENTS]
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
        dist.destroy_process_group()


MOMENTS = ("exp_avg", "exp_avg_sq")


def _moment(island: int, round_: int, key: int, numel: int) -> torch.Tensor:
    """The moments island `island` holds at the end of round `round_` (known to the test)."""
    return _delta(island, 1000 * (key + 1) + round_, numel).abs() * (key + 1)


def _set_moments(optimizer: torch.optim.Optimizer, model: nn.Module, island: int, round_: int) -> None:
    numel = sum(p.numel() for p in model.parameters())
    for key, name in enumerate(MOMENTS):
        flat = _moment(island, round_, key, numel)
        for p, value in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
            optimizer.state[p][name] = value.view_as(p).clone()


def _flat_moment(optimizer: torch.optim.Optimizer, model: nn.Module, name: str) -> torch.Tensor:
    return torch.cat([optimizer.state[p][name].flatten() for p in model.parameters()])


def _federate(sizes: list[int], width: int, weighting: str, rounds: int,
              poisons: dict[int, Poison] | None = None, codec: str = "fp32", init_sync: bool = True,
              block: int = 16, moments: bool = False, secret: str | list[str] | None = None,
              aggregation: str = "mean", lying_moments: tuple[int, int] | None = None,
              moments_dtype: str = "fp32", **extra: object) -> dict:
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=len(sizes), join_timeout_ms=5000)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in sizes]
    try:
        with rank_manager() as manager:
            out = manager.dict()
            spawn_ranks(_worker, nprocs=sum(sizes),
                        args=(_free_port(), sizes, width, weighting, rounds, lighthouse.address(),
                              [s.port for s in stores], poisons or {}, codec, init_sync, block, moments, secret,
                              aggregation, lying_moments, moments_dtype, extra, out))
            return dict(out)
    finally:
        lighthouse.shutdown()


def _expected(sizes: list[int], weights: list[float], rounds: int, skip: dict[int, int] | None = None) -> list:
    """Global weights after each round: sum_k w_k * local_k / sum_k w_k, by hand.

    `skip` maps island -> round in which its update must be left out (weight 0)."""
    g = _flat(_model())
    out = []
    for round_ in range(1, rounds + 1):
        w = [0.0 if (skip or {}).get(k) == round_ else weights[k] for k in range(len(sizes))]
        g = sum(wk * (g + _delta(k, round_, g.numel())) for k, wk in enumerate(w)) / sum(w)
        out.append(g)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sizes,width,weighting", [([2, 1], 1, "tokens"), ([2, 2], 2, "tokens"),
                                                   ([1, 2, 1], 1, "equal")],
                         ids=["2+1-width1-tokens", "2+2-width2-tokens", "1+2+1-equal"])
def test_outer_step_applies_the_weighted_mean_of_pseudo_gradients(sizes, width, weighting):
    rounds = 2
    moments = width == 2  # and of the inner optimizer's moments (average_optimizer_state)
    out = _federate(sizes, width, weighting, rounds, moments=moments)
    weights = [float(TOKENS[k] * ROUND) if weighting == "tokens" else 1.0 for k in range(len(sizes))]
    expected = _expected(sizes, weights, rounds)
    starts = [0, *accumulate(sizes)]
    for proc in range(sum(sizes)):
        island = max(k for k, a in enumerate(starts[:-1]) if proc >= a)
        for round_ in range(1, rounds + 1):
            flat, weight, own_refused, committed, fed_tokens = out[(proc, round_)]
            assert committed and own_refused is None
            assert weight == weights[island]
            assert fed_tokens == round_ * ROUND * sum(TOKENS[:len(sizes)])  # every island's tokens, counted once
            torch.testing.assert_close(flat, expected[round_ - 1], rtol=0, atol=1e-6,
                                       msg=f"process {proc} (island {island}), round {round_}")
            if moments:
                numel = flat.numel()
                for key, got in enumerate(out[(proc, round_, "moments")]):
                    want = sum(w * _moment(k, round_, key, numel) for k, w in enumerate(weights)) / sum(weights)
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"{MOMENTS[key]}, process {proc}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("poison,sizes", [(Poison("nan", 2), [1, 1]), (Poison("scale1000", 5), [2, 1])],
                         ids=["nan", "scale1000"])
def test_poisoned_pseudo_gradients_are_refused_and_everyone_keeps_the_same_finite_weights(poison, sizes):
    rounds = poison.round + 1
    # With averaged moments: the poisoned island's NaN moments stay out of the average too.
    out = _federate(sizes, 1, "tokens", rounds, {1: poison}, moments=True)
    weights = [float(TOKENS[k] * ROUND) for k in range(len(sizes))]
    expected = _expected(sizes, weights, rounds, skip={1: poison.round})
    for proc in range(sum(sizes)):
        island = 0 if proc < sizes[0] else 1
        for round_ in range(1, rounds + 1):
            flat, weight, own_refused, committed, _ = out[(proc, round_)]
            poisoned = island == 1 and round_ == poison.round
            assert committed and (own_refused is not None) == poisoned, (proc, round_, own_refused)
            assert weight == (0.0 if poisoned else weights[island])
            assert torch.isfinite(flat).all()
            torch.testing.assert_close(flat, expected[round_ - 1], rtol=0, atol=1e-6,
                                       msg=f"process {proc}, round {round_}")
            w = [0.0 if (k == 1 and round_ == poison.round) else weights[k] for k in range(len(sizes))]
            for key, got in enumerate(out[(proc, round_, "moments")]):
                want = sum(wk * _moment(k, round_, key, flat.numel()) for k, wk in enumerate(w)) / sum(w)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"{MOMENTS[key]}, process {proc}")
    reason = out[(sum(sizes) - 1, poison.round)][2]
    assert ("non-finite" in reason) if poison.kind == "nan" else ("running median" in reason)


@pytest.mark.timeout(240)
def test_moments_sent_in_bf16_average_the_rounded_values_for_half_the_bytes():
    # moments_dtype = "bf16": every island averages the same rounded rows, so all end with
    # the same moments, the weighted mean of the bf16 values; the weights are unchanged.
    sizes, rounds = [2, 1], 2
    runs = {dtype: _federate(sizes, 1, "tokens", rounds, moments=True, moments_dtype=dtype)
            for dtype in ("fp32", "bf16")}
    weights = [float(TOKENS[k] * ROUND) for k in range(len(sizes))]
    expected = _expected(sizes, weights, rounds)
    numel = expected[0].numel()
    for proc in range(sum(sizes)):
        for round_ in range(1, rounds + 1):
            torch.testing.assert_close(runs["bf16"][(proc, round_)][0], expected[round_ - 1], rtol=0, atol=1e-6)
            for key, got in enumerate(runs["bf16"][(proc, round_, "moments")]):
                rounded = [_moment(k, round_, key, numel).bfloat16().float() for k in range(len(sizes))]
                want = sum(w * m for w, m in zip(weights, rounded)) / sum(weights)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"{MOMENTS[key]}, process {proc}")
                exact = runs["fp32"][(proc, round_, "moments")][key]
                assert not torch.equal(got, exact)  # the rounding shows: the comparison can fail
    # The bridge's row of two moments: 2 bytes a value instead of 4 (a frame's header and its
    # padding to whole words are the same).
    from archipelago.federation.exchange import Framing

    sent = {dtype: runs[dtype][(0, 1, "bytes")][0] for dtype in runs}
    rows = {size: Framing().row_bytes(size * len(MOMENTS) * numel) for size in (4, 2)}
    assert sent["fp32"] - sent["bf16"] == rows[4] - rows[2] >= 2 * len(MOMENTS) * numel - 8


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signed", [False, True], ids=["plain", "signed"])
def test_moments_no_optimizer_can_hold_are_refused_while_the_islands_update_counts(signed, caplog):
    # Island 2 of three sends, in round 2, first moments 10^4 times too large for its second
    # moments (AdamW's betas allow at most 52.9 x): every island leaves its moments out of
    # the average, while its pseudo-gradient, which is honest, is averaged as usual.
    sizes, rounds = [1, 1, 1], 2
    out = _federate(sizes, 1, "tokens", rounds, moments=True, secret=new_secret() if signed else None,
                    lying_moments=(2, 2))
    weights = [float(TOKENS[k] * ROUND) for k in range(len(sizes))]
    expected = _expected(sizes, weights, rounds)
    for proc in range(len(sizes)):
        for round_ in range(1, rounds + 1):
            flat, weight, own_refused, committed, _ = out[(proc, round_)]
            assert committed and own_refused is None and not out[(proc, round_, "refused")]
            torch.testing.assert_close(flat, expected[round_ - 1], rtol=0, atol=1e-6)
            w = [0.0 if (k, round_) == (2, 2) else weights[k] for k in range(len(sizes))]
            for key, got in enumerate(out[(proc, round_, "moments")]):
                want = sum(wk * _moment(k, round_, key, flat.numel()) for k, wk in enumerate(w)) / sum(w)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"{MOMENTS[key]}, process {proc}")


def test_the_moment_bound_holds_for_adamw_and_is_tight():
    from archipelago.federation.inner_state import adam_moment_bound, moments_problem

    betas = (0.9, 0.95)
    bound = adam_moment_bound(betas)
    assert adam_moment_bound((0.99, 0.95)) is None  # beta1^2 >= beta2: no bound exists
    p = nn.Parameter(torch.zeros(1000))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=betas)
    torch.manual_seed(0)
    for step in range(50):  # torch's own AdamW, gradients of every scale and sign
        p.grad = torch.randn(1000) * 10 ** torch.randint(-6, 3, (1000,)).float()
        opt.step()
        state = opt.state[p]
        assert moments_problem(torch.cat([state["exp_avg"], state["exp_avg_sq"]]), ("exp_avg", "exp_avg_sq"),
                               bound) is None, step
    # The gradients that make exp_avg^2 / exp_avg_sq largest, k steps back, are proportional
    # to ((1-b1) b1^k) / ((1-b2) b2^k): over 200 steps the ratio reaches the bound.
    b1, b2 = betas
    q = nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([q], lr=1e-3, betas=betas)
    for k in reversed(range(200)):
        q.grad = torch.tensor([(b1 / b2) ** k])
        opt.step()
    m, v = opt.state[q]["exp_avg"].double(), opt.state[q]["exp_avg_sq"].double()
    assert 0.999 * bound < float(m.square() / v) <= bound * (1 + 1e-6)
    assert moments_problem(torch.tensor([1.0, float("nan")]), ("exp_avg", "exp_avg_sq"), bound) == "non-finite moments"
    assert "negative" in moments_problem(torch.tensor([0.0, -1.0]), ("exp_avg", "exp_avg_sq"), bound)
    assert "larger" in moments_problem(torch.tensor([1.0, 1.0 / (1.01 * bound)]), ("exp_avg", "exp_avg_sq"), bound)
    # Sent in bf16 (moments_dtype): a state at the bound, rounded, stays within the bf16 slack,
    # and a first moment 2% above the bound does not.
    from archipelago.federation.inner_state import _SLACK_BF16

    keys = ("exp_avg", "exp_avg_sq")
    for scale in (1e-6, 1.0, 3.7e3):
        for nudge in (1 + 2 ** -9, 1 - 2 ** -9):  # bf16 rounds each value by up to 2^-9 of it
            at_bound = torch.cat([m * scale * nudge, v * scale ** 2 / nudge]).float().bfloat16().float()
            assert moments_problem(at_bound, keys, bound, _SLACK_BF16) is None, (scale, nudge)
        over = torch.cat([m * scale * 1.02 ** 0.5 * (1 + 2 ** -9), v * scale ** 2]).float()
        assert "larger" in moments_problem(over, keys, bound, _SLACK_BF16), scale


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,signed,codec,reason", [
    ("scale1000", False, "fp32", "absolute bound"), ("forge_tokens", False, "fp32", "more than its declared batch"),
    ("forge_weight", False, "fp32", "weight -1e+06"), ("unsigned", True, "fp32", "not signed with the federation key"),
    ("scale1000", True, "fp32", "absolute bound"), ("unsigned", True, "int8", "not signed with the federation key"),
    ("forge_tokens", False, "int8", "more than its declared batch")],
    ids=["scale1000-round1", "forge_tokens", "forge_weight", "unsigned", "scale1000-signed",
         "unsigned-int8-reduce-scatter", "forge_tokens-int8-reduce-scatter"])
def test_every_receiver_refuses_a_lying_island_from_the_first_round(kind, signed, codec, reason):
    # Island 1 lies in round 1, before any guard has a history. Every island (the liar
    # included) refuses its row for the same reason, all hold the same weights, and those
    # are the average of islands 0 and 2 alone, by hand (int8: within its rounding, and
    # through the reduce-scatter, where each island sees one segment of every row).
    sizes, rounds = [1, 1, 1], 2
    out = _federate(sizes, 1, "tokens", rounds, {1: Poison(kind, 1)}, codec=codec,
                    secret=new_secret() if signed else None)
    weights = [float(TOKENS[k] * ROUND) for k in range(len(sizes))]
    expected = _expected(sizes, weights, rounds, skip={1: 1})
    for round_ in range(1, rounds + 1):
        for proc in range(len(sizes)):
            flat, _, own_refused, committed, tokens = out[(proc, round_)]
            assert committed
            atol = 1e-6 if codec == "fp32" else 4e-3
            torch.testing.assert_close(flat, expected[round_ - 1], rtol=0, atol=atol, msg=f"{proc}, {round_}")
            assert torch.equal(flat, out[(0, round_)][0])
            refused = out[(proc, round_, "refused")]
            if round_ == 1:
                assert [r["island"] for r in refused] == [1] and reason in refused[0]["reason"], refused
                assert (own_refused is not None) == (proc == 1)
                assert tokens == (TOKENS[0] + TOKENS[2]) * ROUND  # the liar's claim is not counted
            else:
                assert refused == [] and own_refused is None


@pytest.mark.timeout(240)
@pytest.mark.timeout(240)
def test_islands_with_another_key_are_unauthenticated_and_each_key_averages_its_own():
    # Islands 0 and 2 hold one secret, islands 1 and 3 another: each pair's join frames and
    # rows fail the other pair's checks, so in one quorum each pair averages only its own
    # rows (by hand), and neither changes the other's weights. (The islands start from their
    # own, equal weights: with init_sync a healing island would refuse a foreign state.)
    sizes, rounds = [1, 1, 1, 1], 2
    a, b = new_secret(), new_secret()
    out = _federate(sizes, 1, "tokens", rounds, init_sync=False, secret=[a, b, a, b])
    weights = [float(TOKENS[k] * ROUND) for k in range(len(sizes))]
    for pair, others in (((0, 2), (1, 3)), ((1, 3), (0, 2))):
        w = [weights[k] if k in pair else 0.0 for k in range(4)]
        g = _flat(_model())
        for round_ in range(1, rounds + 1):
            g = sum(wk * (g + _delta(k, round_, g.numel())) for k, wk in enumerate(w) if wk) / sum(w)
            for proc in pair:
                flat, _, own_refused, committed, _ = out[(proc, round_)]
                assert committed and own_refused is None
                assert sorted(r["island"] for r in out[(proc, round_, "refused")]) == list(others)
                torch.testing.assert_close(flat, g, rtol=0, atol=1e-6, msg=f"{proc}, {round_}")


def test_the_trimmed_mean_of_three_islands_is_their_coordinate_wise_median_on_every_island():
    # outer_aggregation = "trimmed_mean" drops each coordinate's largest and smallest
    # value: with three islands the median, whatever the token weights (by hand here).
    sizes, rounds = [1, 1, 1], 2
    out = _federate(sizes, 1, "tokens", rounds, aggregation="trimmed_mean")
    g = _flat(_model())
    for round_ in range(1, rounds + 1):
        g = g + torch.stack([_delta(k, round_, g.numel()) for k in range(3)]).median(dim=0).values
        for proc in range(3):
            flat = out[(proc, round_)][0]
            assert torch.equal(flat, out[(0, round_)][0])
            torch.testing.assert_close(flat, g, rtol=0, atol=1e-6, msg=f"{proc}, {round_}")


def test_guard_uses_the_running_median_of_accepted_norms():
    guard = PseudoGradientGuard(limit=10.0, fragments=2)
    assert guard.check(0, 1e6) is None  # no history yet: only non-finite values are refused
    assert guard.check(0, float("nan")) == "non-finite values"
    for norm in (1.0, 2.0, 3.0):
        assert guard.check(1, norm) is None
    assert "running median 2" in guard.check(1, 21.0)  # above 10 x the median of 1, 2, 3
    assert guard.check(1, 15.0) is None and guard.check(1, 18.0) is None  # medians 2 and 2.5: below 10x
    assert "running median 3" in guard.check(1, 31.0)  # median of 1, 2, 3, 15, 18
    assert guard.history[1] == [1.0, 2.0, 3.0, 15.0, 18.0]  # refused norms are not remembered
    restored = PseudoGradientGuard(limit=10.0, fragments=2)
    restored.load_state_tensor(guard.state_tensor())
    assert restored.history == guard.history
    assert PseudoGradientGuard(limit=0.0, fragments=1).check(0, 1e30) is None  # 0 turns the norm check off


@pytest.mark.parametrize("spec", ["nan", "nan@0", "zero@3", "scale1000@x", "crash@1.5", "1:nan@2"])
def test_a_malformed_fault_is_refused_with_the_expected_form(spec, monkeypatch):
    from archipelago.config import ConfigError

    monkeypatch.setenv("ARCHIPELAGO_FAULT", spec)
    with pytest.raises(ConfigError, match=r"expected \[ISLAND:\]KIND@AT"):
        poisons_from_env()


def test_every_poisoned_round_of_an_island_is_kept(monkeypatch):
    monkeypatch.setenv("ARCHIPELAGO_FAULT", "nan@2,crash@9,scale1000@4")
    assert poisons_from_env() == [Poison("nan", 2), Poison("scale1000", 4)]  # crash is the trainer's


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec,sizes,block,atol", [
    ("bf16", [2, 1], 16, 2e-3), ("int8", [2, 1], 16, 2e-3), ("topk", [2, 1], 16, None),
    ("int8", [1, 1, 1], 16, 4e-3), ("bf16", [1, 2, 1], 16, 4e-3), ("int8", [1, 1, 1], 3, 4e-3)],
    ids=["bf16", "int8", "topk", "int8-3-islands", "bf16-3-islands", "int8-3-islands-odd-rows"])
def test_islands_with_a_codec_stay_bit_identical(codec, sizes, block, atol):
    # From three islands on, bf16/int8 reduce-scatter and all-gather (each summed segment is
    # rounded a second time, hence the wider tolerance); two islands all-gather. Blocks of 3
    # make segment payloads of odd sizes (18 values: 42 bytes).
    rounds = 3
    out = _federate(sizes, 1, "tokens", rounds, codec=codec, block=block)
    expected = _expected(sizes, [float(TOKENS[k] * ROUND) for k in range(len(sizes))], rounds)
    start = _flat(_model())
    for round_ in range(1, rounds + 1):
        flats = [out[(proc, round_)][0] for proc in range(sum(sizes))]
        for flat in flats[1:]:
            assert torch.equal(flat, flats[0]), f"round {round_}: islands differ"  # every bit
        assert torch.isfinite(flats[0]).all() and not torch.equal(flats[0], start)
        if atol is not None:  # dense codecs: close to the exact average (top-k sends 10% per round)
            torch.testing.assert_close(flats[0], expected[round_ - 1], rtol=0, atol=atol)
    if codec == "int8" and len(sizes) == 3 and block == 16:
        # 53 values in blocks of 16, one segment per island: 16, 16 and 21 values. An island
        # sends its two foreign segments and its summed one, and receives their counterparts
        # (rows of the largest segment after a 16-byte header of tokens and weight as
        # float64, rounded up to 8 bytes).
        from archipelago.federation.codecs import Int8Codec

        row = 16 + -(-max(Int8Codec(n, 16).payload_bytes() for n in (16, 16, 21)) // 8) * 8
        assert out[(0, 1, "bytes")] == (2 * row + row, 2 * row + 2 * row)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("islands,signed", [(3, False), (4, True)], ids=["3-islands", "4-islands-signed"])
def test_topk_reduce_scatter_equals_the_all_gather_bit_for_bit(islands, signed):
    # Chunks of 8 values, 10% of each sent (one value): 53 values in 7 chunks, cut into one
    # segment of whole chunks per island. The same rounds through both paths end with the
    # same weights on every island, every bit, for three rounds of error feedback.
    sizes, rounds, secret = [1] * islands, 3, new_secret() if signed else None
    paths = {exchange: _federate(sizes, 1, "tokens", rounds, codec="topk", block=8, secret=secret,
                                 topk_exchange=exchange) for exchange in ("all_gather", "reduce_scatter")}
    start = _flat(_model())
    for round_ in range(1, rounds + 1):
        reference = paths["all_gather"][(0, round_)][0]
        assert not torch.equal(reference, start) and torch.isfinite(reference).all()
        for exchange, out in paths.items():
            for proc in range(islands):
                flat, _, own_refused, committed, _ = out[(proc, round_)]
                assert committed and own_refused is None
                assert torch.equal(flat, reference), f"{exchange}, island {proc}, round {round_}"
    # Each path moved what it should: the all-gather a whole payload from every other island;
    # the reduce-scatter one segment from each, their sums' sizes (8 bytes) and summed segments.
    from archipelago.federation.codecs import TopKCodec, sum_bytes_bound
    from archipelago.federation.exchange import Framing

    framing = Framing(key=FederationKey(bytes.fromhex(secret))) if signed else Framing()
    whole = TopKCodec(53, 0.1, 2, 8)
    assert paths["all_gather"][(0, 1, "bytes")] == (framing.row_bytes(whole.payload_bytes()),
                                                    (islands - 1) * framing.row_bytes(whole.payload_bytes()))
    segment_row = framing.row_bytes(max(whole.for_length(e - s).payload_bytes() for s, e in whole.segments(islands)))
    sent, received = paths["reduce_scatter"][(0, 1, "bytes")]
    sum_row = sent - (islands - 1) * segment_row - 8  # the largest exact sum: its size varies by round
    longest = max(e - s for s, e in whole.segments(islands))
    assert framing.row_bytes(0) < sum_row <= framing.row_bytes(sum_bytes_bound(longest))
    assert received == (islands - 1) * (segment_row + 8 + sum_row)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("target,then", [(1e6, "fp32"), (1e-9, None)], ids=["roomy-target", "no-room"])
def test_auto_codec_rounds_agree_on_every_island(target, then):
    # Round 1 knows no link yet (int8); from round 2 the islands agree on what round 1
    # measured: with all the time in the world fp32, with none the quickest codec, its bytes'
    # seconds plus the CPU seconds it measured. In round 2 only int8 has been timed, and
    # its bytes are more than top-k's: the codec of fewest bytes. Later the rounds may try
    # whichever is quickest by then (on 53 values the CPU decides), all islands alike.
    from archipelago.federation.codecs import AutoCodec
    from archipelago.federation.exchange import Framing, round_received

    sizes, rounds = [1, 1, 1], 3
    out = _federate(sizes, 1, "tokens", rounds, codec="auto", block=8, target_exchange_s=target)
    if then is None:
        auto = AutoCodec(53, FaultToleranceConfig(codec="auto", topk_fraction=0.1, codec_block_size=8,
                                                  topk_chunk_size=8))
        sizes_by_codec = {name: round_received(c, 3, Framing()) for name, c in auto.options.items()}
        then = min(sizes_by_codec, key=lambda name: sizes_by_codec[name])
    for round_ in range(1, rounds + 1):
        labels = {out[(proc, round_, "codec")] for proc in range(3)}
        assert len(labels) == 1, (round_, labels)
        if round_ <= 2 or target > 1:
            assert labels == {"auto:int8" if round_ == 1 else f"auto:{then}"}, (round_, labels)
        flats = [out[(proc, round_)][0] for proc in range(3)]
        assert all(torch.equal(f, flats[0]) for f in flats) and all(out[(p, round_)][3] for p in range(3))
    if then == "fp32":  # exact from round 2 on: the average of round 2 is the hand-computed one, shifted
        # by round 1's int8 rounding, the same on all islands; the islands' own deltas are exact.
        expected = _expected(sizes, [float(TOKENS[k] * ROUND) for k in range(3)], rounds)
        torch.testing.assert_close(out[(0, rounds)][0], expected[-1], rtol=0, atol=4e-3)


@pytest.mark.timeout(240)
def test_islands_that_start_from_their_own_weights_download_nothing_at_the_join():
    sizes, rounds = [2, 1], 2
    out = _federate(sizes, 1, "tokens", rounds, init_sync=False)
    for proc in range(sum(sizes)):
        flat, healed, bytes_sent, committed = out[(proc, 0)]
        # No healing and no exchange in the join round: every island kept its own start.
        assert committed and not healed and bytes_sent == 0, (proc, healed, bytes_sent)
        assert torch.equal(flat, _flat(_model()))
    expected = _expected(sizes, [float(TOKENS[k] * ROUND) for k in range(len(sizes))], rounds)
    for proc in range(sum(sizes)):
        for round_ in range(1, rounds + 1):
            torch.testing.assert_close(out[(proc, round_)][0], expected[round_ - 1], rtol=0, atol=1e-6)


def test_islands_that_start_from_different_weights_are_refused():
    from test_codecs import _FakeManager

    from archipelago.federation.membership import mismatch

    def loop(seed: int) -> OuterLoop:
        model = _model()
        if seed:
            torch.manual_seed(seed)
            nn.init.normal_(model[0].weight)
        ft = FaultToleranceConfig(enable=True, init_sync=False)
        fp = fingerprint("two-linears", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, 1)
        return OuterLoop(ft, [list(model.parameters())], 0, 1, _FakeManager(), fp)

    same = loop(0)
    assert mismatch(same.fingerprint, loop(0).fingerprint) is None
    problem = mismatch(same.fingerprint, loop(1).fingerprint)
    assert problem is not None and "start" in problem and "own weights" in problem
    synced = FaultToleranceConfig(enable=True)
    fp = fingerprint("two-linears", [(n, tuple(p.shape)) for n, p in _model().named_parameters()], synced, 1)
    assert "start" in mismatch(same.fingerprint, fp)  # init_sync must agree as well
