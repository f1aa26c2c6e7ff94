"""One member of a fingerprint exchange, for tests: the join's all-gather on the default
cross-island process group, as `membership.exchange_fingerprints` runs it, between
processes that met through a TCPStore. With ROGUE=1 this member sends a row twice the size
the others post (what a dishonest key holder's own process can do); each honest member
writes what it got to OUT (`{"rows": N}`, or `{"rows": null, "error": ...}` when the
exchange failed) and exits 0. At ac842c6 the default group was gloo's, and the honest
members died of SIGABRT (exit 134) inside gloo before they could write anything.

usage: python oversized_member.py STORE_PORT RANK WORLD ROGUE OUT
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import timedelta
from pathlib import Path

TIMEOUT = timedelta(seconds=15)


class Manager:
    """What the exchange asks of torchft's Manager: its group, its rank in the quorum, and
    error reporting (torchft's `_ManagedWork` reports a failed collective here)."""

    _logger = logging.getLogger("oversized_member")

    def __init__(self, pg, rank: int, world: int) -> None:
        self._pg, self._rank, self._world = pg, rank, world
        self._quorum_id, self._error = 1, None

    def num_participants(self) -> int:
        return self._world

    def participating_rank(self) -> int:
        return self._rank

    def errored(self):
        return self._error

    def report_error(self, error: Exception) -> None:
        self._error = self._error or error

    def wrap_future(self, future, default, timeout=None):
        def swallow(done):
            try:
                return done.value()
            except Exception as exc:  # noqa: BLE001 - as torchft's Manager.wrap_future does
                self.report_error(exc)
                return default
        return future.then(swallow)


def _group():
    """The cross-island group a member builds by default (federation.membership)."""
    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation import membership

    backend = FaultToleranceConfig().process_group
    if hasattr(membership, "cross_island_group"):
        return membership.cross_island_group(backend, TIMEOUT)
    from torchft.process_group import ProcessGroupGloo  # ac842c6: gloo, built in build_manager

    return ProcessGroupGloo(timeout=TIMEOUT)


def main(port: str, rank: str, world: str, rogue: str, out: str) -> None:
    from archipelago.federation import membership

    me, count = int(rank), int(world)
    pg = _group()
    pg.configure(f"127.0.0.1:{port}/torchft/1/0", f"island_{me}", me, count)
    if rogue == "1":
        membership._ROW *= 2  # its own row only: every honest member posts the agreed size
    manager = Manager(pg, me, count)
    table = membership.exchange_fingerprints(manager, {"island": me, "model": "llama3/tiny"})
    result = {"rows": None if table is None else len(table)}
    if table is None:
        result["error"] = str(manager.errored())[:300]
    Path(out).write_text(json.dumps(result))
    pg.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:6])
