"""The round's decisions (federation/policy.py), edge by edge; no processes, no network."""

from __future__ import annotations

import math

import pytest

from archipelago.federation.outer_core import contribution_weight
from archipelago.federation.policy import (
    EXCHANGE_COMPLETED,
    FRAME_MALFORMED,
    FRAME_UNSIGNED,
    GUARD_HISTORY,
    GUARD_MIN_HISTORY,
    Allowance,
    Contribution,
    Membership,
    RoundResult,
    StateClaim,
    Verdict,
    aligned_inner_step,
    applies_outer_step,
    bounded_batches,
    exchange_agreed,
    heal_verdict,
    judge_contributions,
    judge_pseudo_gradient,
    keeps_pending,
    merges_local,
    must_wait,
    norm_allowance,
    part_in_round,
    reference_fingerprint,
    remember_norm,
    retries_exchange,
    round_is_up,
    segment_repair,
    skips_exchange,
    steps_between_exchanges,
)


def _island_view(*ranks: Membership) -> Membership:
    """What the island all-reduce (element-wise max) makes of its ranks' views."""
    return Membership.from_values([max(col) for col in zip(*(m.to_values() for m in ranks))])


def test_membership_survives_the_island_max_whatever_the_ranks_know():
    bridge = Membership(outer_step=7, healed=True, progress_void=True, peer_inner_step=140,
                        participants=3, participant_rank=0)
    assert _island_view(bridge) == bridge
    # Ranks without a bridge know nothing: the island's view is the bridge rank's.
    assert _island_view(Membership(), bridge, Membership()) == bridge
    assert bridge.leads and not Membership(participant_rank=1).leads and not Membership().leads
    # Two bridge ranks (sync_width 2) of one island hold the same quorum; any refusal wins.
    assert _island_view(bridge, Membership(**{**bridge.__dict__, "heal_refused": True})).heal_refused


def test_the_peer_step_counts_only_when_the_island_healed():
    assert Membership(peer_inner_step=99).to_values()[3] == 0  # its peer step
    assert Membership.from_values(Membership(healed=True, peer_inner_step=99).to_values()).peer_inner_step == 99


def test_first_round_waits_for_the_islands_and_later_rounds_do_not():
    assert must_wait(Membership(outer_step=0, participants=1), need=2)
    assert not must_wait(Membership(outer_step=0, participants=2), need=2)
    assert not must_wait(Membership(outer_step=3, participants=1), need=2)  # one island left goes on


@pytest.mark.parametrize("joining,healed,void,reset,contributes", [
    (False, False, False, False, True),   # an ordinary round
    (True, False, False, False, False),   # the first island of a new federation: nothing to send yet
    (True, True, False, True, False),     # a late joiner or restarted island: takes the global state
    (False, True, False, False, True),    # healed with the same weights (a new federation): still counts
    (False, True, True, True, False),     # healed with different weights: its progress is void
])
def test_plan_round(joining, healed, void, reset, contributes):
    plan = part_in_round(Membership(outer_step=5, healed=healed, progress_void=void), joining, fragments=2)
    assert (plan.reset, plan.contributes, plan.fragment) == (reset, contributes, 1)


def test_guard_refuses_non_finite_and_outliers_only_once_it_has_a_history():
    assert judge_pseudo_gradient(math.nan, [], 10.0) == Verdict(False, "non-finite values")
    assert not judge_pseudo_gradient(math.inf, [1.0] * 5, 0.0).accepted  # even with the norm check off
    assert judge_pseudo_gradient(1e6, [1.0] * (GUARD_MIN_HISTORY - 1), 10.0).accepted  # too few to judge a norm
    refused = judge_pseudo_gradient(11.0, [1.0, 1.0, 2.0], 10.0)
    assert not refused.accepted and "above 10 x the running median 1" in refused.reason
    assert judge_pseudo_gradient(10.0, [1.0, 1.0, 2.0], 10.0).accepted
    assert judge_pseudo_gradient(1e6, [1.0] * 5, 0.0).accepted  # limit 0: norm check off


def test_guard_window_keeps_the_newest_norms():
    norms: list[float] = []
    for i in range(GUARD_HISTORY + 5):
        remember_norm(norms, float(i))
    assert norms == [float(i) for i in range(5, GUARD_HISTORY + 5)]


def test_contribution_weight_edges():
    assert contribution_weight("tokens", 4096, True) == 4096.0
    assert contribution_weight("equal", 4096, True) == 1.0
    assert contribution_weight("tokens", 0, True) == 0.0      # zero tokens: nothing to weigh
    assert contribution_weight("equal", 4096, False) == 0.0   # not contributing (joining, void)
    assert contribution_weight("tokens", 4096, True, accepted=False) == 0.0  # refused


def test_outer_step_only_after_a_commit_with_progress():
    assert applies_outer_step(RoundResult(committed=True, participants=2, total_weight=2048.0))
    assert not applies_outer_step(RoundResult(committed=True, participants=2, total_weight=0.0))  # all refused
    assert not applies_outer_step(RoundResult(committed=False, participants=2, total_weight=2048.0))
    result = RoundResult(True, 3, 1.5, 12288)
    assert RoundResult.from_values(result.to_values()) == result


def test_streaming_merge_and_exchange_skipping():
    done = RoundResult(committed=True, total_weight=1.0)
    assert merges_local(done, reset=False, alpha=0.5)
    assert not merges_local(done, reset=True, alpha=0.5)
    assert not merges_local(done, reset=False, alpha=0.0)
    assert not merges_local(RoundResult(), reset=False, alpha=0.5)
    assert skips_exchange(joining=True, outer_step=0, init_sync=False)
    assert not skips_exchange(joining=True, outer_step=0, init_sync=True)
    assert not skips_exchange(joining=True, outer_step=4, init_sync=False)  # a late joiner exchanges
    assert not skips_exchange(joining=False, outer_step=0, init_sync=False)


def test_time_paced_round_closes_at_the_half_step_and_within_the_step_bounds():
    assert not round_is_up(3, 1, 100, elapsed_s=9.0, step_s=1.0, round_seconds=10.0)
    assert round_is_up(3, 1, 100, elapsed_s=9.5, step_s=1.0, round_seconds=10.0)  # next step would overrun more
    assert not round_is_up(1, 2, 100, elapsed_s=99.0, step_s=1.0, round_seconds=10.0)  # below min_inner_steps
    assert round_is_up(100, 1, 100, elapsed_s=0.0, step_s=1.0, round_seconds=10.0)  # max_inner_steps


def test_alignment_and_the_reference_fingerprint():
    assert aligned_inner_step(140, 2) == 142
    # Without a majority and among fresh islands: the furthest ahead, then the lowest id.
    table = [{"island": 1, "step": 4}, {"island": 0, "step": 4}, {"island": 2, "step": 3}]
    assert reference_fingerprint(table, [0, 1, 2], me=2) == {"island": 0, "step": 4}
    assert reference_fingerprint([{"island": 2, "step": 9}, {"island": 0, "step": 4}], [0, 1], me=1)["island"] == 2


def test_the_reference_is_the_majority_whatever_step_a_dishonest_member_claims():
    honest = [{"island": 0, "step": 4, "model": "a"}, {"island": 1, "step": 4, "model": "a"}]
    liar = {"island": 9, "step": 10**9, "model": "b"}
    for me in (0, 1, 2):
        assert reference_fingerprint([*honest, liar], [0, 0, 1], me)["model"] == "a"
    # A step that is not a whole number claims nothing and crashes nothing.
    odd = [{"island": 0, "step": 4, "model": "a"}, {"island": 1, "step": "x", "model": "b"},
           {"island": 2, "step": 4.5, "model": "c"}]
    assert reference_fingerprint(odd, [0, 1, 2], me=1)["model"] == "a"


def test_without_a_majority_an_established_island_keeps_its_own_and_a_fresh_one_follows_it():
    established = {"island": 0, "step": 7, "model": "a", "established": True}
    liar = {"island": 1, "step": 10**9, "model": "b", "established": True}
    assert reference_fingerprint([established, liar], [0, 1], me=0)["model"] == "a"  # never exits
    fresh = {"island": 2, "step": 0, "model": "c", "established": False}
    old = {"island": 5, "step": 3, "model": "a", "established": True}
    assert reference_fingerprint([fresh, old], [0, 1], me=0)["model"] == "a"  # the fresh one is the odd one


def test_declarations_count_for_at_most_the_limit_times_the_others_median():
    assert bounded_batches([4096.0, 2048.0, 1e15], 16) == [4096.0, 2048.0, 16 * 3072.0]
    assert bounded_batches([1e15], 16) == [1e15]  # alone: nobody to compare with
    assert bounded_batches([1e15, 1.0], 0) == [1e15, 1.0]  # the bound turned off
    assert bounded_batches([1e15, 0.0, 8.0], 2) == [16.0, 0.0, 8.0]  # an undeclared 0 is no peer to compare with


def _claim(step: int, digest: str, current: bool = True, inner: int = 100, tokens: int = 1000) -> StateClaim:
    return StateClaim(step, digest, current, inner, tokens)


def test_a_state_vouched_for_by_the_members_heals_and_takes_their_counters():
    claims = [_claim(0, "own", current=False), _claim(5, "h5", inner=50), _claim(5, "h5", inner=50),
              _claim(5, "h5", inner=10**9, tokens=10**15)]  # one supporter lies about its counters
    verdict, taken = heal_verdict(StateClaim(5, "h5"), claims, me=0)
    assert verdict.accepted and (taken.inner_step, taken.federation_tokens) == (50, 1000)


def test_a_member_claiming_a_step_ahead_of_islands_that_trained_together_is_refused():
    # Two honest islands committed step 4 together; a member claims step 5 with other weights.
    claims = [_claim(4, "h4"), _claim(4, "h4"), _claim(5, "forged")]
    for me in (0, 1):
        verdict, _ = heal_verdict(StateClaim(5, "forged"), claims, me)
        assert not verdict.accepted and "2 member(s)" in verdict.reason
    # A source at the federation's own step serving other weights than its peers at that step hold.
    claims = [_claim(0, "own", current=False), _claim(4, "h4"), _claim(4, "h4"), _claim(4, "forged")]
    verdict, _ = heal_verdict(StateClaim(4, "forged"), claims, me=0)
    assert not verdict.accepted and "2 member(s)" in verdict.reason
    assert heal_verdict(StateClaim(4, "h4"), claims, me=0)[0].accepted  # ... and from an honest source it heals
    # Weights that nobody claims (not even the source) are refused whatever the count.
    verdict, _ = heal_verdict(StateClaim(4, "other"), [_claim(0, "own", False), _claim(4, "h4")], me=0)
    assert not verdict.accepted and "no member vouches" in verdict.reason


def test_an_island_that_missed_rounds_heals_from_the_ones_that_went_on():
    # Its last round failed (it was cut off): it does not contradict the others' progress.
    claims = [_claim(4, "h4", current=False), _claim(9, "h9")]
    assert heal_verdict(StateClaim(9, "h9"), claims, me=0)[0].accepted
    # Left out of one quorum while committed: one to one, nothing tells who is right; it heals.
    claims = [_claim(4, "h4", current=True), _claim(5, "h5")]
    assert heal_verdict(StateClaim(5, "h5"), claims, me=0)[0].accepted
    # A restarted island among three that went on.
    claims = [_claim(2, "old", current=False), _claim(9, "h9"), _claim(9, "h9"), _claim(9, "h9")]
    assert heal_verdict(StateClaim(9, "h9"), claims, me=0)[0].accepted


# ---- every receiver's verdict on every island's row --------------------------------


def _row(norm: float = 1.0, tokens: float = 100.0, weight: float = 100.0, **kw) -> Contribution:
    return Contribution(tokens=tokens, weight=weight, norm=norm, **kw)


OPEN = Allowance(max_tokens=1000.0, max_norm=50.0)


@pytest.mark.parametrize("row,reason", [
    (_row(frame=FRAME_UNSIGNED), "not signed"), (_row(frame=FRAME_MALFORMED), "malformed"),
    (_row(tokens=float("nan")), "tokens nan"), (_row(weight=-1e6), "weight -1e+06"),
    (_row(tokens=1e15, weight=1e15), "tokens 1e+15 are more than"), (_row(weight=1001.0), "weight 1001"),
    (_row(finite=False), "non-finite"), (_row(norm=50.5), "absolute bound 50")])
def test_a_row_that_lies_or_breaks_its_allowance_is_refused(row, reason):
    verdicts = judge_contributions([_row(), row], [OPEN, OPEN], "tokens", 10.0)
    assert verdicts[0] == Verdict(True)
    assert not verdicts[1].accepted and reason in verdicts[1].reason


def test_equal_weighting_allows_weight_one_and_idle_rows_are_only_checked_for_their_claims():
    assert judge_contributions([_row(weight=1.0)], [OPEN], "equal", 10.0)[0].accepted
    assert "equal weighting" in judge_contributions([_row(weight=2.0)], [OPEN], "equal", 10.0)[0].reason
    # A joining island sends weight 0 and zeros: nothing of it is read but its claims.
    idle = _row(weight=0.0, tokens=0.0, finite=False, norm=1e30)
    assert judge_contributions([idle], [OPEN], "tokens", 10.0)[0].accepted


def test_with_three_contributors_a_norm_far_above_the_others_median_is_refused():
    free = Allowance(1000.0, math.inf)
    rows = [_row(1.0), _row(2.0), _row(3.0), _row(25.0)]
    verdicts = judge_contributions(rows, [free] * 4, "tokens", 10.0)
    assert [v.accepted for v in verdicts] == [True, True, True, False]
    assert "median 2 of the other islands" in verdicts[3].reason
    assert all(v.accepted for v in judge_contributions(rows[2:], [free] * 2, "tokens", 10.0))  # 2: no median
    assert all(v.accepted for v in judge_contributions(rows, [free] * 4, "tokens", 0.0))  # 0: off


def test_the_absolute_bound_follows_steps_learning_rate_size_and_global_norm():
    assert norm_allowance(10.0, 20, 2e-3, 10_000, 30.0) == pytest.approx(10 * 20 * 2e-3 * (100 + 30))
    assert norm_allowance(0.0, 20, 2e-3, 10_000, 30.0) == math.inf  # outer_norm_limit 0: off
    assert norm_allowance(10.0, 20, 0.0, 10_000, 30.0) == math.inf  # no declared learning rate
    assert steps_between_exchanges("steps", 20, 1000, 4) == 20
    assert steps_between_exchanges("time", 20, 50, 2) == 100


# ---- a member dead in the exchange (tests/test_exchange_retry.py runs it) -------------


def test_a_round_is_agreed_only_when_every_member_says_its_exchange_went_through():
    assert exchange_agreed([EXCHANGE_COMPLETED] * 3, 3)
    assert not exchange_agreed([EXCHANGE_COMPLETED, 0.0, EXCHANGE_COMPLETED], 3)  # one member failed
    assert not exchange_agreed(None, 3)  # the agreement itself failed here (a member died in it)
    assert not exchange_agreed([EXCHANGE_COMPLETED] * 2, 3)  # a member's flag is missing
    # An island without the federation's key signs no flag we can read: it has no say (its
    # rows count for nothing either), or an outsider in the quorum would fail every round.
    assert exchange_agreed([EXCHANGE_COMPLETED, None, EXCHANGE_COMPLETED], 3)


@pytest.mark.parametrize("agreed,attempt,retries,retry", [
    (True, 0, 2, False),   # it went through: no retry
    (False, 0, 2, True), (False, 1, 2, True),
    (False, 2, 2, False),  # retries spent: the round is lost
    (False, 0, 0, False),  # exchange_retries = 0: today's behaviour
])
def test_a_failed_exchange_is_retried_a_bounded_number_of_times(agreed, attempt, retries, retry):
    assert retries_exchange(agreed, attempt, retries) is retry


def test_the_pending_update_is_kept_only_while_the_federation_is_at_the_rounds_step():
    assert keeps_pending(Membership(outer_step=4, participants=2), 4)
    # A member committed the round without this island, which healed from it: plan anew.
    assert not keeps_pending(Membership(outer_step=5, healed=True, participants=2), 4)
    # A joining island that only now receives the state: its round is planned again.
    assert not keeps_pending(Membership(outer_step=4, healed=True, participants=3), 4)


def test_segment_repair_by_hand():
    # Four members; member 2 died in the first phase; summer 0 lacks member 1's segment 0.
    holds = [[True, False, True, True], [True, True, False, True], [True, True, True, True], [True, True, False, True]]
    plan = segment_repair([True, True, False, True], holds)
    assert plan.summers == ((0,), (1,), (0, 1, 3), (3,))  # the dead summer's segment in three parts
    assert plan.sends == ((1, 0, 0, 0),
                          (1, 0, 2, 0), (3, 0, 2, 0), (0, 1, 2, 1), (3, 1, 2, 1), (0, 3, 2, 2), (1, 3, 2, 2))


@pytest.mark.parametrize("seed", range(40))
def test_segment_repair_sums_exactly_the_survivors_rows_and_sends_nothing_twice(seed):
    import random

    rng = random.Random(seed)
    members = rng.randint(2, 9)
    alive = [rng.random() < 0.7 for _ in range(members)]
    alive[rng.randrange(members)] = True
    holds = [[rng.random() < 0.6 for _ in range(members)] for _ in range(members)]
    plan = segment_repair(alive, holds)
    live = {j for j in range(members) if alive[j]}
    assert len(set(plan.sends)) == len(plan.sends)
    for k, summers in enumerate(plan.summers):
        assert all(alive[summer] for summer in summers)
        assert summers == ((k,) if alive[k] else tuple(sorted(live)))
        for part, summer in enumerate(summers):
            sent = {j for j, to, segment, p in plan.sends if segment == k and p == part}
            assert all(to == summer for j, to, segment, p in plan.sends if segment == k and p == part)
            kept = {j for j in live if j == summer or (alive[k] and holds[k][j])}
            assert not sent & kept and sent | kept == live, (k, part, sent, kept)  # each survivor's row once
    # Balanced: every survivor sends and receives the same number of dead segments' parts.
    dead = [k for k in range(members) if not alive[k]]
    for j in live:
        received = sum(1 for s, to, segment, p in plan.sends if to == j and segment in dead)
        sent = sum(1 for s, to, segment, p in plan.sends if s == j and segment in dead)
        assert received == sent == len(dead) * (len(live) - 1)


def test_segment_repair_refuses_what_it_cannot_repair():
    with pytest.raises(ValueError):
        segment_repair([False, False], [[True, True], [True, True]])
    with pytest.raises(ValueError):
        segment_repair([True, True], [[True, True]])
