"""Healing: the global state a peer island sends, checked before any of it is taken.

torchft's checkpoint transport hands a peer's state to `Healing.load` during the quorum (on
a bridge rank of an island that is behind). Nothing of it is applied there: it is checked
for shape and finiteness against this island's own state and held. The members then
all-gather their signed state claims (policy.StateClaim: step, a SHA-256 over all of the
state a healing island takes, the counters), and the offer is taken only when they vouch
for it (policy.heal_verdict), on every bridge rank of the island or on none. What a peer
sends is the global weights and outer optimizer state, the federation's counters (those
the supporters vouched for are taken, not the source's), and under decoupled rounds
whether the next exchange's rows are stale; never its codec's error feedback (its own
unsent progress, which it still sends itself). The claims' digest covers the weights, the
outer optimizer state and the stale flag (global_weights.offer_digest), so a source that
serves the members' weights with other momentum, or another stale flag, is refused. The
rest is not taken from the source: its fingerprint must match this island's (`mismatch`),
its guard history is never taken, and the counters are the supporters'.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.decoupled import Handoffs
from archipelago.federation.fragments import load_tensor_state, tensor_state
from archipelago.federation.global_weights import GlobalWeights, offer_digest
from archipelago.federation.guard import PseudoGradientGuard
from archipelago.federation.membership import exchange_claims, mismatch
from archipelago.federation.policy import Membership, StateClaim, diverged, heal_verdict
from archipelago.federation.quorum import Quorum
from archipelago.federation.trust import FederationKey, member_island

log = logging.getLogger("archipelago.federation")


class HealingHost(Protocol):
    """What healing reads and sets of the outer loop it belongs to."""

    ft: FaultToleranceConfig
    manager: Any
    key: FederationKey | None
    fingerprint: dict[str, Any]
    guard: PseudoGradientGuard
    handoffs: Handoffs | None
    inner_step: int
    outer_step: int
    federation_tokens: int
    peer_inner_step: int
    last_committed: bool
    established: bool
    weights: GlobalWeights



class Healing:
    """A bridge rank's side of healing: the offer a peer sent, held until it is judged."""

    def __init__(self, host: HealingHost) -> None:
        self.host = host
        self.offer: dict[str, Any] | None = None  # the peer's state, held until the claims vouch for it
        self.refusal: str | None = None           # why the offer was refused before the claims
        self.taken = StateClaim()                 # the counters the supporters vouched for
        self.before_quorum: tuple[int, int] = (0, 0)  # the manager's step and batches before it

    def begin(self) -> None:
        """Before a quorum: no offer yet, and the counters to restore if one is refused."""
        manager = self.host.manager
        self.offer, self.refusal = None, None
        self.before_quorum = (manager.current_step(), manager.batches_committed())

    def membership(self, quorum: Quorum, again: bool = False) -> Membership:
        """This bridge rank's view of the quorum it enters (blocking; a healing island
        receives the peer's state here, in `load`); the island's other ranks know nothing yet
        (an empty view). With `again` (a retry), the lighthouse is made to hand out a new
        quorum id even for the same members."""
        h = self.host
        if h.manager is None:
            return Membership()
        self.begin()
        quorum.start(again)
        quorum.refuse_outsiders()
        refusal = self.judge_offer()
        quorum.check_members(h.fingerprint, h.established)
        healed = self.offer is not None and refusal is None
        same = healed and all(torch.equal(g.detach(), f["global"].to(g.device))
                              for g, f in zip(h.weights.globals, self.offer["fragments"]))  # type: ignore[index]
        rank = h.manager.participating_rank()
        return Membership(outer_step=h.manager.current_step(), healed=healed, progress_void=healed and not same,
                          peer_inner_step=self.taken.inner_step if healed else 0,
                          participants=h.manager.num_participants(),
                          participant_rank=-1 if rank is None else int(rank), heal_refused=refusal is not None)

    # ---- what travels (torchft's state_dict functions) ------------------------------

    def register(self) -> None:
        """Hand torchft the functions that serve and take this state, and the most a peer's
        state may hold: about this island's own size."""
        manager = self.host.manager
        manager.register_state_dict_fn("archipelago_outer", self.load, self.state)
        expect = getattr(getattr(manager, "_checkpoint_transport", None), "expect_state_like", None)
        if expect is not None:
            expect({"user": {"archipelago_outer": self.shape()}, "torchft": {"step": 0, "batches_committed": 0}})

    def state(self) -> dict[str, Any]:
        """This island's state for a healing peer (not the codec state: see the module doc)."""
        h = self.host
        state = {"fingerprint": h.fingerprint, "inner_step": h.inner_step,
                 "federation_tokens": h.federation_tokens, "guard": h.guard.state_tensor(),
                 "fragments": [{"global": g.detach().clone(), "outer": tensor_state(o, g)}
                               for g, o in zip(h.weights.globals, h.weights.outer)]}
        if h.handoffs is not None:  # decoupled: whether the next exchange's rows are stale (decoupled.py)
            state["stale"] = int(h.handoffs.stale)
        return state

    def load(self, state: dict[str, Any]) -> None:
        """torchft's callback with a peer's state, during the quorum: checked for shape and
        finiteness, then held (never applied here) until the members' claims vouch for it.
        A bad state is refused, never raised: the source may be the dishonest one."""
        problem = None  # a different model or config first: its message names both islands
        if isinstance(state, dict) and isinstance(state.get("fingerprint"), dict):
            problem = mismatch(self.host.fingerprint, state["fingerprint"])
        problem = problem or shape_problem(self.shape(), state, "state")
        if problem is not None:
            self.offer, self.refusal = None, f"a peer island's state does not fit: {problem}"
            return
        self.offer = state

    def shape(self) -> dict[str, Any]:
        """This island's own healing state, uncopied: what a peer's must look like."""
        h = self.host
        shape = {"fingerprint": h.fingerprint, "inner_step": 0, "federation_tokens": 0,
                 "guard": h.guard.state_tensor(),
                 "fragments": [{"global": g, "outer": tensor_state(o, g)}
                               for g, o in zip(h.weights.globals, h.weights.outer)]}
        if h.handoffs is not None:
            shape["stale"] = 0
        return shape

    # ---- judging and taking the offer --------------------------------------------

    def judge_offer(self) -> str | None:
        """Every round every bridge rank all-gathers the members' signed state claims
        (policy.StateClaim: ~300 bytes per island, and a SHA-256 over this rank's state,
        hashed again only where it changed); a state torchft handed this rank in this
        quorum is hashed whole (weights, outer optimizer state, stale flag) and checked
        against them (policy.heal_verdict). Why it is refused, or None (also when there is none); kept
        in `refusal`."""
        h = self.host
        claims = exchange_claims(h.manager, self.own_claim(), h.ft.replica_id, h.key)
        if claims is not None:
            self.alarm_on_divergence(claims)
        if self.offer is None:
            return self.refusal
        me = h.manager.participating_rank()
        if claims is None or me is None or len(claims) <= me:
            self.refusal = "the members' state claims could not be exchanged (the round failed)"
            return self.refusal
        claim = StateClaim(h.manager.current_step(), offer_digest(self.offer))
        verdict, self.taken = heal_verdict(claim, claims, me)
        self.refusal = verdict.reason
        return self.refusal

    def alarm_on_divergence(self, claims: list[StateClaim]) -> list[int]:
        """After every commit the members must hold one state: compare the digests they
        claim for this island's step (policy.diverged) and name, in an error, every member
        that holds another (a member that sent its last message of a round differently to
        different peers can still cause that: federation/receipts.py). Returns their ranks."""
        h = self.host
        me = h.manager.participating_rank()
        if me is None or not h.last_committed:
            return []
        odd = diverged(claims, me)
        if odd:
            ids = list(getattr(h.manager, "_archipelago_replica_ids", None) or [])
            names = [f"island {member_island(h.key, ids[k])}" if k < len(ids) else f"replica rank {k}" for k in odd]
            where = "this island is among them" if me in odd else "this island holds the majority's"
            log.error("the members' committed states of outer step %d differ: %s hold(s) another state than the "
                      "majority of the members that committed it (%s; the state claims' digests %s). Compare "
                      "their logs' 'receipts' lines; restart the island(s) in the minority to heal them from the "
                      "others", claims[me].step, ", ".join(names), where,
                      ", ".join(sorted({claims[k].digest[:12] for k in range(len(claims)) if claims[k].digest})))
        return odd

    def own_claim(self) -> StateClaim:
        """This bridge rank's claim about its state before this quorum (what it committed):
        the digest of all that `state()` serves and a healing peer takes."""
        h = self.host
        stale = int(h.handoffs.stale) if h.handoffs is not None else None
        return StateClaim(self.before_quorum[0], h.weights.state_digest(stale), h.last_committed, h.inner_step,
                          h.federation_tokens)

    def settle(self, m: Membership) -> Membership:
        """Take the state a peer sent on every bridge rank, or, if any bridge rank refused
        it, on none: they restore the manager's step (torchft set it to the source's) and
        the island goes on from its own state, at its own step."""
        h = self.host
        if m.heal_refused:
            if self.offer is not None or self.refusal is not None:
                reason = self.refusal or "another bridge rank of this island refused its part"
                log.error("refused the global state a peer island sent for federation step %d: %s; this island "
                          "keeps its own state (step %d)", m.outer_step, reason, self.before_quorum[0])
            if h.manager is not None and h.manager.current_step() != self.before_quorum[0]:
                step, batches = self.before_quorum
                h.manager.load_state_dict({"step": step, "batches_committed": batches})
            self.offer, self.refusal = None, None
            return replace(m, outer_step=h.outer_step, healed=False, progress_void=False, peer_inner_step=0)
        if self.offer is not None:
            self.apply(self.offer)
            self.offer = None
        return m

    def apply(self, state: dict[str, Any]) -> None:
        """Take the global weights and outer optimizer state a peer sent, with the counters
        its supporters vouched for. The guard's history stays this island's own (a peer's
        could make it refuse or wave through this island's next pseudo-gradients)."""
        h = self.host
        for g, o, f in zip(h.weights.globals, h.weights.outer, state["fragments"]):
            load_tensor_state(o, g, f)  # the codecs keep this island's own error feedback
        h.weights.forget_digest()
        h.peer_inner_step = self.taken.inner_step
        h.federation_tokens = self.taken.federation_tokens
        if h.handoffs is not None:  # decoupled: the members' view of the next exchange's rows
            h.handoffs.stale = bool(state.get("stale", 0))
        log.info("healed: received the global weights from a peer island (federation step %d)",
                 h.manager.current_step())


def shape_problem(ours: Any, theirs: Any, where: str) -> str | None:
    """The first place where `theirs` is not shaped like `ours` (a peer's healing state)."""
    if isinstance(ours, torch.Tensor):
        if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape or theirs.dtype != ours.dtype:
            return f"{where}: expected a {ours.dtype} tensor of shape {tuple(ours.shape)}"
        ok = torch.isfinite(theirs)
        if where == "state.guard":  # pseudo-gradient norms, NaN-padded: >= 0 or padding
            ok = (ok & (theirs >= 0)) | torch.isnan(theirs)
        return None if bool(ok.all()) else f"{where}: not finite"
    if isinstance(ours, dict):
        if not isinstance(theirs, dict) or theirs.keys() != ours.keys():
            return f"{where}: expected the keys {sorted(ours)}"
        if where == "state.fingerprint":
            return None  # compared field by field by mismatch(), which names the difference
        problems = (shape_problem(ours[k], theirs[k], f"{where}.{k}") for k in ours)
        return next((p for p in problems if p is not None), None)
    if isinstance(ours, list):
        if not isinstance(theirs, list) or len(theirs) != len(ours):
            return f"{where}: expected a list of {len(ours)}"
        problems = (shape_problem(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(ours, theirs)))
        return next((p for p in problems if p is not None), None)
    if isinstance(ours, int) and not (isinstance(theirs, int) and not isinstance(theirs, bool) and theirs >= 0):
        return f"{where}: expected a whole number >= 0"
    return None
