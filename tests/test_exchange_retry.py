"""An exchange that survives a member's death: the survivors re-form the quorum at once and
run the round's exchange again, and every island commits the same rows or none does.

The retry decisions are pure functions (policy.py, tested in tests/test_policy.py). Here:
the agreement's flags and which errors count first; then one-rank islands run the real
outer loop against torchft (an in-process lighthouse, islands as processes with known
local progress): island 2 SIGKILLs itself with its row of outer step 3 in flight
(ARCHIPELAGO_FAULT die_in_exchange), and the survivors' global weights are checked
against the average of their own updates, computed here. Last, the same drill through
`archipelago local --islands 1,1,1`.
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, rank_context, rank_manager, records, run_cli
from test_rounds import ROUND, TOKENS, _delta, _flat, _manager, _model, _train_round

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.agreement import agree_on_exchange, member_failure
from archipelago.federation.exchange import ROUND_AGREE, Framing
from archipelago.federation.trust import FederationKey, new_secret

# ---- which errors count, and the agreement's flags ---------------------------------------


class _Errored:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def errored(self) -> Any:
        from torchft.manager import ExceptionWithTraceback

        return None if self.error is None else ExceptionWithTraceback(self.error)


def test_only_a_member_or_link_failure_counts_not_a_refusal_of_rows():
    from archipelago.federation.codecs import PayloadError
    from archipelago.federation.membership import FederationMismatch
    from archipelago.federation.sums import SumRefused
    from archipelago.federation.trust import FrameRefused

    assert not member_failure(_Errored(None))
    assert member_failure(_Errored(RuntimeError("Connection reset by peer")))  # gloo, a dead member
    for refusal in (SumRefused("x"), PayloadError("x"), FrameRefused("x"), FederationMismatch("x")):
        assert not member_failure(_Errored(refusal)), refusal


class _Group:
    """torchft's manager and process group for agree_on_exchange: the other members' rows
    are given; `fail` makes the all-gather raise, as a broken gloo group does."""

    def __init__(self, others: list[torch.Tensor], fail: bool = False) -> None:
        self.others, self.fail, self.errors = others, fail, []
        self._pg = self

    def num_participants(self) -> int:
        return len(self.others) + 1

    def allgather(self, outputs, inputs, options):
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        outputs[0][0].copy_(inputs[0])
        for out, row in zip(outputs[0][1:], self.others):
            out.copy_(row)
        return self

    def wait(self) -> bool:
        return True

    def errored(self) -> Any:
        return self.errors[0] if self.errors else None

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)


def test_the_agreement_flags_are_signed_for_the_quorum_and_a_broken_group_agrees_on_nothing():
    key = FederationKey(os.urandom(32))
    framing = Framing(key, quorum=7, step=3, fragment=0, island=0)

    def flag(island: int, ok: bool, quorum: int = 7) -> torch.Tensor:
        return Framing(key, quorum, 3, 0, island).frame(0.0, float(ok), torch.tensor([int(ok)], dtype=torch.uint8),
                                                        framing.row_bytes(1), ROUND_AGREE)

    cpu = torch.device("cpu")
    assert agree_on_exchange(_Group([flag(1, True), flag(2, True)]), framing, cpu) == [1.0, 1.0, 1.0]
    assert agree_on_exchange(_Group([flag(1, False), flag(2, True)]), framing, cpu) == [1.0, 0.0, 1.0]
    # A flag of the failed attempt's quorum (a replay), or of another key, says nothing.
    assert agree_on_exchange(_Group([flag(1, True, quorum=6), flag(2, True)]), framing, cpu)[1] is None
    broken = _Group([flag(1, True)], fail=True)
    assert agree_on_exchange(broken, framing, cpu) is None
    assert broken.errors, "the failed agreement is the manager's error: the round does not commit"


def test_a_failed_exchange_lets_go_of_its_collectives_before_the_group_is_closed():
    # gloo keeps a process group's connections open while a work of it is referenced, so a
    # member blocked on this island in a ring would wait for the group's timeout
    # (bench/gloo_abort.py: 5 s, the peers' lifetime, against 0.01 s).
    import gc
    import weakref

    from archipelago.federation.agreement import abandon_group
    from archipelago.federation.exchange import Gathered, SecondPhase

    class _Work:
        def wait(self) -> bool:
            return True

    first, second = _Work(), _Work()
    refs = [weakref.ref(first), weakref.ref(second)]
    rows = torch.ones(4)
    gathered = Gathered(first, Framing(), [rows])
    gathered.second = SecondPhase([1.0], work=second)
    del first, second
    alive_at_abort: list = []

    class _Group:
        def abort(self) -> None:
            gc.collect()
            alive_at_abort.extend(ref() for ref in refs)

    manager = type("Manager", (), {"_pg": _Group()})()
    abandon_group(manager, gathered, None)
    assert alive_at_abort == [None, None]  # released before the group was closed
    assert gathered.work.wait() and gathered.second.work.wait()  # waiting on them returns at once
    assert gathered.outputs[0] is rows  # the rows stay


# ---- a member whose exchange failed alone, on a real gloo group ----------------------------


def _settling_member(rank: int, store_port: int, secret: str, out: Any) -> None:
    """One member of a three-member gloo group (torchft's): member 0's exchange failed
    alone (its manager holds a link error), so it skipped the first phase's tables, which
    members 1 and 2 all-gather; then each settles the exchange."""
    import logging
    from datetime import timedelta

    from torchft.manager import ExceptionWithTraceback, Manager
    from torchft.process_group import ProcessGroupGloo

    from archipelago.federation.agreement import settle_exchange
    from archipelago.federation.exchange import allgather

    class _Member:  # torchft's Manager as the exchange uses it: its group, its error, wrap_future
        wrap_future = Manager.wrap_future

        def __init__(self, pg: Any) -> None:
            self._pg, self._errored, self._timeout = pg, None, timedelta(seconds=20)
            self._logger = logging.getLogger("member")

        def num_participants(self) -> int:
            return 3

        def errored(self) -> Any:
            return self._errored

        def report_error(self, error: Exception) -> None:
            self._errored = ExceptionWithTraceback(error)

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(f"127.0.0.1:{store_port}/settle", f"member_{rank}", rank, 3)
    manager = _Member(pg)
    if rank == 0:
        manager.report_error(RuntimeError("Connection reset by peer"))
    else:
        work, _ = allgather(manager, torch.zeros(48), 3)  # a first phase's tables: 192 bytes a member
        work.wait()
    framing = Framing(FederationKey(bytes.fromhex(secret)), quorum=1, step=0, fragment=0, island=rank)
    out[rank] = settle_exchange(manager, framing, torch.device("cpu"), [])


@pytest.mark.timeout(120)
def test_a_member_whose_exchange_failed_alone_closes_the_group_instead_of_sending_its_flag():
    # torchft skips a member's collectives after its first error, so member 0 is one
    # collective behind its peers. gloo numbers a group's collectives by the order each
    # member starts them: a flag sent now would be read as the peers' tables, and gloo
    # aborts the process on the size mismatch (a survivor of the four-island int8 drill was
    # lost so about once in forty runs). Member 0 closes the group instead; the peers' tables
    # and agreement fail, and all three settle on a failed exchange, every process alive.
    codes, out = _gloo_members(_settling_member, 3, (new_secret(),), join_s=90)
    assert codes == [0, 0, 0], codes
    assert out == {0: True, 1: True, 2: True}


def _gloo_members(target: Any, members: int, args: tuple, join_s: float) -> tuple[list[Any], dict[int, Any]]:
    """Run `target(rank, store_port, *args, out)` as `members` processes around one TCPStore
    (torchft's gloo groups rendezvous on it): their exit codes and what they put in `out`.
    Every process is joined, or killed by PID, before this returns."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = rank_context()
    procs: list[Any] = []
    try:
        with rank_manager() as shared:
            out = shared.dict()
            procs = [context.Process(target=target, args=(rank, store.port, *args, out)) for rank in range(members)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(timeout=join_s)
            return [proc.exitcode for proc in procs], dict(out)
    finally:
        for proc in procs:  # by PID, whatever happened
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=10)


# ---- the all-gather on a real gloo group ----------------------------------------------------


def _gathering_member(rank: int, store_port: int, members: int, numel: int, dies: int, out: Any) -> None:
    """One member of a gloo group (torchft's) that all-gathers a row of its own through
    exchange.allgather; member `dies` SIGKILLs itself right after starting (-1: none). Each
    survivor reports its rows (or None where the gather failed) and whether every buffer
    the collective wrote into was handed over; its process outlives the failure."""
    from datetime import timedelta

    from torchft.manager import ExceptionWithTraceback
    from torchft.process_group import ProcessGroupGloo

    from archipelago.federation.exchange import allgather, take_handed

    class _Member:  # torchft's Manager as the exchange uses it: its group and its error
        def __init__(self, pg: Any) -> None:
            self._pg, self._errored = pg, None

        def errored(self) -> Any:
            return self._errored

        def report_error(self, error: Exception) -> None:
            self._errored = ExceptionWithTraceback(error)

        def wrap_future(self, fut: Any, default: Any, timeout: Any = None) -> Any:
            return fut

    def _ring(*_: Any) -> None:
        raise AssertionError("gloo's own all-gather (its flat temporary) was used")

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(f"127.0.0.1:{store_port}/gather", f"member_{rank}", rank, members)
    pg.allgather = _ring  # the exchange must not reach it
    manager = _Member(pg)
    row = torch.arange(numel, dtype=torch.int32) + 1000 * rank
    work, rows = allgather(manager, row, members)
    held = {t.untyped_storage().data_ptr() for t in take_handed(manager)}
    if rank == dies:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - torchft's wrapper may raise where it does not report
        manager.report_error(exc)
    del work
    junk = [torch.ones(numel, dtype=torch.int32) for _ in range(4)]  # memory moves on meanwhile
    del junk
    gathered = None if manager.errored() is not None else [r[:4].tolist() + r[-1:].tolist() for r in rows]
    out[rank] = (gathered, all(r.untyped_storage().data_ptr() in held for r in rows))
    pg.abort()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("members", [2, 3, 4])
def test_the_all_gather_on_gloo_fills_every_row_through_buffers_the_island_holds(members):
    # gloo's own all-gather passes rows around a ring from a temporary of its own, freed when
    # a failure unwinds while its transport thread may still be sending from it (a survivor
    # aborted: writev ... Bad address). The exchange's all-gather is an all-to-all of
    # buffers it hands over instead: every member gets every row, in group rank order.
    numel = 5000
    codes, out = _gloo_members(_gathering_member, members, (members, numel, -1), join_s=60)
    assert codes == [0] * members, codes
    expected = [[1000 * k, 1000 * k + 1, 1000 * k + 2, 1000 * k + 3, 1000 * k + numel - 1] for k in range(members)]
    assert out == {rank: (expected, True) for rank in range(members)}


@pytest.mark.timeout(180)
def test_survivors_of_a_member_that_dies_mid_gather_fail_it_and_live_on():
    # Four members all-gather 16 MB rows; member 2 dies with its row in flight. Every
    # survivor's gather fails (no partial rows taken for whole ones) and its process goes
    # on: the buffers still being written from are the island's own, held.
    codes, out = _gloo_members(_gathering_member, 4, (4, 4 * 2**20, 2), join_s=60)
    assert codes == [0, 0, -signal.SIGKILL, 0], codes
    assert out == {rank: (None, True) for rank in (0, 1, 3)}, out


# ---- islands against torchft, one dies in the exchange -------------------------------------

DIES_AT = 3  # outer step: the join round is 1, so the second round of training


def _island(island: int, group: int, lighthouse: str, store_port: int, retries: int, out: Any,
            joins: Any = None, codec: str = "fp32", secret: str | None = None, repair: str = "restart") -> None:
    """One one-rank island of `group`: the join round, then three rounds of known local
    progress. With `joins` (an event), it starts when the event is set and trains the last
    round only. `secret`: the federation key's, in hex (every row signed)."""
    from archipelago.federation.diloco import OuterLoop
    from archipelago.federation.guard import DIE_IN_EXCHANGE, Poison
    from archipelago.federation.membership import fingerprint

    torch.set_num_threads(1)
    if joins is not None and not joins.wait(timeout=120):
        return
    manager = _manager(lighthouse, island, 0, 1, store_port)
    if repair == "segment":  # what the platform's manager has (membership.py): the quorum's member ids kept
        from archipelago.federation.membership import MembersOnly

        manager._client = MembersOnly(manager._client, None, manager)
    try:
        ft = FaultToleranceConfig(enable=True, group_size=group, min_replica_size=2, replica_id=island,
                                  sync_steps=ROUND, semi_sync_method="local_sgd", exchange_retries=retries,
                                  codec=codec, codec_block_size=16, topk_fraction=0.1, topk_chunk_size=16,
                                  exchange_repair=repair)
        model = _model()
        key = FederationKey(bytes.fromhex(secret)) if secret else None
        fp = fingerprint("two-linears", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, 1,
                         tokens_per_step=TOKENS[island], inner_lr=0.1, key=key)
        poisons = [Poison(DIE_IN_EXCHANGE, DIES_AT)] if island == 2 else []
        outer = OuterLoop(ft, [list(model.parameters())], 0, 1, manager, fp, poisons=poisons, key=key)
        joined = outer.join(group, 30 if joins is None else 0)
        out[(island, "join")] = (_flat(model), joined.committed, joined.healed, joined.participants, joined.weight)
        step = 0
        for round_ in range(1 if joins is None else 3, 4):
            report, step = _train_round(outer, model, island, round_, step)
            out[(island, round_)] = (_flat(model), report.committed, report.participants, report.retries,
                                     report.global_hash)
            out[(island, round_, "abandoned")] = len(outer.attempts.abandoned)  # failed attempts' buffers held
            out[(island, round_, "handed")] = sum(len(held) for held in outer.attempts.abandoned)  # their tensors
            out[(island, round_, "repaired")] = report.repaired
    finally:
        manager.shutdown(wait=False)


def _federation(retries: int, group: int = 3, joiner: bool = False, heartbeat_ms: int = 500,
                codec: str = "fp32", secret: str | None = None,
                repair: str = "restart") -> tuple[dict, list[int | None]]:
    """Run `group` islands (island 2 dies in outer step DIES_AT) and, with `joiner`, one more
    that asks to join as soon as island 2 is dead; their results and exit codes."""
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    # Heartbeats come every 100 ms: a dead island is dropped heartbeat_ms after its last one.
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000,
                                  heartbeat_timeout_ms=heartbeat_ms)
    count = group + joiner
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(count)]
    context = rank_context()
    procs: list[Any] = []
    try:
        with rank_manager() as shared:
            out, joins = shared.dict(), shared.Event()
            procs = [context.Process(target=_island, args=(k, group, lighthouse.address(), stores[k].port, retries,
                                                           out, joins if k == group else None, codec, secret, repair))
                     for k in range(count)]
            for proc in procs:
                proc.start()
            procs[2].join(timeout=150)  # the island that dies in the exchange
            joins.set()
            for proc in procs:
                proc.join(timeout=150)
            return dict(out), [proc.exitcode for proc in procs]
    finally:
        for proc in procs:  # by PID, whatever happened
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=10)
        lighthouse.shutdown()


def _average(start: torch.Tensor, islands: list[int], round_: int) -> torch.Tensor:
    """The outer step of local SGD with token weights: the islands' weighted mean, by hand."""
    weights = [TOKENS[k] for k in islands]
    return sum(w * (start + _delta(k, round_, start.numel())) for w, k in zip(weights, islands)) / sum(weights)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signed", [False, True], ids=["plain", "signed"])
def test_the_survivors_run_the_exchange_again_and_commit_their_own_two_updates(signed):
    # Signed: the retry's join frames, state claims, rows and agreement flags are all signed
    # for the new quorum (the joining island's test below checks that it is the new id).
    out, codes = _federation(retries=2, secret=new_secret() if signed else None)
    assert codes == [0, 0, -signal.SIGKILL], (codes, sorted(out.keys()))
    g0 = _flat(_model())
    g1 = _average(g0, [0, 1, 2], 1)
    g2 = _average(g1, [0, 1], 2)  # island 2's row never counts: it died with it in flight
    g3 = _average(g2, [0, 1], 3)
    for island in (0, 1):
        weights, committed, participants, retries, _ = out[(island, 2)]
        assert committed and participants == 2 and retries == 1, out[(island, 2)]
        torch.testing.assert_close(weights, g2, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[(island, 3)][0], g3, rtol=1e-6, atol=1e-6)
        assert out[(island, 3)][1:4] == (True, 2, 0)  # the next round: two islands, no retry
        # The failed attempt's buffers were held until the retry went through, then let go.
        assert [out[(island, r, "abandoned")] for r in (1, 2, 3)] == [0, 0, 0]
    assert out[(0, 2)][4] == out[(1, 2)][4] and out[(0, 3)][4] == out[(1, 3)][4]  # one global model


@pytest.mark.timeout(240)
def test_without_retries_the_round_a_member_died_in_is_lost_on_every_survivor():
    out, codes = _federation(retries=0)
    assert codes == [0, 0, -signal.SIGKILL], (codes, sorted(out.keys()))
    g1 = _average(_flat(_model()), [0, 1, 2], 1)
    for island in (0, 1):
        weights, committed, _, retries, _ = out[(island, 2)]
        assert not committed and retries == 0, out[(island, 2)]
        torch.testing.assert_close(weights, g1, rtol=1e-6, atol=1e-6)  # restored: its progress discarded
        torch.testing.assert_close(out[(island, 3)][0], _average(g1, [0, 1], 3), rtol=1e-6, atol=1e-6)
        # The lost exchange's buffers outlive its round (gloo may still write from them until
        # the next quorum aborts the old group) and go once the next exchange went through.
        assert [out[(island, r, "abandoned")] for r in (1, 2, 3)] == [0, 1, 0]
        # ... every tensor its collectives were handed among them (its rows sent, the flags).
        handed = [out[(island, r, "handed")] for r in (1, 2, 3)]
        assert handed[0] == handed[2] == 0 and handed[1] >= 2, handed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_retry_with_a_codec_keeps_the_survivors_bit_identical(codec):
    # int8 among three islands takes the reduce-scatter, the retry between two the all-gather;
    # top-k's error feedback is put back before the retry encodes the update again.
    out, codes = _federation(retries=2, codec=codec)
    assert codes == [0, 0, -signal.SIGKILL], (codes, sorted(out.keys()))
    for round_ in (2, 3):
        (a, *facts_a), (b, *facts_b) = out[(0, round_)], out[(1, round_)]
        assert torch.equal(a, b) and facts_a == facts_b, (facts_a, facts_b)
    assert out[(0, 2)][1:4] == (True, 2, 1)


@pytest.mark.timeout(240)
def test_with_four_islands_the_one_two_places_from_the_dead_one_is_not_left_waiting():
    # gloo's all-gather is a ring: island 0 waits on island 3, which gave up when island 2
    # died. The survivors close their failed group at once, so island 0 fails too and all
    # three retry together (without that, island 0 hung until the lighthouse's join timeout
    # formed a quorum without it: islands 1 and 3 committed the round alone).
    out, codes = _federation(retries=2, group=4)
    assert codes == [0, 0, -signal.SIGKILL, 0], (codes, sorted(out.keys()))
    g2 = _average(_average(_flat(_model()), [0, 1, 2, 3], 1), [0, 1, 3], 2)
    for island in (0, 1, 3):
        weights, committed, participants, retries, _ = out[(island, 2)]
        assert committed and participants == 3 and retries == 1, out[(island, 2)]
        torch.testing.assert_close(weights, g2, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(240)
def test_the_segment_repair_finishes_the_exchange_a_member_died_in_alike_on_every_survivor():
    # Four int8 islands take the reduce-scatter; island 2 dies with its segments in flight.
    # The survivors keep the rows that arrived (signed frames that open whole), send each
    # other only what is missing and cut the dead summer's segment in three parts.
    # int8's blocks encode alone and every cut is on a block boundary, so the repaired round
    # must equal the same federation's round run again whole, bit for bit.
    secret = new_secret()
    out, codes = _federation(retries=2, group=4, codec="int8", secret=secret, repair="segment")
    assert codes == [0, 0, -signal.SIGKILL, 0], (codes, sorted(out.keys(), key=str))
    restarted, codes = _federation(retries=2, group=4, codec="int8", secret=secret)
    assert codes == [0, 0, -signal.SIGKILL, 0] and restarted[(0, 2, "repaired")] == 0
    g2 = _average(_average(_flat(_model()), [0, 1, 2, 3], 1), [0, 1, 3], 2)
    for island in (0, 1, 3):
        weights, committed, participants, retries, _ = out[(island, 2)]
        assert committed and participants == 3 and retries == 1, out[(island, 2)]
        assert out[(island, 2, "repaired")] == 1 and out[(island, 3, "repaired")] == 0
        # int8 rounds each row and each summed part (blocks of 16): within two steps of the
        # largest update's 1/127, of the exact weighted mean.
        step = max(float(_delta(k, 2, g2.numel()).abs().max()) for k in (0, 1, 3)) / 127
        assert float((weights - g2).abs().max()) <= 2 * step
    for round_ in (2, 3):
        (a, *facts_a), (b, *facts_b), (c, *facts_c) = (out[(k, round_)] for k in (0, 1, 3))
        assert torch.equal(a, b) and torch.equal(a, c) and facts_a == facts_b == facts_c
        assert torch.equal(a, restarted[(0, round_)][0]) and facts_a[-1] == restarted[(0, round_)][-1]


@pytest.mark.timeout(240)
def test_an_island_joining_in_the_retried_quorum_heals_and_sends_nothing_as_in_any_round():
    # The joiner asks for a quorum while the survivors wait for the lighthouse to drop the dead
    # island (2 s of heartbeat timeout): the retried quorum has three members, one healing.
    # Signed: the joiner frames its rows for the new quorum's id, so the survivors' retry must
    # too, or each side would refuse the other's rows as replays.
    out, codes = _federation(retries=2, joiner=True, heartbeat_ms=2000, secret=new_secret())
    assert codes == [0, 0, -signal.SIGKILL, 0], (codes, sorted(out.keys()))
    g1 = _average(_flat(_model()), [0, 1, 2], 1)
    g2 = _average(g1, [0, 1], 2)
    for island in (0, 1):
        weights, committed, participants, retries, _ = out[(island, 2)]
        assert committed and participants == 3 and retries == 1, out[(island, 2)]
        torch.testing.assert_close(weights, g2, rtol=1e-6, atol=1e-6)  # the joiner's row counts for nothing
    weights, committed, healed, participants, weight = out[(3, "join")]
    assert committed and healed and participants == 3 and weight == 0.0, out[(3, "join")]
    torch.testing.assert_close(weights, g2, rtol=1e-6, atol=1e-6)
    g3 = _average(g2, [0, 1, 3], 3)  # then it trains with them
    for island in (0, 1, 3):
        torch.testing.assert_close(out[(island, 3)][0], g3, rtol=1e-6, atol=1e-6)


# ---- the drill through `archipelago local` ----------------------------------------------


def _rounds(island_dir: Path) -> list[dict]:
    """The island's outer_step records in order: the join round first (outer step 1), so
    the round that ends at outer step k is the k-th, committed or not."""
    return [r for r in records(island_dir) if r.get("event") == "outer_step"]


def _exits(run_dir: Path, done: Any) -> tuple[list[int], str]:
    """The islands' exit codes from federation.json, and what to print when they are not as
    expected: the end of the run's output and of each failed survivor's own console log
    (the run's output is cut to its last lines, which may not show that island)."""
    fed = json.loads((run_dir / "federation.json").read_text())
    codes = [i["exit_code"] for i in fed["islands"]]
    logs = [f"--- island-{k} console.log ---\n" + "\n".join(
                (run_dir / f"island-{k}" / "console.log").read_text(errors="replace").splitlines()[-60:])
            for k, code in enumerate(codes) if code and k != 2 and (run_dir / f"island-{k}" / "console.log").exists()]
    return codes, "\n".join([done.output[-4000:], *logs])


def _drill(run_dir: Path, retries: int, *extra: str, islands: str = "1,1,1") -> tuple[Any, list[list[dict]]]:
    done = run_cli(["local", "--islands", islands, "--no-table", "--heartbeat-timeout-ms", "500", *extra,
                    "--inject", f"2:die_in_exchange@{DIES_AT}", *TINY, "--training.val_every", "0",
                    "--checkpoint.no_enable", "--fault_tolerance.sync_steps", "4", "--training.steps", "12",
                    "--metrics.log_every", "4", "--fault_tolerance.exchange_retries", str(retries),
                    "--job.run_dir", str(run_dir)], timeout=240)
    survivors = [k for k in range(len(islands.split(","))) if k != 2]
    return done, [_rounds(run_dir / f"island-{k}") for k in survivors]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("retries", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_archipelago_local_survivors_commit_the_round_a_member_died_in(tmp_path, retries):
    done, rounds = _drill(tmp_path / "run", retries)
    codes, why = _exits(tmp_path / "run", done)
    assert codes == [0, 0, 128 + signal.SIGKILL], why
    assert re.search(rf"die_in_exchange@{DIES_AT}: this island dies now", done.output), done.output[-4000:]
    assert all(len(r) == 4 for r in rounds), rounds  # the join round and three rounds of 4 steps
    died, before = [r[DIES_AT - 1] for r in rounds], rounds[0][DIES_AT - 2]
    if retries:
        assert all(r["committed"] and r["participants"] == 2 and r["retries"] == 1 for r in died), died
        assert died[0]["global_hash"] == died[1]["global_hash"] != before["global_hash"]
        assert all(r["committed"] for island in rounds for r in island)  # no round lost
    else:
        assert not any(r["committed"] for r in died), died
        assert died[0]["global_hash"] == died[1]["global_hash"] == before["global_hash"]  # restored
    assert rounds[0][-1]["committed"] and rounds[0][-1]["global_hash"] == rounds[1][-1]["global_hash"]


@pytest.mark.timeout(300)
@pytest.mark.slow  # 25 s on 2 cores: make test-slow
@pytest.mark.parametrize("arrival", [0, 2], ids=["at-the-round-end", "two-steps-in"])
def test_decoupled_rounds_survive_a_member_that_dies_with_its_row_in_flight(tmp_path, arrival):
    # Every exchange overlaps the next round; island 2 dies right after handing its row off.
    # The survivors learn it when they finish that exchange (at their next round end, or two
    # steps into the round with arrival_steps), run it again without it, and commit it with
    # equal global weights; the last exchange enters at the end of the run.
    done, rounds = _drill(tmp_path / "run", 2, "--fault_tolerance.round_mode", "decoupled",
                          "--fault_tolerance.overlap_threshold", "0", "--fault_tolerance.arrival_steps", str(arrival))
    codes, why = _exits(tmp_path / "run", done)
    assert codes == [0, 0, 128 + signal.SIGKILL], why
    # The join round, its empty hand-off, then the exchanges of rounds 1-3, each finished a round later.
    assert all(len(r) == 5 for r in rounds), rounds
    died = [r[DIES_AT - 1] for r in rounds]
    assert all(r["committed"] and r["participants"] == 2 and r["retries"] == 1 and r["weight"] > 0
               for r in died), died
    assert all(r["committed"] for island in rounds for r in island)  # no round lost
    assert [r["global_hash"] for r in rounds[0]] == [r["global_hash"] for r in rounds[1]]
    assert sum(r["overlap_s"] > 0 for r in rounds[0]) >= 3  # the exchanges overlapped inner steps
    # Finished at a round's end (steps 4, 8, 12) or two steps into the next round (2, 6, 10).
    assert {r["step"] % 4 for r in rounds[0][2:-1]} == {arrival}


@pytest.mark.timeout(300)
@pytest.mark.slow  # about 30 s each on 2 cores: make test-slow
@pytest.mark.parametrize("rounds_of", [
    ("--fault_tolerance.round_mode", "decoupled", "--fault_tolerance.overlap_threshold", "0"),
    ("--fault_tolerance.average_optimizer_state",)], ids=["decoupled", "moments"])
def test_the_segment_repair_through_archipelago_local(tmp_path, rounds_of):
    # Four int8 islands, rows signed: island 2 dies with its segments in flight and the three
    # survivors finish that exchange by the segment repair with equal global weights. Every
    # exchange overlapping the next round (finished a round later), or with the AdamW
    # moments averaged (their exchange runs again whole after the repair).
    from archipelago.federation.trust import write_secret

    write_secret(str(tmp_path / "fed.key"))
    done, rounds = _drill(tmp_path / "run", 2, *rounds_of, "--fault_tolerance.codec", "int8",
                          "--fault_tolerance.exchange_repair", "segment", "--federation_security.key_file",
                          str(tmp_path / "fed.key"), islands="1,1,1,1")
    codes, why = _exits(tmp_path / "run", done)
    assert codes == [0, 0, 128 + signal.SIGKILL, 0], why
    died = [r[DIES_AT - 1] for r in rounds]
    assert all(r["committed"] and r["participants"] == 3 and r["retries"] == 1 and r["repaired"] == 1
               for r in died), died
    assert all(r["committed"] for island in rounds for r in island)  # no round lost
    assert [r["global_hash"] for r in rounds[0]] == [r["global_hash"] for r in rounds[1]] \
        == [r["global_hash"] for r in rounds[2]]


def test_decoupled_rounds_decide_overlap_and_staleness_from_the_signed_flags_alike():
    from archipelago.federation.decoupled import OVERLAP_SCALE, Handoffs

    key = FederationKey(os.urandom(32))
    framing = Framing(key, quorum=7, step=3, fragment=0, island=0)

    def flag(island: int, measured: float, overlapped: bool, quorum: int = 7) -> torch.Tensor:
        done = torch.tensor([1], dtype=torch.uint8)
        return Framing(key, quorum, 3, 0, island).frame(measured, float(overlapped), done, framing.row_bytes(1),
                                                        ROUND_AGREE)

    cpu, facts = torch.device("cpu"), []
    others = [flag(1, 0.08 * OVERLAP_SCALE, False), flag(2, 0.2 * OVERLAP_SCALE, True, quorum=6)]  # 2: a replay
    flags = agree_on_exchange(_Group(others), framing, cpu, 0.06 * OVERLAP_SCALE, False, facts)
    assert flags == [1.0, 1.0, None]
    assert facts == [(0.06 * OVERLAP_SCALE, 0.0), (0.08 * OVERLAP_SCALE, 0.0), (0.0, 0.0)]  # the replay says nothing
    assert Handoffs(0.05).decide(facts) == (False, True)    # both measured exchanges took over 5% of their rounds
    assert Handoffs(0.07).decide(facts) == (False, False)   # the lower median, 6%, is not above 7%: waited for
    assert Handoffs(0.0).decide([]) == (False, True)        # threshold 0: always overlap
    waiting = Handoffs(0.05)
    assert waiting.decide([]) == (False, False)             # no agreement: the island keeps its decision
    h = Handoffs(0.05)
    h.settle(overlapped=True, overlaps_next=True, applied=True)
    assert h.stale and h.overlaps                           # the next rows are one outer step stale
    h.settle(overlapped=True, overlaps_next=True, applied=False)
    assert not h.stale                                      # no outer step applied in between: fresh


def test_decoupled_second_phase_starts_once_the_first_phase_is_in_else_halfway():
    # The reduce-scatter's rows are judged (and its second phase started) at the first inner
    # step after they are in, wherever in the round that is, so both phases are hidden when
    # together they fit in a round; a wire that cannot tell (no completion stamps: NCCL)
    # judges halfway through the round, as before; a rank without rows has nothing to wait for.
    from types import SimpleNamespace

    from archipelago.federation.attempts import Pending
    from archipelago.federation.decoupled_rounds import DecoupledRounds
    from archipelago.federation.exchange import Gathered, SkippedWork
    from archipelago.federation.island_ranks import IslandRanks

    ft = FaultToleranceConfig(sync_steps=10, round_mode="decoupled")
    host = SimpleNamespace(ft=ft, ranks=IslandRanks(1, None), per_fragment=10, local_step=0, pending=None)
    rounds = DecoupledRounds(host)  # type: ignore[arg-type]

    def due_at(gathered: Gathered | None, arrives_after: int | None) -> list[int]:
        host.pending = Pending(fragment=0, gathered=gathered, midway=True)
        due = []
        for step in range(1, 11):
            host.local_step = step
            if gathered is not None and arrives_after == step - 1:
                gathered.done_at.append(0.0)  # the transport's thread: the rows are in
            if rounds.midway_due():
                due.append(step)
        return due

    stamped = lambda: Gathered(SkippedWork(), Framing(), stamped=True)  # noqa: E731
    assert due_at(stamped(), 2) == list(range(3, 11))   # in after step 2: judged at step 3
    assert due_at(stamped(), 8) == [9, 10]             # in late: never blocks halfway
    assert due_at(stamped(), None) == []               # never in: the round's end waits for it
    assert due_at(Gathered(SkippedWork(), Framing()), None) == [5]  # no stamps: halfway, 10 // 2
    assert due_at(None, None) == list(range(1, 11))    # nothing to wait for on this rank
    host.pending.judged = object()
    assert not rounds.midway_due()                     # judged once


class _StoreManager:
    """What give_up.py reads of a torchft manager: the quorum's store, errors."""

    def __init__(self, address: str) -> None:
        self._archipelago_quorum_store = address
        self.errors: list[Exception] = []

    def num_participants(self) -> int:
        return 3

    def errored(self) -> Exception | None:
        return self.errors[0] if self.errors else None

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)


class _NeverGathers:
    """A process group whose all-gather never completes (a dead member's pending send)."""

    def allgather(self, outputs: Any, inputs: Any, options: Any) -> _NeverDone:
        return _NeverDone()


class _NeverDone:
    def wait(self, timeout: Any = None) -> bool:
        raise AssertionError("waited on a collective another member gave up")

    def get_future(self) -> torch.futures.Future:
        return torch.futures.Future()  # never completes


def test_a_member_stuck_in_an_exchange_others_gave_up_stops_waiting():
    # Over slow links a survivor's gloo send can outlive the failed exchange's connections
    # (docs/rounds.md; bench/dead_peer_shaped.py): it learns from the quorum's store instead.
    import threading
    import time

    from torch.distributed import TCPStore

    from archipelago.federation import give_up
    from archipelago.federation.exchange import Gathered, SkippedWork

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}/torchft/7/0"
    framing = Framing(None, quorum=7, step=3, fragment=0, island=1)
    stuck, failed = _StoreManager(address), _StoreManager(address)
    gathered = Gathered(_NeverDone(), framing, stamped=True)
    threading.Timer(0.8, give_up.announce, (failed, framing)).start()  # a member saw the death
    began = time.monotonic()
    give_up.wait_for(stuck, gathered, framing)
    assert 0.7 < time.monotonic() - began < 0.8 + 2 * give_up.POLL_S + 2
    assert isinstance(stuck.errors[0], give_up.ExchangeGivenUp) and isinstance(gathered.work, SkippedWork)
    assert member_failure(_Errored(stuck.errors[0]))  # the usual retry follows
    # The key is per exchange: the next outer step's, or another fragment's, is not given up.
    assert not give_up.given_up(stuck, replace(framing, step=4))
    assert not give_up.given_up(stuck, replace(framing, fragment=1))
    # Rows that arrive are waited for as before; nobody gave up, nothing reported.
    fresh = _StoreManager(address)
    arrived = Gathered(SkippedWork(), replace(framing, step=5), stamped=True)
    threading.Timer(0.3, arrived.done_at.append, (0.0,)).start()
    give_up.wait_for(fresh, arrived, arrived.framing)
    assert not fresh.errors
    # The second phase (the summed segments) waits the same way: given up, its sum is zeros
    # and the round fails as if its own collective had.
    from archipelago.federation.exchange import SecondPhase
    from archipelago.federation.sums import _read_second_phase

    summing = _StoreManager(address)
    second = Gathered(SkippedWork(), framing, stamped=True)
    second.second = SecondPhase([1.0], work=_NeverDone(), failed=False, stamped=True)
    into = torch.ones(8)
    _read_second_phase(second, None, into, summing, False)  # type: ignore[arg-type]
    assert isinstance(summing.errors[0], give_up.ExchangeGivenUp) and not into.any()
    # The members' agreement flags wait the same way: no agreement, the round fails.
    from archipelago.federation.agreement import agree_on_exchange

    agreeing = _StoreManager(address)
    agreeing._pg = _NeverGathers()
    began = time.monotonic()
    assert agree_on_exchange(agreeing, framing, torch.device("cpu")) is None
    assert time.monotonic() - began < 2 * give_up.POLL_S + 2
    assert isinstance(agreeing.errors[0], give_up.ExchangeGivenUp)
    # A quorum store that cannot be reached: its host, a member, is gone.
    port = store.port
    del store
    gone = _StoreManager(f"127.0.0.1:{port}/torchft/7/0")
    give_up.STORE_TIMEOUT_S, saved = 1.0, give_up.STORE_TIMEOUT_S
    try:
        assert give_up.given_up(gone, framing)
        # Announcing to that store hangs in its C++ client until the timeout; a process that
        # ends meanwhile aborts (exit code 134) when the thread returns, so the shutdown
        # waits for it (bounded).
        give_up.announce(gone, framing)
        announcing = list(gone._archipelago_announcing)
        assert [t.is_alive() for t in announcing] == [True]
        give_up.finish_announcing(gone)
        assert not announcing[0].is_alive() and gone._archipelago_announcing == []
    finally:
        give_up.STORE_TIMEOUT_S = saved


class _Errored:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def errored(self) -> Exception:
        return self.exc


class _NoFuture:
    """A transport's work without a usable future: nothing will ever stamp its completion."""

    waited = False

    def wait(self, timeout: Any = None) -> bool:
        self.waited = True
        return True

    def get_future(self) -> Any:
        raise RuntimeError("this work has no future")


class _NoFutureGroup:
    def allgather(self, outputs: Any, inputs: Any, options: Any) -> _NoFuture:
        return _NoFuture()


def test_a_work_without_a_future_is_waited_on_plainly_by_every_phase():
    # Every phase decides `stamped` the same way (exchange.stamping): a work that will never
    # be stamped is waited on plainly; polling an empty stamp list for it would spin until
    # some member gave the exchange up.
    from archipelago.federation import give_up
    from archipelago.federation.exchange import allgather, completion_stamps, stamping, stamps_list

    manager = _StoreManager("")
    manager._pg = _NoFutureGroup()
    stamps = completion_stamps(torch.device("cpu"))
    assert stamping(stamps) and not stamping(None)
    allgather(manager, torch.zeros(4), 2, stamps)  # the exchange's start (start_managed)
    assert not stamping(stamps) and not manager.errors
    raw = _NoFuture()
    phase = give_up.Collective(raw, stamps_list(stamps), stamping(stamps))
    give_up.wait_for(manager, phase, Framing(None, quorum=1, step=1, fragment=0, island=0))
    assert raw.waited and not manager.errors
