"""A thin island carried by a member, on the platform (federation/thin.py, carrying.py).

First the thin island's loop against an in-process carrier (what it uploads, what it
continues from, an upload that does not go through); then a federation of two members
(real torchft managers, an in-process lighthouse) of which island 0 carries thin island 2:
the global weights every member ends with are computed here by hand, with the thin
island's row folded in at its staleness, and the thin island's weights after its download.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from conftest import rank_manager, spawn_ranks
from test_rounds import INNER_LR, ROUND, TOKENS, _delta, _flat, _manager, _model, _set_flat

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarrierBook
from archipelago.federation.carry_link import CarryServer
from archipelago.federation.carrying import declared_tokens_per_step
from archipelago.federation.codecs import build_codec
from archipelago.federation.diloco import OuterLoop
from archipelago.federation.membership import fingerprint
from archipelago.federation.policy import Allowance
from archipelago.federation.thin import ThinIsland
from archipelago.federation.trust import FederationKey, new_secret

CARRIER, MEMBER, THIN = 0, 1, 2
CARRY_ROUNDS = 2
THIN_TOKENS = 70  # per inner step


class _Hooks:
    """What the thin island asks of its trainer: the step, events."""

    def __init__(self) -> None:
        self.step, self.events = 0, []

    def event(self, name: str, **fields: Any) -> None:
        self.events.append((name, fields))


def _thin_ft(url: str) -> FaultToleranceConfig:
    return FaultToleranceConfig(enable=True, group_size=3, replica_id=THIN, sync_steps=ROUND, carrier=url,
                                carrier_island=CARRIER, carry_rounds=CARRY_ROUNDS, join_wait_ms=20000,
                                quorum_timeout_ms=20000)


@pytest.fixture(autouse=True)
def _local_key(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001 - a Path
    """The thin island's local key (its carry token comes from it) in the test's folder,
    not the user's (a spawned thin island inherits the variable)."""
    monkeypatch.setenv("ARCHIPELAGO_CHECKPOINT_KEY_FILE", str(tmp_path / "thin-local.key"))


def _train(thin: ThinIsland, model: torch.nn.Module, hooks: _Hooks, carry: int) -> None:
    """One carry's inner steps: the weights become their start plus the known delta."""
    start = _flat(model)
    for _ in range(ROUND * CARRY_ROUNDS):
        hooks.step += 1
        _set_flat(model, start + _delta(THIN, carry, start.numel()))
        thin.after_step(hooks.step, THIN_TOKENS, 0.0)


def _served(monkeypatch: pytest.MonkeyPatch) -> tuple[FederationKey, torch.nn.Module, CarryServer]:
    """A federation key, a model, and an in-process carry server (island CARRIER's) for THIN."""
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    key = FederationKey(bytes.fromhex(new_secret()))
    model = _model()
    codec = build_codec(FaultToleranceConfig(), _flat(model).numel())
    return key, model, CarryServer(CarrierBook(key, CARRIER, {THIN}), codec, Allowance(1e6, math.inf))


@pytest.mark.timeout(60)
def test_a_thin_island_uploads_its_progress_and_moves_with_the_global_weights(monkeypatch):
    key, model, server = _served(monkeypatch)
    numel = _flat(model).numel()
    try:
        g0 = _flat(_model()) + 0.25
        server.publish(3, g0)
        hooks = _Hooks()
        thin = ThinIsland(_thin_ft(server.address()), 100, list(model.parameters()), 0, 1, key, hooks)
        thin.join(0)
        base = g0.bfloat16().float()
        assert torch.equal(_flat(model), base)  # it starts from the carrier's weights (bf16)
        g1 = g0 - 0.5
        server.publish(4, g1)
        _train(thin, model, hooks, carry=1)  # the carry travels on a thread ...
        sent = _flat(model)
        extra = torch.full_like(sent, 1e-3)
        _set_flat(model, sent + extra)  # ... while the island trains on
        thin.finish_carry(hooks.step)
        (upload,) = server.take_uploads()
        pseudo = base - (base + _delta(THIN, 1, numel))
        assert (upload.island, upload.base_step, upload.tokens) == (THIN, 3, ROUND * CARRY_ROUNDS * THIN_TOKENS)
        assert torch.equal(upload.values, pseudo)
        # Its weights move by what the global weights moved since the row's base: the
        # progress since the upload stays, and the row in flight is not taken back.
        shift = g1.bfloat16().float() - base
        moved = (sent + extra) + shift
        assert torch.equal(_flat(model), moved) and thin.at_round_end
        # An upload the carrier refuses (here: the carrier was restarted and forgot its
        # downloads) loses nothing: the next row carries both carries' progress.
        server.book = CarrierBook(key, CARRIER, {THIN})
        g2 = g1 + 0.125
        server.publish(5, g2)
        _train(thin, model, hooks, carry=2)
        local = _flat(model)
        thin.finish_carry(hooks.step)
        assert server.take_uploads() == [] and [e for e, _ in hooks.events][-2:] == ["refused", "carry"]
        assert torch.equal(_flat(model), local + (g2.bfloat16().float() - (sent + shift)))
        server.publish(6, g2)
        _train(thin, model, hooks, carry=3)
        local = _flat(model)
        thin.finish_carry(hooks.step)
        (upload,) = server.take_uploads()
        assert upload.base_step == 5 and upload.tokens == 2 * ROUND * CARRY_ROUNDS * THIN_TOKENS
        assert torch.equal(upload.values, g2.bfloat16().float() - local)
        assert [f["uploads"] for e, f in hooks.events if e == "carry"] == [1, 1, 2]
    finally:
        thin.shutdown()
        server.close()


@pytest.mark.timeout(60)
def test_a_thin_island_holds_back_a_row_while_its_carrier_commits_no_round(monkeypatch):
    # The carrier takes one row a round (carry.py): a thin island that carries faster than
    # its carrier commits rounds would have its second row of a round refused. It holds
    # that row back instead, keeps its progress and tokens, and sends them with its first
    # row trained from a later outer step: no refusal, nothing lost.
    key, model, server = _served(monkeypatch)
    numel = _flat(model).numel()
    try:
        g = _flat(_model()) + 0.25
        server.publish(3, g)
        hooks = _Hooks()
        thin = ThinIsland(_thin_ft(server.address()), 100, list(model.parameters()), 0, 1, key, hooks)
        thin.join(0)
        server.publish(4, g)
        _train(thin, model, hooks, carry=1)
        thin.finish_carry(hooks.step)  # the row trained from step 3 goes in; it downloads step 4
        assert [u.base_step for u in server.take_uploads()] == [3]
        _train(thin, model, hooks, carry=2)
        thin.finish_carry(hooks.step)  # the row from step 4 goes in; the carrier is still at step 4
        assert [u.base_step for u in server.take_uploads()] == [4]
        start = _flat(model)
        _train(thin, model, hooks, carry=3)
        thin.finish_carry(hooks.step)  # trained from step 4 again: held back
        assert server.take_uploads() == []
        # It moves by what the global weights moved since the row's base, as after any carry
        # (its row from step 4 is not in them yet: it comes back with the carrier's next round).
        assert torch.equal(_flat(model), (start + _delta(THIN, 3, numel)) + (g.bfloat16().float() - start))
        server.publish(5, g - 0.5)
        _train(thin, model, hooks, carry=4)
        thin.finish_carry(hooks.step)  # its download was still of step 4: held; step 5 comes down
        assert server.take_uploads() == []
        _train(thin, model, hooks, carry=5)
        local = _flat(model)
        thin.finish_carry(hooks.step)
        (upload,) = server.take_uploads()
        assert upload.base_step == 5 and upload.tokens == 3 * ROUND * CARRY_ROUNDS * THIN_TOKENS
        assert torch.equal(upload.values, (g - 0.5).bfloat16().float() - local)
        names = [e for e, _ in hooks.events]
        assert "refused" not in names and names.count("upload") == 3
        assert [f["held"] for e, f in hooks.events if e == "carry"] == [False, False, True, True, False]
    finally:
        thin.shutdown()
        server.close()


def _member(proc: int, lighthouse: str, store_ports: list[int], secret: str, rounds: int, out: dict) -> None:
    torch.set_num_threads(1)
    key = FederationKey(bytes.fromhex(secret))
    if proc == THIN:
        return _thin(key, rounds, out)
    manager = _manager(lighthouse, proc, 0, 1, store_ports[proc])
    outer = None
    try:
        carries = dict(carries=THIN, carried_tokens=ROUND * CARRY_ROUNDS * THIN_TOKENS) if proc == CARRIER else {}
        ft = FaultToleranceConfig(enable=True, group_size=2, min_replica_size=2, replica_id=proc, sync_steps=ROUND,
                                  semi_sync_method="local_sgd", staleness_exponent=1.0, **carries)
        model = _model()
        fp = fingerprint("two-linears", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, 1,
                         tokens_per_step=declared_tokens_per_step(ft, TOKENS[proc]), inner_lr=INNER_LR, key=key)
        outer = OuterLoop(ft, [list(model.parameters())], 0, 1, manager, fp, key=key, tokens_per_step=TOKENS[proc])
        if outer.carrying is not None:
            out["url"] = outer.carrying.server.address()
        step = 0
        for round_ in range(1, rounds + 1):
            start = _flat(model)
            for inner in range(ROUND):
                step += 1
                _set_flat(model, start + _delta(proc, round_, start.numel()))
                if proc == CARRIER and round_ == 1 and inner == ROUND - 1:
                    _wait_for(out, "joined")  # the thin island trains from the weights of outer step 0
                if proc == CARRIER and round_ == 2 and inner == ROUND - 1:
                    _wait_for(out, "carried")  # the thin island's row has arrived: folded in this round
                report = outer.after_inner_step(step, TOKENS[proc])
            assert report is not None
            out[(proc, round_)] = (_flat(model), report.committed, report.federation_tokens, report.refused,
                                   report.carried, report.tokens)
            out[("done", proc, round_)] = True
    finally:
        if outer is not None:
            outer.shutdown()
        else:
            manager.shutdown(wait=False)


def _thin(key: FederationKey, rounds: int, out: dict) -> None:
    url = _wait_for(out, "url")
    model, hooks = _model(), _Hooks()
    thin = ThinIsland(_thin_ft(url), 100, list(model.parameters()), 0, 1, key, hooks)
    thin.join(0)  # the carrier's weights of outer step 0
    out["joined"] = _flat(model)
    _wait_for(out, ("done", CARRIER, 1))  # the members' first round is over: its row enters their second
    _train(thin, model, hooks, carry=1)
    sent = _flat(model)
    thin.finish_carry(hooks.step)
    out["thin"] = (sent, _flat(model), [e for e, _ in hooks.events])
    out["carried"] = True


def _wait_for(out: dict, name: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while name not in out:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name!r} never came")
        time.sleep(0.02)
    return out[name]


@pytest.mark.timeout(240)
def test_a_carried_thin_islands_row_enters_every_members_weights_at_its_staleness(monkeypatch):
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    rounds = 3
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    try:
        with rank_manager() as manager:
            out = manager.dict()
            spawn_ranks(_member, nprocs=3, args=(lighthouse.address(), [s.port for s in stores], new_secret(),
                                                 rounds, out))
            out = dict(out)
    finally:
        lighthouse.shutdown()
    # By hand: plain averaging (local_sgd) weighted by tokens; in round 2 the carrier's row
    # also carries the thin island's, trained from the weights of outer step 0 and entering
    # after outer step 1 was applied: 1 step stale, discounted 1 / (1 + 1) (exponent 1).
    g = _flat(_model())
    thin_base = g.bfloat16().float()
    thin_pseudo = thin_base - (thin_base + _delta(THIN, 1, g.numel()))
    thin_tokens = ROUND * CARRY_ROUNDS * THIN_TOKENS
    expected, federation_tokens = [], 0
    for round_ in range(1, rounds + 1):
        rows = [(ROUND * TOKENS[k], g - (g + _delta(k, round_, g.numel()))) for k in (CARRIER, MEMBER)]
        total = sum(t * p for t, p in rows)
        divisor = sum(t for t, _ in rows)
        if round_ == 2:
            total, divisor = total + thin_tokens / 2 * thin_pseudo, divisor + thin_tokens
        g = g - total / divisor
        federation_tokens += divisor
        expected.append((g, federation_tokens))
    for proc in (CARRIER, MEMBER):
        for round_ in range(1, rounds + 1):
            flat, committed, fed_tokens, refused, carried, tokens = out[(proc, round_)]
            assert committed and not refused, (proc, round_, refused)
            assert carried == (proc == CARRIER and round_ == 2) and tokens == ROUND * TOKENS[proc]
            assert fed_tokens == expected[round_ - 1][1]
            torch.testing.assert_close(flat, expected[round_ - 1][0], rtol=0, atol=1e-6,
                                       msg=f"island {proc}, round {round_}")
    assert torch.equal(out["joined"], _flat(_model()).bfloat16().float())
    sent, weights, events = out["thin"]
    g1 = expected[0][0]  # what it downloaded: its weights moved by the global weights' move since its base
    assert torch.equal(weights, sent + (g1.bfloat16().float() - thin_base))
    assert events == ["join", "upload", "carry"]


def test_the_thin_and_carrier_settings_are_checked():
    from archipelago.config import ConfigError
    from archipelago.config.schema import Config
    from archipelago.config.validate import validate

    def problems(**ft: Any) -> str:
        with pytest.raises(ConfigError) as err:
            validate(Config(fault_tolerance=FaultToleranceConfig(enable=True, group_size=3, **ft)))
        return str(err.value)

    assert "carrier_island (0) must be another island" in problems(carrier="http://h:1", replica_id=0)
    assert "set fault_tolerance.enable = true" in str(pytest.raises(
        ConfigError, validate, Config(fault_tolerance=FaultToleranceConfig(carrier="http://h:1", replica_id=2,
                                                                          carrier_island=0))).value)
    assert "carried_tokens > 0" in problems(carries=2)
    assert "sync_width = 1" in problems(carries=2, carried_tokens=10, sync_width=2)
    assert "outer_weighting = \"tokens\"" in problems(carries=2, carried_tokens=10, outer_weighting="equal")
    validate(Config(fault_tolerance=FaultToleranceConfig(enable=True, group_size=3, carries=2, carried_tokens=10)))
    # Under time pacing members compare their batch's tokens per step (the federation's token
    # budget); a carrier declares its thin island's on top, and still joins the members.
    from archipelago.federation import island_fingerprint
    from archipelago.federation.membership import mismatch

    timed = dict(enable=True, group_size=3, round_pacing="time")
    named = list(_model().named_parameters())
    carrier, member = (island_fingerprint(FaultToleranceConfig(replica_id=k, **extra, **timed), named, "m", 1,
                                          THIN_TOKENS, None, None)
                       for k, extra in ((CARRIER, dict(carries=2, carried_tokens=64000)), (MEMBER, {})))
    assert carrier["tokens_per_step"] > member["tokens_per_step"] == THIN_TOKENS
    assert mismatch(carrier, member) is None
    other = island_fingerprint(FaultToleranceConfig(replica_id=MEMBER, **timed), named, "m", 1, 2 * THIN_TOKENS,
                               None, None)
    assert "pacing" in str(mismatch(other, member))  # another batch: another token budget
    # Neither side runs without the federation key: nothing would tell the other's bytes from anyone's.
    from archipelago.federation.carrying import Carrying

    with pytest.raises(ConfigError, match="needs a federation key"):
        ThinIsland(_thin_ft("http://127.0.0.1:1"), 10, list(_model().parameters()), 0, 1, None, _Hooks())
    with pytest.raises(ConfigError, match="needs a federation key"):
        Carrying(FaultToleranceConfig(carries=2, carried_tokens=10), None, 10, 100, 0.1)


def test_a_carriers_failed_round_carries_the_thin_rows_in_the_next_one_staler(monkeypatch):
    from archipelago.federation.carry_link import CarryClient
    from archipelago.federation.carrying import Carrying
    from archipelago.federation.outer_core import Carried, OuterCore

    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    key = FederationKey(bytes.fromhex(new_secret()))
    numel = 64
    ft = FaultToleranceConfig(replica_id=CARRIER, carries=THIN, carried_tokens=4096, staleness_exponent=1.0)
    carrying = Carrying(ft, key, numel, tokens_per_step=100, inner_lr=INNER_LR)
    try:
        core = OuterCore(ft, [torch.zeros(numel)])
        carrying.publish(3, core.globals[0])
        client = CarryClient(key, THIN, CARRIER, carrying.server.address(), numel, timeout=10)
        row = torch.full((numel,), 1e-3)
        client.upload(client.download(), 640, build_codec(ft, numel), row)
        own = torch.full((numel,), 2e-3)
        values, tokens, uploads = carrying.fold(core, own, 200, 0, outer_step=4)  # 1 step stale
        assert tokens == 840 and len(uploads) == 1
        assert torch.equal(values, core.fold(own, 200, 0, [Carried(uploads[0].values, 640, 1)])[0])
        carrying.after_round(uploads, committed=False, step=4, weights=core.globals[0])
        values, tokens, again = carrying.fold(core, own, 200, 0, outer_step=5)  # the next round: 2 steps stale
        assert again == uploads and tokens == 840
        assert torch.equal(values, core.fold(own, 200, 0, [Carried(uploads[0].values, 640, 2)])[0])
        carrying.after_round(again, committed=True, step=6, weights=core.globals[0] + 1)
        assert carrying.fold(core, own, 200, 0, outer_step=6)[2] == []  # carried in: gone
        assert client.download().step == 6  # the weights published after the committed round
    finally:
        carrying.close()


@pytest.mark.timeout(60)
def test_a_time_paced_thin_island_carries_after_carry_rounds_rounds_of_seconds(monkeypatch):
    # Under round_pacing = "time" a thin island carries after carry_rounds x round_seconds of
    # inner steps, held to carry_rounds x min_inner_steps and x max_inner_steps like a member's
    # rounds (policy.round_is_up): here the step bounds decide, so no clock is read by the test.
    from dataclasses import replace

    from archipelago.config.schema import Config
    from archipelago.config.validate import validate

    key, model, server = _served(monkeypatch)
    thin = None
    try:
        for outer_step, (seconds, bounds, due_at) in enumerate(((1e-6, dict(min_inner_steps=3), 3 * CARRY_ROUNDS),
                                                                (1e6, dict(max_inner_steps=4), 4 * CARRY_ROUNDS))):
            server.publish(outer_step, _flat(model))  # a round apart: the carrier takes one row a round
            ft = replace(_thin_ft(server.address()), round_pacing="time", round_seconds=seconds, **bounds)
            validate(Config(fault_tolerance=ft))  # a thin island may be time-paced
            hooks = _Hooks()
            thin = ThinIsland(ft, 100, list(model.parameters()), 0, 1, key, hooks)
            thin.join(0)
            for step in range(1, due_at + 1):
                assert thin.in_flight is None, f"carried after {step - 1} steps, not {due_at}"
                hooks.step = step
                thin.after_step(step, THIN_TOKENS, 0.0)
            thin.finish_carry(hooks.step)
            (upload,) = server.take_uploads()
            assert upload.tokens == due_at * THIN_TOKENS
            thin.shutdown()
    finally:
        if thin is not None:
            thin.shutdown()
        server.close()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as intended
def test_a_restarted_thin_island_sends_the_progress_it_checkpointed(monkeypatch, tmp_path):
    # Its checkpoint (DCP, as the trainer saves `checkpoint_state()`) keeps the base of its
    # next row and the tokens and steps since its last carry: restarted, it moves its
    # checkpointed weights by what the global weights moved since that base, and its next
    # upload carries that progress with its tokens.
    import torch.distributed.checkpoint as dcp

    key, model, server = _served(monkeypatch)
    thin = restarted = None
    try:
        g0 = _flat(model) + 0.25
        server.publish(3, g0)
        hooks = _Hooks()
        thin = ThinIsland(_thin_ft(server.address()), 100, list(model.parameters()), 0, 1, key, hooks)
        thin.join(0)
        _train(thin, model, hooks, carry=1)
        thin.finish_carry(hooks.step)
        assert len(server.take_uploads()) == 1
        base = _flat(model)  # the row since then is measured from here: its carry landed at once
        for _ in range(ROUND):  # part of the next carry's steps, then the checkpoint
            hooks.step += 1
            _set_flat(model, _flat(model) + 1e-3)
            thin.after_step(hooks.step, THIN_TOKENS, 0.0)
        assert torch.equal(thin.state_dict()["bridge0"], base) and thin.state_dict()["tokens"] == ROUND * THIN_TOKENS
        dcp.save(thin.checkpoint_state(), checkpoint_id=tmp_path / "checkpoint", no_dist=True)
        checkpointed = _flat(model)
        thin.shutdown()
        # The restart: the checkpointed weights and state, and meanwhile the federation moved on.
        g1 = g0 - 0.5
        server.publish(6, g1)
        again = _model()
        _set_flat(again, checkpointed.clone())  # (its parameters become views of what it is given)
        restarted = ThinIsland(_thin_ft(server.address()), 100, list(again.parameters()), 0, 1, key, hooks)
        dcp.load(restarted.checkpoint_state(), checkpoint_id=tmp_path / "checkpoint", no_dist=True)
        restarted.join(hooks.step)
        resumed = g1.bfloat16().float() + (checkpointed - base)
        assert torch.equal(_flat(again), resumed)
        for _ in range(ROUND * CARRY_ROUNDS - ROUND):  # the rest of the carry's steps
            hooks.step += 1
            restarted.after_step(hooks.step, THIN_TOKENS, 0.0)
        restarted.finish_carry(hooks.step)
        (upload,) = server.take_uploads()
        assert upload.base_step == 6 and upload.tokens == ROUND * CARRY_ROUNDS * THIN_TOKENS
        assert torch.equal(upload.values, g1.bfloat16().float() - resumed)
    finally:
        for island in (thin, restarted):
            if island is not None:
                island.shutdown()
        server.close()
