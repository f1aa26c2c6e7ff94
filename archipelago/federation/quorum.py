"""Entering a round's quorum, and what this island knows of the members in it.

torchft's manager forms the quorum (the lighthouse's membership); this bridge rank then
refuses a quorum with outsiders (members without a member token), and after every change
of members compares the islands' signed fingerprints (`membership.exchange_fingerprints`):
the majority's is the reference, an island that differs from it refuses to go on, and a
member that differs has its rows refused (`odd_ranks`). What each member declared at the
join (tokens per inner step, inner learning rate, island id) bounds what its rows may
claim (`declared`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.membership import (
    FederationMismatch,
    exchange_fingerprints,
    fingerprint_groups,
    lighthouse_address,
    members_compute,
    mismatch,
)
from archipelago.federation.policy import reference_fingerprint
from archipelago.federation.trust import FederationKey

log = logging.getLogger("archipelago.federation")


class Quorum:
    """A bridge rank's entry into each quorum and its view of the members (rank 0's table)."""

    def __init__(self, ft: FaultToleranceConfig, manager: Any, key: FederationKey | None, rank: int) -> None:
        self.ft, self.manager, self.key, self.rank = ft, manager, key, rank
        self.quorum_id: int | None = None  # the quorum whose fingerprints were compared last
        self.peers: list[dict[str, Any]] = []  # rank 0: every participant's fingerprint, by replica rank
        self.odd_ranks: set[int] = set()  # rank 0: replica ranks whose fingerprint the federation refuses
        self._outsider_quorum: int | None = None  # the last quorum whose outsiders were logged

    def start(self, again: bool) -> None:
        """torchft's start_quorum. On a retry the lighthouse must issue a new quorum id, even
        for the same members (a link broke, nobody died): only a new id makes torchft build a
        new process group (the failed one may be broken) and signs the retry's frames apart
        from the failed attempt's. torchft's lighthouse bumps the id when a member reports
        commit failures, so this island reports one more for this request only (max_retries
        keeps counting lost rounds, not retries)."""
        failures = getattr(self.manager, "_commit_failures", None)
        if not again or failures is None:
            self.manager.start_quorum()
            return
        self.manager._commit_failures = failures + 1
        try:
            self.manager.start_quorum()  # use_async_quorum=False: the request is done on return
        finally:
            self.manager._commit_failures = failures

    def refuse_outsiders(self) -> None:
        """A quorum with a member that holds no member token (a lighthouse without the gate
        let it in) commits nothing: this island reports an error, torchft's way out of a round."""
        outsiders = getattr(self.manager, "_archipelago_outsiders", [])
        if not outsiders or self.manager.errored() is not None:
            return
        ids = ", ".join(repr(o[:40]) for o in outsiders)
        message = (f"unauthenticated member(s) {ids} in quorum {self.manager._quorum_id}: the lighthouse at "
                   f"{lighthouse_address(self.ft)} admits callers without this federation's key; this island "
                   "neither heals from nor averages with such a quorum. Run the lighthouse with the key "
                   "(`archipelago lighthouse --key-file FILE`), which keeps outsiders out")
        if self.manager._quorum_id != self._outsider_quorum:
            log.error("%s", message)
            self._outsider_quorum = self.manager._quorum_id
        self.manager.report_error(FederationMismatch(message))

    def check_members(self, fingerprint: dict[str, Any], established: bool) -> bool:
        """After a membership change, compare fingerprints; True if a peer must be refused.

        The island whose fingerprint differs from the federation's reference (the island
        furthest ahead, then the lowest id) refuses to go on with FederationMismatch.
        """
        quorum_id = self.manager._quorum_id
        if quorum_id == self.quorum_id or self.rank != 0:
            return False
        mine = dict(fingerprint, step=self.manager.current_step(), established=established)
        table = exchange_fingerprints(self.manager, mine, self.key)
        if table is None:
            return False  # the collective failed; retried at the next membership change
        self.quorum_id, self.peers = quorum_id, table
        me = self.manager.participating_rank() or 0
        members = [k for k, fp in enumerate(table) if not fp.get("unauthenticated") or k == me]
        if len(members) == 1 and len(table) > 1:
            log.error("none of the %d other island(s) of quorum %d signs its join frame with this island's "
                      "federation key (%s): they hold another key file, or are impostors replaying member "
                      "tokens. This island refuses their rows and trains on; if its own key file is the odd "
                      "one, give every island the same key file (ARCHIPELAGO_FEDERATION_KEY_FILE or "
                      "[federation_security] key_file)", len(table) - 1, quorum_id, fingerprint.get("federation"))
        for k, fp in enumerate(table):
            if fp.get("unauthenticated") and k != me:  # declared nothing: every island refuses its rows
                log.error("unauthenticated member at replica rank %d of quorum %d: no valid join frame (another "
                          "federation key, or none); every island refuses its rows", k, quorum_id)
        table[me] = mine  # its own row as it sent it
        log.info("quorum %d computes on: %s", quorum_id, members_compute(table))
        groups = fingerprint_groups([table[k] for k in members])
        reference = reference_fingerprint([table[k] for k in members], groups, members.index(me))
        problem = mismatch(mine, reference)
        if problem is not None:
            raise FederationMismatch(f"refusing to join the federation: {problem}")
        self.odd_ranks = {k for k in members if mismatch(table[k], reference) is not None}
        for k in sorted(self.odd_ranks):
            log.error("refusing the rows of a peer island: %s", mismatch(table[k], mine))
        return bool(self.odd_ranks)

    def declared(self, rank: int) -> list[float]:
        """What the member at replica rank `rank` declared in its fingerprint: tokens per
        inner step, inner learning rate, island id + 1 (0 for what it did not declare: its
        rows are then refused)."""
        fp = self.peers[rank] if rank < len(self.peers) else {}

        def number(value: Any) -> float:
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and value >= 0)
            return float(value) if ok else 0.0
        island = fp.get("island")
        known = isinstance(island, int) and not isinstance(island, bool) and island >= 0
        return [number(fp.get("tokens_per_step")), number(fp.get("inner_lr")), number(island) + 1 if known else 0.0]
