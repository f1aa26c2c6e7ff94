"""A member that gave an exchange up says so where the others look while they wait.

Behind slow links a survivor's pending gloo send can outlive every connection of a failed
exchange: the transport never fails it, so the survivor would wait out
`process_group_timeout_ms` while the members that saw the death ask the lighthouse for a
new quorum, and the lighthouse waits its join timeout for the one still heartbeating
(docs/rounds.md, "When a member dies in the exchange"). So the members of a quorum share
one more fact besides their rows: the quorum's TCPStore (where torchft's process group met,
hosted by one member) holds a key per exchange that a member whose exchange failed sets
(`announce`, from agreement.settle_exchange), and a member waiting for its exchange's rows
polls it every POLL_S seconds (`wait_for`: the rows of the first phase, the summed
segments of the second, the members' agreement flags). A store that cannot be reached counts as
the same news: its host, a member, is gone. Either way the waiting member reports the
exchange failed and lets go of it, as if its own collective had failed, and the usual retry
follows.

What it costs: one key lookup a POLL_S over the WAN while rows are still out (none when they
arrive sooner), one store connection per quorum. What it trusts: only members reach the
quorum's store (torchft's rendezvous needs it), and a member that lies by setting the key
only fails an exchange, which it could do anyway by closing its connections. Wires that
stamp no completion (NCCL) wait as before.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from archipelago.federation.exchange import Framing, SkippedWork

POLL_S = 0.5               # how often a waiting member looks at the key
STORE_TIMEOUT_S = 5.0      # connecting to, and asking, the quorum's store


class ExchangeGivenUp(RuntimeError):
    """Another member of the exchange gave it up (or the quorum's store is gone)."""


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
    """Note the quorum's store (as torchft's process group rendezvous uses it) on `manager`."""
    rank = getattr(manager, "_group_rank", 0)
    manager._archipelago_quorum_store = f"{quorum.store_address}/torchft/{quorum.quorum_id}/{rank}"


def key(framing: Framing) -> str:
    """The key of one exchange: the outer step and fragment its rows are signed for (the
    quorum's id is in the store's prefix, so a retry, which always has a new quorum, starts
    clean)."""
    return f"archipelago/given_up/{framing.step}/{framing.fragment}"


def announce(manager: Any, framing: Framing) -> None:
    """This member gave the exchange up: say so in the quorum's store, from a thread of its
    own (best effort): connecting to a store whose host died may take STORE_TIMEOUT_S, which
    must not delay this member's own retry."""
    address = getattr(manager, "_archipelago_quorum_store", None)
    if address:
        thread = threading.Thread(target=_announce, args=(address, key(framing)), name="archipelago-give-up",
                                  daemon=True)
        thread.start()
        announcing = [t for t in getattr(manager, "_archipelago_announcing", []) if t.is_alive()]
        manager._archipelago_announcing = [*announcing, thread]


def finish_announcing(manager: Any) -> None:
    """Before the process ends: wait for the announcing threads still connecting. One left
    inside the store's C++ client when the interpreter shuts down aborts the process (exit
    code 134) as it returns, which would turn a finished run into a failed one. The client
    tries twice with a random delay between, so a store that is gone holds a thread for up to
    about three STORE_TIMEOUT_S: the most a shutdown right after a failed exchange waits."""
    deadline = time.monotonic() + 3 * STORE_TIMEOUT_S + 1.0
    for thread in getattr(manager, "_archipelago_announcing", []):
        thread.join(max(deadline - time.monotonic(), 0.0))
    manager._archipelago_announcing = []


def _announce(address: str, name: str) -> None:
    try:
        _connect(address).set(name, "1")
    except Exception:  # noqa: BLE001 - the store's host may be the member that died
        pass


def given_up(manager: Any, framing: Framing) -> bool:
    """Has a member of this exchange given it up, or is the quorum's store gone?"""
    try:
        store = _store(manager)
        return store is not None and bool(store.check([key(framing)]))
    except Exception:  # noqa: BLE001 - unreachable: its host, a member, is gone
        return True


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
        if given_up(manager, framing):
            manager.report_error(ExchangeGivenUp(
                "another member gave this exchange up (its quorum's store says so, or is gone); "
                "the transport had not failed it here"))
            phase.work = SkippedWork()
            return
        next_look = time.monotonic() + POLL_S
    phase.work.wait()


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
