"""A dishonest member with the federation key must not take over or evict the honest islands.

The outer loop runs against a stand-in for torchft's Manager that plays the quorum the way
torchft does (it calls the registered heal callback with the state a peer sent, and sets
the step to the quorum's highest) and whose all-gathers bring the other members' signed
rows. The attacks: a member claiming step S+1 with forged weights and counters (every
other island would heal from it), a member declaring the highest step with another
fingerprint (the honest islands raised FederationMismatch and exited), a non-integer step
(a TypeError), and huge declared batches and learning rates.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import FinishedWork
from torch import nn

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.diloco import OuterLoop
from archipelago.federation.fragments import tensor_state
from archipelago.federation.global_weights import offer_digest
from archipelago.federation.membership import claim_row, fingerprint, fingerprint_row
from archipelago.federation.policy import StateClaim
from archipelago.federation.trust import FederationKey

KEY = FederationKey(os.urandom(32))
QUORUM = 11


class _Quorum:
    """torchft's Manager as one island sees it: a quorum of `peers + 1` members in which this
    island has replica rank 0. `start_quorum` hands `offer` (if any) to the heal callback and
    sets the step to `max_step`, as torchft's healing does; each all-gather takes the next
    list of peer rows from `gathers`."""

    def __init__(self, step: int, max_step: int, offer: dict | None, gathers: list[list[bytes]]) -> None:
        self.step, self.max_step, self.offer, self.gathers = step, max_step, offer, gathers
        self.batches, self._quorum_id, self._pg, self.errors = 3, QUORUM, self, []
        self.load = None

    def register_state_dict_fn(self, name, load, save) -> None:
        self.load = load

    def start_quorum(self) -> None:
        if self.offer is not None:  # torchft: recv_checkpoint, then load_state_dict, then the user fn
            self.step, self.batches = self.max_step, 99
            self.load(self.offer)

    def allgather(self, outputs, inputs, options=None):
        outputs[0][0].copy_(inputs[0])
        for k, raw in enumerate(self.gathers.pop(0), start=1):
            outputs[0][k].zero_()
            outputs[0][k][:2] = torch.tensor(list(len(raw).to_bytes(2, "big")), dtype=torch.uint8)
            outputs[0][k][2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        return FinishedWork()

    def current_step(self) -> int:
        return self.step

    def batches_committed(self) -> int:
        return self.batches

    def load_state_dict(self, state: dict) -> None:
        self.step, self.batches = state["step"], state["batches_committed"]

    def num_participants(self) -> int:
        return 3

    def participating_rank(self) -> int:
        return 0

    def errored(self):
        return self.errors[0] if self.errors else None

    def report_error(self, exc) -> None:
        self.errors.append(exc)


def _island(replica: int, **overrides):
    ft = FaultToleranceConfig(enable=True, replica_id=replica, **overrides)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    fp = fingerprint("linear", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, 1,
                     tokens_per_step=64, key=KEY, inner_lr=1e-3)
    return ft, model, fp


def _fingerprint_row(replica: int, step, **overrides) -> bytes:
    return fingerprint_row(dict(_island(replica, **overrides)[2], step=step, established=True), KEY, QUORUM)


def _claim(replica: int, claim: StateClaim) -> bytes:
    return claim_row(claim, replica, KEY, QUORUM)


def _loop(manager: _Quorum, step: int) -> OuterLoop:
    ft, model, fp = _island(0)
    loop = OuterLoop(ft, [list(model.parameters())], 0, 1, manager, fp, key=KEY)
    loop.outer_step, loop.last_committed, loop.established = step, True, step > 0
    loop.federation_tokens, loop.inner_step = 5000, 40
    manager.step = step
    return loop


def _own_digest(loop: OuterLoop) -> str:
    """What the island claims of its own state (its healing state's digest)."""
    return offer_digest(loop.healing.state())


def _forged_state(loop: OuterLoop, scale: float) -> dict:
    """A state of the right shapes and dtypes, finite, with weights of the sender's choosing."""
    fragments = [{"global": g.detach() * scale + 1, "outer": tensor_state(o, g)}
                 for g, o in zip(loop.globals, loop.outer)]
    return {"fingerprint": loop.fingerprint, "inner_step": 10**9, "federation_tokens": 10**15,
            "guard": loop.guard.state_tensor(), "fragments": fragments}


def test_a_member_claiming_the_next_step_does_not_become_the_healing_source(caplog):
    manager = _Quorum(step=4, max_step=5, offer=None, gathers=[])
    loop = _loop(manager, step=4)
    before = [g.detach().clone() for g in loop.globals]
    offer = _forged_state(loop, scale=-50.0)
    manager.offer = offer
    honest = StateClaim(4, _own_digest(loop), True, 40, 5000)
    liar = StateClaim(5, offer_digest(offer), True, 10**9, 10**15)
    manager.gathers = [[_claim(1, honest), _claim(2, liar)],  # the state claims, then the fingerprints
                       [_fingerprint_row(1, 4), _fingerprint_row(2, 5)]]
    assert loop.prepare() is True
    # Nothing of the forged state was taken: cb92e48 applied it in the heal callback.
    for g, b in zip(loop.globals, before):
        assert torch.equal(g.detach(), b)
    assert (loop.outer_step, manager.step, manager.batches) == (4, 4, 3)  # torchft's step put back
    assert loop.federation_tokens == 5000 and not loop.healed
    assert "refused the global state a peer island sent" in caplog.text and "2 member(s)" in caplog.text


def test_a_source_at_the_federations_step_serving_other_weights_is_refused():
    manager = _Quorum(step=0, max_step=4, offer=None, gathers=[])
    loop = _loop(manager, step=0)
    loop.last_committed, loop.established = False, False  # a restarted island heals
    offer = _forged_state(loop, scale=3.0)
    manager.offer = offer
    honest = StateClaim(4, "a" * 64, True, 40, 5000)  # two members (1 and 3) hold other weights at step 4
    liar = StateClaim(4, offer_digest(offer), True, 40, 5000)
    manager.gathers = [[_claim(1, honest), _claim(3, honest), _claim(2, liar)],
                       [_fingerprint_row(1, 4), _fingerprint_row(3, 4), _fingerprint_row(2, 4)]]
    manager.num_participants = lambda: 4
    assert loop.prepare() is True
    assert not loop.healed and manager.step == 0
    for g, f in zip(loop.globals, offer["fragments"]):
        assert not torch.equal(g.detach(), f["global"])


def test_a_state_the_members_vouch_for_heals_with_their_counters_not_the_sources():
    manager = _Quorum(step=0, max_step=5, offer=None, gathers=[])
    loop = _loop(manager, step=0)
    loop.last_committed, loop.established = False, False  # a restarted island
    offer = _forged_state(loop, scale=2.0)
    manager.offer = offer
    digest = offer_digest(offer)
    # Two members hold that state at step 5; the source also claims absurd counters.
    manager.gathers = [[_claim(1, StateClaim(5, digest, True, 50, 7000)),
                        _claim(2, StateClaim(5, digest, True, 10**9, 10**15))],
                       [_fingerprint_row(1, 5), _fingerprint_row(2, 5)]]
    assert loop.prepare() is True
    assert loop.healed and loop.outer_step == 5
    for g, f in zip(loop.globals, offer["fragments"]):
        assert torch.equal(g.detach(), f["global"])
    assert loop.federation_tokens == 7000 and loop.peer_inner_step == 50


def test_a_state_of_the_wrong_shape_is_refused_without_raising(caplog):
    manager = _Quorum(step=4, max_step=5, offer=None, gathers=[])
    loop = _loop(manager, step=4)
    offer = _forged_state(loop, scale=1.0)
    offer["fragments"][0]["global"] = torch.zeros(3)
    manager.offer = offer
    claim = StateClaim(4, _own_digest(loop), True, 40, 5000)
    manager.gathers = [[_claim(1, claim), _claim(2, claim)], [_fingerprint_row(1, 4), _fingerprint_row(2, 5)]]
    assert loop.prepare() is True  # cb92e48 raised FederationMismatch: the island exited
    assert not loop.healed and manager.step == 4 and "does not fit" in caplog.text


@pytest.mark.parametrize("step", [10**9, 4.5, "x"], ids=["highest", "float", "string"])
def test_an_odd_member_claiming_any_step_is_refused_and_the_honest_islands_go_on(step, caplog):
    claim = StateClaim(4, "", True, 40, 5000)
    manager = _Quorum(step=4, max_step=4, offer=None, gathers=[])
    loop = _loop(manager, step=4)
    claim = StateClaim(4, _own_digest(loop), True, 40, 5000)
    # Island 2 signs a fingerprint that differs (its outer lr) and claims the highest step.
    manager.gathers = [[_claim(1, claim), _claim(2, claim)],
                       [_fingerprint_row(1, 4), _fingerprint_row(2, step, outer_lr=0.1)]]
    assert loop.prepare() is True  # cb92e48: FederationMismatch (or a TypeError) on every honest island
    assert loop.quorum.odd_ranks == {2}
    assert "refusing the rows of a peer island" in caplog.text


def test_the_odd_island_itself_is_told_why_it_cannot_join():
    from archipelago.federation.membership import FederationMismatch

    manager = _Quorum(step=4, max_step=4, offer=None, gathers=[])
    loop = _loop(manager, step=4)
    claim = StateClaim(4, _own_digest(loop), True, 40, 5000)
    manager.gathers = [[_claim(1, claim), _claim(2, claim)],
                       [_fingerprint_row(1, 4, outer_lr=0.1), _fingerprint_row(2, 4, outer_lr=0.1)]]
    with pytest.raises(FederationMismatch, match="differs in: outer"):
        loop.prepare()


def test_an_odd_members_rows_are_refused_by_every_receiver():
    from archipelago.federation import exchange as rows

    manager = _Quorum(step=4, max_step=4, offer=None, gathers=[])
    loop = _loop(manager, step=4)
    loop.quorum.peers = [loop.fingerprint, loop.fingerprint, loop.fingerprint]
    loop.quorum.odd_ranks = {2}
    table = torch.zeros(3, len(rows.COLUMNS), dtype=torch.float64)
    table[:, rows.TOKENS] = table[:, rows.WEIGHT] = 64.0
    table[:, rows.SUMSQ] = 1e-8
    facts, _ = loop.judge._island_facts(table, 0.0)
    assert [row[10] for row in facts] == [0.0, 0.0, 1.0]


def test_a_huge_declared_batch_buys_no_dominating_weight(caplog):
    """tokens_per_step = 10^15 in a signed fingerprint: the row's tokens and weight are held to
    declared_limit x the others' median (cb92e48 accepted 10^15 tokens: time-paced islands
    were declared done, and its weight dominated every average)."""
    from archipelago.federation import exchange as rows
    from archipelago.federation.attempts import Pending

    manager = _Quorum(step=4, max_step=4, offer=None, gathers=[])
    loop = _loop(manager, step=4)
    honest = dict(loop.fingerprint, island=1)
    greedy = dict(loop.fingerprint, island=2, tokens_per_step=10**15, inner_lr=1e9)
    loop.quorum.peers = [loop.fingerprint, honest, greedy]
    claimed = 64.0 * loop.ft.sync_steps
    table = torch.zeros(3, len(rows.COLUMNS), dtype=torch.float64)
    table[:, rows.TOKENS] = table[:, rows.WEIGHT] = claimed
    table[2, rows.TOKENS] = table[2, rows.WEIGHT] = 1e15
    table[:, rows.SUMSQ] = 1e-8
    table[:, rows.ISLAND] = torch.tensor([0.0, 1.0, 2.0])
    pending = Pending(0, reset=False, tokens=int(claimed))
    pending.participants = 3

    import archipelago.federation.attempts as attempts

    original = attempts.empty_table
    attempts.empty_table = lambda n: table
    try:
        weights, tokens, refused = loop.attempts._judge(pending)
    finally:
        attempts.empty_table = original
    assert weights[:2] == [claimed, claimed] and weights[2] == 0.0
    assert tokens == 2 * claimed and math.isfinite(tokens)
    assert refused and refused[0]["island"] == 2 and "more than its declared batch" in refused[0]["reason"]
