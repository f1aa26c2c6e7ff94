"""What decides that a member gave an exchange up ("Trust, third round", item 8).

The quorum's TCPStore listens on LOCAL_ADDR without authentication: anyone who reaches it
can write there. With a federation key only a record signed by a member for this very
exchange makes the others give it up (give_up.py), and a store that does not answer is not
taken for a dead host; only a host that refuses the connection is.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from conftest import rank_context, rank_manager

from archipelago.federation import give_up
from archipelago.federation.exchange import Framing, Gathered, SkippedWork
from archipelago.federation.trust import FederationKey, member_id, new_secret

QUORUM, STEP = 7, 3


class _StoreManager:
    """What give_up.py reads of a torchft manager: the quorum's store and this member's place
    in it (as remember_store notes them), the quorum's members, errors."""

    def __init__(self, address: str, replica_rank: int = 0, replica_ids: list[str] | None = None) -> None:
        self._archipelago_quorum_store = address
        self._archipelago_quorum_place = (replica_rank, 0)
        self._archipelago_replica_ids = replica_ids or []
        self.errors: list[Exception] = []

    def num_participants(self) -> int:
        return 3

    def errored(self) -> Exception | None:
        return self.errors[0] if self.errors else None

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)


class _NeverDone:
    """A dead member's pending transfer: the transport never completes nor fails it."""

    def wait(self, timeout: Any = None) -> bool:
        raise AssertionError("waited on a collective another member gave up")

    def get_future(self) -> torch.futures.Future:
        return torch.futures.Future()


def _waits_out(manager: _StoreManager, framing: Framing, arrives_s: float) -> bool:
    """Does a member waiting for rows that arrive after `arrives_s` wait for them (True), or
    give the exchange up first (False)?"""
    gathered = Gathered(_NeverDone(), framing, stamped=True)

    class Arrived:
        def wait(self, timeout: Any = None) -> bool:
            return True

    def arrive() -> None:
        gathered.work = Arrived()
        gathered.done_at.append(time.monotonic())

    timer = threading.Timer(arrives_s, arrive)
    timer.start()
    try:
        give_up.wait_for(manager, gathered, framing)
    finally:
        timer.cancel()
    return not manager.errors and not isinstance(gathered.work, SkippedWork)


def test_records_an_outsider_writes_into_the_quorum_store_do_not_fail_the_exchange(caplog):
    # The attack: `torchft/{quorum}/0/archipelago/given_up/{step}/0` written by anyone who
    # reaches the store made every waiting member fail the exchange and its retries (on
    # ac842c6 the first wait below gives up). Then what a sniffer who saw the record's name
    # could write there: a record of another federation, an earlier exchange's genuine one,
    # another bridge rank's, one naming a place the quorum gives another island, garbage.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outsider = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
    prefix = f"torchft/{QUORUM}/0/"
    address = f"127.0.0.1:{store.port}/{prefix.rstrip('/')}"
    key = FederationKey(bytes.fromhex(new_secret()))
    members = [member_id(key, island) for island in range(3)]
    framing = Framing(key, quorum=QUORUM, step=STEP, fragment=0, island=0)
    waiting = _StoreManager(address, 0, members)

    outsider.set(f"{prefix}archipelago/given_up/{STEP}/0", "1")
    assert _waits_out(waiting, framing, arrives_s=4 * give_up.POLL_S)

    name = prefix + give_up.key(framing, 0)
    island_1 = replace(framing, island=1)
    other = replace(island_1, key=FederationKey(bytes.fromhex(new_secret())))
    forgeries = {
        "another federation's": give_up.record(other, 1, 0),
        "an earlier exchange's": give_up.record(replace(island_1, step=STEP - 1), 1, 0),
        "another quorum's": give_up.record(replace(island_1, quorum=QUORUM - 1), 1, 0),
        "another bridge rank's": give_up.record(island_1, 1, 1),
        "island 1 as replica rank 2": give_up.record(island_1, 2, 0),
        "garbage": os.urandom(158),
    }
    with caplog.at_level(logging.DEBUG, logger="archipelago.federation"):
        for what, value in forgeries.items():
            outsider.set(name, value)
            assert not give_up.given_up(waiting, framing), what
        outsider.set(name, forgeries["garbage"])
        assert _waits_out(waiting, framing, arrives_s=3 * give_up.POLL_S)
    refusals = [r for r in caplog.records if "ignored a record in the quorum's store" in r.getMessage()]
    assert [r.levelno for r in refusals[:1]] == [logging.WARNING]  # logged once, then at debug level
    assert all(r.levelno == logging.DEBUG for r in refusals[1:]) and len(refusals) >= len(forgeries)

    # A member that really gave the exchange up is believed, over the garbage, at once.
    announcing = _StoreManager(address, 1, members)
    give_up.announce(announcing, island_1)
    give_up.finish_announcing(announcing)
    gathered = Gathered(_NeverDone(), framing, stamped=True)
    give_up.wait_for(waiting, gathered, framing)
    assert isinstance(waiting.errors[0], give_up.ExchangeGivenUp) and isinstance(gathered.work, SkippedWork)
    assert "island 1, replica rank 1" in str(waiting.errors[0])
    assert not give_up.given_up(waiting, replace(framing, step=STEP + 1))  # bound to its exchange

    # Without a key, what remains: a plain record under a name anyone can guess counts.
    plain = Framing(None, quorum=QUORUM, step=STEP + 5, fragment=0, island=0)
    outsider.set(f"{prefix}archipelago/given_up/{STEP + 5}/0", "1")
    assert give_up.given_up(_StoreManager(address), plain)


def _within(seconds: float, call: Any, *args: Any) -> list[Any]:
    """[call(*args)], or [] when it has not returned within `seconds` (left running)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    return out


def test_a_quorum_store_that_does_not_answer_is_not_taken_for_a_dead_host(monkeypatch, caplog):
    # A store that takes connections and never answers (its process stopped, or its
    # connections held by an outsider) held a waiting member in the store's client forever
    # on ac842c6 (the C++ client puts no deadline on a request), past every timeout of the
    # exchange; one that errs counted as "its host is gone". Neither may decide a round: only
    # a host that refuses the connection is gone. (On ac842c6 the first look never returns.)
    monkeypatch.setattr(give_up, "STORE_TIMEOUT_S", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def hold() -> None:  # take every connection, answer none
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # the listener was shut
                return

    threading.Thread(target=hold, daemon=True).start()
    key = FederationKey(bytes.fromhex(new_secret()))
    framing = Framing(key, quorum=QUORUM, step=STEP, fragment=0, island=0)
    port = listener.getsockname()[1]
    stalled = _StoreManager(f"127.0.0.1:{port}/torchft/{QUORUM}/0")
    try:
        with caplog.at_level(logging.WARNING, logger="archipelago.federation"):
            assert _within(30.0, give_up.given_up, stalled, framing) == [False]
        assert any("did not answer" in r.getMessage() for r in caplog.records)
        began = time.monotonic()
        assert not give_up.given_up(stalled, framing)  # looked at again only after STORE_QUIET_S
        assert time.monotonic() - began < 0.5
        # After the quiet, the look that never returned still holds that store: no new one
        # is started there (each would hang a thread), and it is still not news.
        stalled._archipelago_store_quiet = None
        assert _within(5.0, give_up.given_up, stalled, framing) == [False]
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone leaves the port listening)
        listener.close()
        for connection in held:
            connection.close()
    # Nothing listens there now: the host refuses the connection, its process is gone.
    gone = _StoreManager(f"127.0.0.1:{port}/torchft/{QUORUM}/0")
    assert give_up.refused(gone._archipelago_quorum_store)
    assert give_up.given_up(gone, framing)
    assert "refuses connections" in (give_up.look(_StoreManager(gone._archipelago_quorum_store), framing) or "")


def test_the_give_up_record_has_a_frame_kind_of_its_own():
    # The kind is in what the signature binds (tests/test_trust.py lists every kind): one
    # shared with another frame would let that frame be read as a give-up record.
    from archipelago.federation import carry, exchange, inner_state, membership, repair, trust

    others = {trust.HEAL_REQUEST, trust.HEAL_STATE, exchange.ROUND_ROW, exchange.ROUND_SEGMENT, exchange.ROUND_SUM,
              exchange.ROUND_AGREE, membership.JOIN, membership.CLAIM, inner_state.MOMENTS, carry.CARRIED_ROW,
              carry.GLOBAL_WEIGHTS, carry.CARRY_REQUEST, repair.ROUND_PART}
    assert give_up.GIVEN_UP not in others


# ---- members of a real gloo group, waiting in their agreement --------------------------------


def _agreeing_member(rank: int, store_port: int, secret: str, late_s: float, out: Any) -> None:
    """One of three members of a gloo group (torchft's, met on the quorum's store) settling
    an exchange: members 0 and 1 start their agreement at once, member 2 `late_s` later (its
    flag is slow to come), while an outsider writes into the store."""
    from datetime import timedelta

    from torchft.manager import ExceptionWithTraceback
    from torchft.process_group import ProcessGroupGloo

    from archipelago.federation.agreement import agree_on_exchange

    class _Member:  # torchft's Manager as the agreement and give_up.py use it
        def __init__(self, pg: Any) -> None:
            self._pg, self._errored = pg, None
            self._archipelago_quorum_store = f"127.0.0.1:{store_port}/torchft/{QUORUM}/0"
            self._archipelago_quorum_place = (rank, 0)

        def num_participants(self) -> int:
            return 3

        def errored(self) -> Any:
            return self._errored

        def report_error(self, error: Exception) -> None:
            self._errored = ExceptionWithTraceback(error)

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(f"127.0.0.1:{store_port}/torchft/{QUORUM}/0", f"island_{rank}", rank, 3)
    manager = _Member(pg)
    framing = Framing(FederationKey(bytes.fromhex(secret)), quorum=QUORUM, step=STEP, fragment=0, island=rank)
    out[f"ready_{rank}"] = True
    if rank == 2:
        time.sleep(late_s)
    flags = agree_on_exchange(manager, framing, torch.device("cpu"))
    out[rank] = (flags, None if manager.errored() is None else str(manager.errored().original_exception))


@pytest.mark.timeout(180)
def test_members_waiting_in_a_real_agreement_ignore_an_outsiders_record():
    # The attack on ac842c6, end to end: while members 0 and 1 wait for member 2's flag,
    # an outsider who reaches the quorum's store writes the record that said "a member gave
    # this exchange up"; both gave the exchange up (no agreement: the round lost, and its
    # retries too, if written for them). With a key they wait for member 2 and agree.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outsider = TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
    late_s = 6 * give_up.POLL_S
    context = rank_context()
    procs: list[Any] = []
    try:
        with rank_manager() as shared:
            out = shared.dict()
            secret = new_secret()
            procs = [context.Process(target=_agreeing_member, args=(rank, store.port, secret, late_s, out))
                     for rank in range(3)]
            for proc in procs:
                proc.start()
            deadline = time.monotonic() + 120
            while not all(out.get(f"ready_{rank}") for rank in range(3)) and time.monotonic() < deadline:
                time.sleep(0.05)
            outsider.set(f"torchft/{QUORUM}/0/archipelago/given_up/{STEP}/0", "1")
            for proc in procs:
                proc.join(timeout=120)
            codes, results = [proc.exitcode for proc in procs], dict(out)
    finally:
        for proc in procs:  # by PID, whatever happened
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=10)
    assert codes == [0, 0, 0], (codes, results)
    assert [results[rank] for rank in range(3)] == [([1.0, 1.0, 1.0], None)] * 3, results
