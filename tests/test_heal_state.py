"""A healing island takes only the state its members vouch for: the weights, and also the
outer optimizer state and the decoupled rounds' stale flag.

The members' signed state claims (policy.StateClaim) carried a digest of the global weights
only (ac842c6): a member could serve a healing island the federation's weights with outer
momentum (or AdamW moments, or its step count) of its choosing, or another stale flag, and
the island took them; from then on its outer steps, and so its global weights, left the
federation's. The claims now hash all that a healing island takes (global_weights.
offer_digest); the harness is test_heal_trust's stand-in for torchft's Manager.
"""

from __future__ import annotations

import pytest
import torch
from test_heal_trust import KEY, _claim, _fingerprint_row, _island, _Quorum

from archipelago.federation.diloco import OuterLoop
from archipelago.federation.fragments import tensor_state
from archipelago.federation.policy import StateClaim

STEP = 5
SGD = {"outer_momentum": 0.9}
ADAMW = {"outer_optimizer": "adamw", "outer_momentum": 0.9}
DECOUPLED = {"outer_momentum": 0.9, "round_mode": "decoupled"}


def _loop(manager: _Quorum, step: int, settings: dict) -> OuterLoop:
    """Island 0 of `settings`, at federation step `step` (its last round committed)."""
    ft, model, fp = _island(0, **settings)
    loop = OuterLoop(ft, [list(model.parameters())], 0, 1, manager, fp, key=KEY)
    loop.outer_step, loop.last_committed, loop.established = step, step > 0, step > 0
    loop.federation_tokens, loop.inner_step = 5000, 40
    manager.step = step
    return loop


def _trained_member(settings: dict, stale: bool = False) -> OuterLoop:
    """A member that went on to step STEP: two real outer steps, so its outer optimizer holds
    state (momentum, or AdamW's step and moments) that a fresh island does not."""
    member = _loop(_Quorum(step=STEP, max_step=STEP, offer=None, gathers=[]), STEP, settings)
    torch.manual_seed(1)
    for _ in range(2):
        for i, g in enumerate(member.globals):
            member.core.apply(i, torch.randn_like(g), 1.0)
    member.weights.forget_digest()
    if member.handoffs is not None:
        member.handoffs.stale = stale
    member.healing.before_quorum = (STEP, 0)
    return member


def _claim_of(member: OuterLoop) -> StateClaim:
    """The signed claim the member sends of its own state (the code under test makes it)."""
    return member.healing.own_claim()


def _heal(settings: dict, offer: dict, claims: list[StateClaim]) -> tuple[OuterLoop, _Quorum]:
    """A restarted island (step 0) heals in a quorum of itself and members 1..3 (3 is the
    source), each claiming `claims`; returns it after the quorum."""
    manager = _Quorum(step=0, max_step=STEP, offer=offer, gathers=[])
    manager.num_participants = lambda: 4
    loop = _loop(manager, 0, settings)
    manager.gathers = [[_claim(k + 1, c) for k, c in enumerate(claims)],
                       [_fingerprint_row(k, STEP, **settings) for k in (1, 2, 3)]]
    assert loop.prepare() is True
    return loop, manager


def _outer_tensors(loop: OuterLoop) -> list[torch.Tensor]:
    return [v.clone() for g, o in zip(loop.globals, loop.outer) for v in tensor_state(o, g).values()]


def _forged(state: dict, key: str) -> dict:
    """`state` with the weights untouched and one outer optimizer tensor replaced."""
    fragments = []
    for f in state["fragments"]:
        outer = {k: v.clone() for k, v in f["outer"].items()}
        outer[key] = outer[key] * -3.0 + 1.0
        fragments.append({"global": f["global"].clone(), "outer": outer})
    return dict(state, fragments=fragments)


FORGERIES = [(SGD, "momentum_buffer"), (ADAMW, "exp_avg"), (ADAMW, "exp_avg_sq"), (ADAMW, "step"),
             (DECOUPLED, "momentum_buffer")]


@pytest.mark.parametrize("liar_claims", ["the members' state", "what it serves"])
@pytest.mark.parametrize("settings,key", FORGERIES,
                         ids=["sgd-momentum", "adamw-exp_avg", "adamw-exp_avg_sq", "adamw-step", "decoupled"])
def test_the_members_weights_with_forged_outer_state_are_refused(settings, key, liar_claims, caplog):
    """ac842c6 took the forged tensor: the claims vouched for the weights alone."""
    honest = _trained_member(settings)
    offer = _forged(honest.healing.state(), key)
    liar = honest if liar_claims == "the members' state" else _trained_member(settings)
    if liar is not honest:  # a member that holds the forged state and claims it
        for g, o, f in zip(liar.globals, liar.outer, offer["fragments"]):
            for k, v in tensor_state(o, g).items():
                v.copy_(f["outer"][k])
        liar.weights.forget_digest()
    before = _outer_tensors(_loop(_Quorum(0, 0, None, []), 0, settings))
    loop, manager = _heal(settings, offer, [_claim_of(honest), _claim_of(honest), _claim_of(liar)])
    assert not loop.healed and loop.outer_step == 0 and manager.step == 0  # torchft's step put back
    after = _outer_tensors(loop)
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "the forged outer state was applied"
    assert not any(torch.equal(g.detach(), f["global"]) for g, f in zip(loop.globals, offer["fragments"]))
    assert "refused the global state a peer island sent" in caplog.text
    # Nobody claims the forged state, or only its source does, against two members that do not.
    assert ("no member vouches" if liar is honest else "2 member(s)") in caplog.text


@pytest.mark.parametrize("served", [0, 2], ids=["not-stale", "out-of-range"])
def test_the_members_state_with_a_forged_stale_flag_is_refused(served, caplog):
    """Decoupled rounds: the members' next rows are stale; a source says they are not (the
    healed island's row would count as fresh, or be discounted when it is not stale).
    ac842c6 took the source's flag."""
    honest = _trained_member(DECOUPLED, stale=True)
    offer = dict(honest.healing.state(), stale=served)
    loop, _ = _heal(DECOUPLED, offer, [_claim_of(honest)] * 3)
    assert not loop.healed and loop.handoffs is not None and loop.handoffs.stale is False
    assert "refused the global state a peer island sent" in caplog.text


@pytest.mark.parametrize("settings", [SGD, ADAMW, DECOUPLED], ids=["sgd-momentum", "adamw", "decoupled"])
def test_an_honest_heal_takes_the_weights_and_outer_state(settings):
    honest = _trained_member(settings, stale=True)
    offer = honest.healing.state()
    assert any(bool(v.abs().sum() > 0) for v in _outer_tensors(honest))  # momentum > 0
    loop, manager = _heal(settings, offer, [_claim_of(honest)] * 3)
    assert loop.healed and loop.outer_step == STEP == manager.step
    for g, f in zip(loop.globals, offer["fragments"]):
        assert torch.equal(g.detach(), f["global"])
    assert all(torch.equal(a, b) for a, b in zip(_outer_tensors(loop), _outer_tensors(honest)))
    if loop.handoffs is not None:
        assert loop.handoffs.stale is True
    # The healed island now claims what its members claim: the next island heals from it too.
    loop.healing.before_quorum = (STEP, 0)
    assert _claim_of(loop).digest == _claim_of(honest).digest


# ---- the digest: canonical bytes, hashed once per change -----------------------------
# (imported inside the tests: the attack tests above also run against ac842c6, which lacks them)


def test_a_tensor_digest_hashes_little_endian_row_major_bytes_at_its_dtype():
    import hashlib

    from archipelago.federation.global_weights import tensor_digest

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    assert tensor_digest(t) == hashlib.sha256(t.numpy().astype("<f4").tobytes()).hexdigest()
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous()) != tensor_digest(t)  # layout is not hashed
    b = t.to(torch.bfloat16)  # numpy has no bf16: its bytes, through the same-width integer view
    assert tensor_digest(b) == hashlib.sha256(b.view(torch.int16).numpy().astype("<i2").tobytes()).hexdigest()
    assert tensor_digest(torch.tensor(3.0)) == hashlib.sha256(b"\x00\x00\x40\x40").hexdigest()  # AdamW's step


def test_two_islands_with_the_same_state_claim_the_same_digest_and_any_difference_shows():
    a, b = _trained_member(DECOUPLED, stale=True), _trained_member(DECOUPLED, stale=True)
    assert _claim_of(a).digest == _claim_of(b).digest
    b.handoffs.stale = False  # not cached: read at every claim
    assert _claim_of(a).digest != _claim_of(b).digest
    b.handoffs.stale = True
    with torch.no_grad():
        b.outer[0].state[b.globals[0]]["momentum_buffer"][0] += 1e-6
    b.weights.forget_digest(0)
    assert _claim_of(a).digest != _claim_of(b).digest


def test_a_fragments_digests_are_hashed_again_only_after_it_changes(monkeypatch):
    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation import global_weights
    from archipelago.federation.global_weights import GlobalWeights, offer_digest

    weights = GlobalWeights(FaultToleranceConfig(enable=True, num_fragments=2, **ADAMW))
    weights.take([torch.randn(6), torch.randn(4)])
    hashed: list[int] = []
    original = global_weights.tensor_digest
    monkeypatch.setattr(global_weights, "tensor_digest", lambda t: hashed.append(t.numel()) or original(t))
    first = weights.state_digest(None)
    assert sorted(hashed) == [1, 1, 4, 4, 4, 6, 6, 6]  # both fragments: weights, step, two moments
    hashed.clear()
    assert weights.state_digest(None) == first and weights.chunk_digest() and hashed == []  # cached
    weights.core.apply(1, torch.randn(4), 1.0)  # an outer step on fragment 1 (outcome.py forgets it)
    weights.forget_digest(1)
    second = weights.state_digest(None)
    assert sorted(hashed) == [1, 4, 4, 4] and second != first  # fragment 1 only
    served = {"fragments": [{"global": g.detach(), "outer": tensor_state(o, g)}
                            for g, o in zip(weights.globals, weights.outer)]}
    assert second == offer_digest(served)  # what a healing island computes of the state it is served
