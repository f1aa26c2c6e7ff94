"""A member that gave an exchange up says so where the others look while they wait.

Behind slow links a survivor's pending gloo send can outlive every connection of a failed
exchange: the transport never fails it, so the survivor would wait out
`process_group_timeout_ms` while the members that saw the death ask the lighthouse for a
new quorum, and the lighthouse waits its join timeout for the one still heartbeating
(docs/rounds.md, "When a member dies in the exchange"). So the members of a quorum share
one more fact besides their rows: the quorum's TCPStore (where torchft's process group met,
hosted by one member) holds a record per exchange that a member whose exchange failed sets
(`announce`, from agreement.settle_exchange), and a member waiting for its exchange's rows
polls it every POLL_S seconds (`wait_for`: the rows of the first phase, the summed
segments of the second, the members' agreement flags). A store whose host refuses the
connection counts as the same news: its host, a member, is gone. Either way the waiting
member reports the exchange failed and lets go of it, as if its own collective had failed,
and the usual retry follows.

What it trusts. The store listens on LOCAL_ADDR with no authentication, so anyone who
reaches it can write there. With a federation key a record counts only when it is a frame
signed under the announcing island's key (kind GIVEN_UP), bound to the federation, quorum,
outer step and fragment, and naming the announcer's replica rank (the island the quorum
has there) and bridge rank; it lies under a name only members can compute (an HMAC of the
exchange's place), so an outsider off the path cannot find it to overwrite it either. A
record that does not verify is ignored (logged once per quorum). A member that lies by
announcing only fails an exchange, which it could do anyway by closing its connections.
A store that does not answer is not news: an outsider can stall it (holding its
connections, flooding it) far more cheaply than it can kill its host. Only a connection
its host refuses counts (nothing listens on the port: the process is gone, which an
outsider off the path cannot fake without guessing the connection's sequence number), and
a silent store is looked at again only after STORE_QUIET_S. The store's C++ client puts no
deadline on a request (a store that never answers held the waiting member forever), so
each look runs on a thread of its own, waited for 2 * STORE_TIMEOUT_S. A host whose whole
machine vanished (no refusal comes back) is then waited for as the transport allows: the
cost of not letting an outsider decide a round. Without a key the record is a plain "1"
under a name anyone can guess: whoever reaches the store can fail every exchange it knows
the step of (as, without a key, it can send rows too).

What it costs: one key lookup a POLL_S over the WAN while rows are still out (none when they
arrive sooner), a thread per look, one store connection per quorum, and with a key one
HMAC per look (the name) and per record found; a stalled store blocks a waiting member for
up to 2 * STORE_TIMEOUT_S + PROBE_TIMEOUT_S per STORE_QUIET_S. Wires that stamp no
completion (NCCL) wait as before.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from archipelago.federation.exchange import Framing, SkippedWork
from archipelago.federation.trust import FrameHeader, FrameRefused, member_island, open_frame, seal

log = logging.getLogger("archipelago.federation")

POLL_S = 0.5               # how often a waiting member looks at the key
STORE_TIMEOUT_S = 5.0      # connecting to, and asking, the quorum's store
PROBE_TIMEOUT_S = 1.0      # a store that did not answer: does its host refuse a connection? (one round trip)
STORE_QUIET_S = 15.0       # ... it does not: look there again after this long
# Frame kind of a member's record that it gave an exchange up (every kind is listed in
# tests/test_trust.py, each used once).
GIVEN_UP = 13
_RECORD = struct.Struct(">II")  # its payload: the announcer's replica rank and bridge (group) rank


class ExchangeGivenUp(RuntimeError):
    """Another member of the exchange gave it up (or the quorum's store's host is gone)."""


class Phase(Protocol):
    """A collective of the exchange in flight, as `wait_for` sees it (exchange.Gathered,
    exchange.SecondPhase, `Collective`)."""

    work: Any
    done_at: list[float]
    stamped: bool


@dataclass
class Collective:
    """Any other collective of the exchange (the agreement's flags): its work, and where the
    transport's thread stamps its completion (`exchange.stamp_completion`)."""

    work: Any
    done_at: list[float] = field(default_factory=list)
    stamped: bool = False


def remember_store(manager: Any, quorum: Any) -> None:
    """Note the quorum's store (as torchft's process group rendezvous uses it) on `manager`,
    and this member's place in the quorum (its replica rank, its bridge rank) that its
    records name."""
    rank = getattr(manager, "_group_rank", 0)
    manager._archipelago_quorum_store = f"{quorum.store_address}/torchft/{quorum.quorum_id}/{rank}"
    manager._archipelago_quorum_place = (int(getattr(quorum, "replica_rank", 0) or 0), int(rank))


def key(framing: Framing, group_rank: int = 0) -> str:
    """The store key of one exchange's record: bound to the outer step and fragment its rows
    are signed for (the quorum's id and the bridge rank are in the store's prefix, so a
    retry, which always has a new quorum, starts clean). With a key, an HMAC of that place
    that only members can compute (under island 0's key, which every member derives): an
    outsider who reaches the store cannot find the record to overwrite it, nor plant one
    ahead; without one, the step and fragment in plain."""
    if framing.key is None:
        return f"archipelago/given_up/{framing.step}/{framing.fragment}"
    place = b"archipelago given-up record\n%d %d %d %d" % (framing.quorum, framing.step, framing.fragment, group_rank)
    return f"archipelago/given_up/{framing.key.tag(0, place)[:16].hex()}"


def record(framing: Framing, replica_rank: int, group_rank: int) -> bytes:
    """What a member that gave the exchange up writes: with a key, a frame signed under its
    island's key for this federation, quorum, outer step and fragment, naming its replica
    and bridge ranks (kind GIVEN_UP, 158 bytes); without one, b"1"."""
    if framing.key is None:
        return b"1"
    header = FrameHeader(framing.quorum, framing.step, framing.fragment, framing.island, GIVEN_UP)
    return seal(framing.key, header, _RECORD.pack(replica_rank, group_rank))


def announcer(framing: Framing, value: bytes, group_rank: int, replica_ids: list[str]) -> tuple[int, int]:
    """(island, replica rank) of the member whose record `value` is, for the exchange
    `framing` names on bridge rank `group_rank`'s group; FrameRefused unless it is signed
    with the federation's key for this quorum, step and fragment, and names a place the
    quorum gives that island (`replica_ids`, by replica rank; not checked when unknown)."""
    assert framing.key is not None
    expect = FrameHeader(framing.quorum, framing.step, framing.fragment, 0, GIVEN_UP)
    got, payload = open_frame(framing.key, value, expect, any_island=True)
    if len(payload) != _RECORD.size:
        raise FrameRefused(f"a give-up record of {len(payload)} payload bytes, not {_RECORD.size}")
    rank, group = _RECORD.unpack(payload)
    if group != group_rank:
        raise FrameRefused(f"a give-up record of bridge rank {group}'s exchange, read on bridge rank {group_rank}'s")
    if replica_ids and (rank >= len(replica_ids) or member_island(framing.key, replica_ids[rank]) != got.island):
        raise FrameRefused(f"a give-up record of island {got.island} as replica rank {rank}, a place the quorum "
                           "gives no such member")
    return got.island, rank


def announce(manager: Any, framing: Framing) -> None:
    """This member gave the exchange up: say so in the quorum's store, from a thread of its
    own (best effort): connecting to a store whose host died may take STORE_TIMEOUT_S, which
    must not delay this member's own retry."""
    address = getattr(manager, "_archipelago_quorum_store", None)
    if address:
        replica_rank, group_rank = _place(manager)
        name, value = key(framing, group_rank), record(framing, replica_rank, group_rank)
        thread = threading.Thread(target=_announce, args=(address, name, value), name="archipelago-give-up",
                                  daemon=True)
        thread.start()
        announcing = [t for t in getattr(manager, "_archipelago_announcing", []) if t.is_alive()]
        manager._archipelago_announcing = [*announcing, thread]


def finish_announcing(manager: Any) -> None:
    """Before the process ends: wait for the announcing threads still connecting (and a
    look at the store that did not return: `_ask`). One left inside the store's C++ client
    when the interpreter shuts down aborts the process (exit code 134) as it returns, which
    would turn a finished run into a failed one. The client
    tries twice with a random delay between, so a store that is gone holds a thread for up to
    about three STORE_TIMEOUT_S: the most a shutdown right after a failed exchange waits."""
    deadline = time.monotonic() + 3 * STORE_TIMEOUT_S + 1.0
    for thread in getattr(manager, "_archipelago_announcing", []):
        thread.join(max(deadline - time.monotonic(), 0.0))
    manager._archipelago_announcing = []


def _announce(address: str, name: str, value: bytes) -> None:
    try:
        _connect(address).set(name, value)
    except Exception:  # noqa: BLE001 - the store's host may be the member that died
        pass


def given_up(manager: Any, framing: Framing) -> bool:
    """Has a member of this exchange given it up, or is the quorum's store's host gone?"""
    return look(manager, framing) is not None


def look(manager: Any, framing: Framing) -> str | None:
    """Why this member should give the exchange up (a member's record that verifies, or a
    store host that refuses connections), or None: nothing there, a record that does not
    verify (ignored, logged once per quorum), a store that does not answer (looked at again
    after STORE_QUIET_S)."""
    address = getattr(manager, "_archipelago_quorum_store", None)
    if not address or _quiet(manager, address):
        return None
    _, group_rank = _place(manager)
    value = _ask(manager, address, key(framing, group_rank), fetch=framing.key is not None)
    if isinstance(value, Exception):  # no answer: its host is gone, or someone stalls the store
        return _unanswered(manager, address, value)
    if value is None:
        return None
    if framing.key is None:
        return "a member's record in the quorum's store (unsigned: there is no federation key)"
    try:
        island, rank = announcer(framing, value, group_rank,
                                 list(getattr(manager, "_archipelago_replica_ids", None) or []))
    except FrameRefused as exc:
        _warn_once(manager, ("forged", address),
                   "ignored a record in the quorum's store (%s) that says a member gave outer step %d's exchange up: "
                   "%s. Only a record signed with the federation's key counts; the store takes writes from anyone "
                   "who reaches LOCAL_ADDR", address.partition("/")[0], framing.step, exc)
        return None
    return f"island {island}, replica rank {rank}, says so in a signed record in the quorum's store"


def wait_for(manager: Any, phase: Phase, framing: Framing) -> None:
    """Wait on `phase.work`, the first phase (its rows), the second (the summed segments)
    or the agreement of the exchange `framing` names; where the wire stamps its completion (`phase.stamped`),
    look every POLL_S whether another member gave the exchange up, and if so report it to
    the manager and let go of the collective (its buffers stay with the caller) instead of
    waiting on."""
    if not phase.stamped or manager.errored() is not None:
        phase.work.wait()
        return
    next_look = time.monotonic() + POLL_S
    while not phase.done_at:
        time.sleep(0.005)
        if time.monotonic() < next_look:
            continue
        why = look(manager, framing)
        if why is not None:
            manager.report_error(ExchangeGivenUp(
                f"another member gave this exchange up ({why}); the transport had not failed it here"))
            phase.work = SkippedWork()
            return
        next_look = time.monotonic() + POLL_S
    phase.work.wait()


def _ask(manager: Any, address: str, name: str, fetch: bool) -> bytes | None | Exception:
    """The record `name` in the quorum's store at `address` (b"" when not `fetch`ed), None
    when there is none, or the exception of a store that did not answer. Asked from a thread
    of its own: the store's C++ client puts no deadline on a request (measured with torch
    2.13: a `check`, or a new client's connection, never returned from a store whose process
    was stopped, nor from a listener that never answers; a host that vanishes without a
    reset looks the same), so this member waits at most 2 * STORE_TIMEOUT_S (a connection,
    then a request) and leaves the thread behind. Until that thread returns this member asks
    that store nothing more (it counts as not answering: at most one such thread a quorum's
    store); finish_announcing waits for it, bounded, before the process ends."""
    stuck = getattr(manager, "_archipelago_looking", None)
    if stuck is not None and stuck[0] == address and stuck[1].is_alive():
        return TimeoutError("it has not answered this member's last request yet")
    cached = getattr(manager, "_archipelago_store_client", None)
    if (cached is None or cached[0] != address) and refused(address):
        # Before a new client: its connection would retry a refusing host for up to about
        # three STORE_TIMEOUT_S, longer than the thread is waited for.
        return ConnectionRefusedError("its host refuses connections")
    answer: list[bytes | None | Exception] = []

    def ask() -> None:
        try:
            store = _store(manager)
            answer.append(None if not store.check([name]) else bytes(store.get(name)) if fetch else b"")
        except Exception as exc:  # noqa: BLE001 - any failure of the store or its connection
            answer.append(exc)

    thread = threading.Thread(target=ask, name="archipelago-give-up-look", daemon=True)
    thread.start()
    thread.join(2 * STORE_TIMEOUT_S)
    if answer:
        return answer[0]
    manager._archipelago_looking = (address, thread)
    manager._archipelago_announcing = [*getattr(manager, "_archipelago_announcing", []), thread]
    return TimeoutError(f"no answer within {2 * STORE_TIMEOUT_S:.0f} s")


def _place(manager: Any) -> tuple[int, int]:
    """(replica rank, bridge rank) of this member in the quorum (remember_store)."""
    place = getattr(manager, "_archipelago_quorum_place", None)
    return place if place is not None else (0, int(getattr(manager, "_group_rank", 0)))


def _unanswered(manager: Any, address: str, error: Exception) -> str | None:
    """The store did not answer: gone when its host refuses a connection (`refused`), else
    not news (an outsider can stall a store, or fill its connections, without killing its
    host): this member looks there again after STORE_QUIET_S, and waits for its transport
    meanwhile."""
    manager._archipelago_store_client = None  # the next look connects again
    if refused(address):
        return "the quorum's store refuses connections: its host, a member, is gone"
    manager._archipelago_store_quiet = (address, time.monotonic() + STORE_QUIET_S)
    _warn_once(manager, ("silent", address),
               "the quorum's store (%s) did not answer (%s), yet its host does not refuse connections (it is "
               "loaded, or someone holds its connections): not taken for a member's death; looking there again "
               "every %.0f s", address.partition("/")[0], str(error).splitlines()[0][:200] if str(error) else
               type(error).__name__, STORE_QUIET_S)
    return None


def refused(address: str) -> bool:
    """Does the host of the store at `address` (host:port/prefix) refuse a TCP connection to
    its port? Only a host whose store process is gone does (its kernel answers a reset);
    one that is loaded, whose connections an outsider holds, or that cannot be reached at
    all does not. An outsider off the path would have to guess the connection's sequence
    number to forge the reset."""
    host, _, port = address.partition("/")[0].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        pass
    return False


def _quiet(manager: Any, address: str) -> bool:
    """Is this quorum's store one that did not answer a moment ago (`_unanswered`)?"""
    quiet = getattr(manager, "_archipelago_store_quiet", None)
    return quiet is not None and quiet[0] == address and time.monotonic() < quiet[1]


def _warn_once(manager: Any, what: tuple[str, str], message: str, *args: Any) -> None:
    """Log `message` at warning level the first time for `what` (its kind and the quorum's
    store), then at debug level: a forger can write as often as it likes."""
    warned = getattr(manager, "_archipelago_store_warned", None)
    if warned is None:
        warned = manager._archipelago_store_warned = set()
    (log.debug if what in warned else log.warning)(message, *args)
    warned.add(what)


def _store(manager: Any) -> Any:
    """The quorum's store, connected once per quorum (None before any quorum)."""
    address = getattr(manager, "_archipelago_quorum_store", None)
    if not address:
        return None
    cached = getattr(manager, "_archipelago_store_client", None)
    if cached is not None and cached[0] == address:
        return cached[1]
    store = _connect(address)
    manager._archipelago_store_client = (address, store)
    return store


def _connect(address: str) -> Any:
    """A client of the store at `address` (host:port/prefix, as torchft names it)."""
    from torchft.process_group import create_store_client

    return create_store_client(address, timeout=timedelta(seconds=STORE_TIMEOUT_S))
