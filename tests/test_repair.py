"""The segment repair's transport (federation/repair.py): the parts policy.segment_repair
plans cross among the survivors in one all-to-all with per-pair sizes (gloo, one thread per
survivor), each summer ends with exactly every survivor's encoding of the parts it sums,
and a frame that is forged, signed by the wrong island or addressed to another part is
refused by its receiver."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from archipelago.federation.codecs import Int8Codec
from archipelago.federation.exchange import Framing
from archipelago.federation.policy import segment_repair
from archipelago.federation.repair import (
    PartsInFlight,
    _addressed,
    frame_bytes,
    open_parts,
    part_range,
    planned_parts,
    send_parts,
)
from archipelago.federation.trust import FederationKey

NUMEL = 1000
SECRET = bytes(range(32))
# Four members; member 2 died in the first phase; summer 0 lacks member 1's segment 0.
ALIVE = [True, True, False, True]
HOLDS = [[True, False, True, True], [True, True, False, True], [True, True, True, True], [True, True, False, True]]
ISLANDS = [10, 11, 12, 13]  # island ids at replica ranks 0-3


class _Done:
    def wait(self) -> bool:
        return True


def _chunk(member: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(member))


def _framing(key: FederationKey, island: int) -> Framing:
    return Framing(key, quorum=9, step=3, fragment=0, island=island)


def _run_survivors(codec, plan, framings, weights) -> dict[int, dict]:
    """Each survivor in a thread of its own gloo group: its opened parts (or its error)."""
    live = [j for j in range(len(ALIVE)) if ALIVE[j]]
    store = dist.HashStore()
    segments = codec.segments(len(ALIVE))
    results: dict[int, dict] = {}

    def survivor(rank: int, me: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, len(live), timedelta(seconds=30))
            inflight = send_parts(group, codec, framings[me], _chunk(me), 100 + me, weights[me], plan, segments, me)
            results[me] = {"opened": open_parts(inflight, codec, framings[me], ISLANDS), "own": inflight.own,
                           "sent": inflight.sent}
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[me] = {"error": exc}

    threads = [threading.Thread(target=survivor, args=(rank, me), daemon=True) for rank, me in enumerate(live)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a survivor hung in the repair's all-to-all"
    assert not [r["error"] for r in results.values() if "error" in r]
    return results


def _encoded(codec, member: int, start: int, end: int) -> torch.Tensor:
    return codec.for_length(end - start).encode(_chunk(member)[start:end])


def test_every_summer_gets_exactly_every_survivors_encoding_of_its_parts():
    codec = Int8Codec(NUMEL, 32)
    key = FederationKey(SECRET)
    plan = segment_repair(ALIVE, HOLDS)
    framings = {j: _framing(key, ISLANDS[j]) for j in range(4)}
    results = _run_survivors(codec, plan, framings, {j: 1.0 for j in range(4)})
    segments = codec.segments(4)
    for part in planned_parts(codec, segments, plan):
        got = results[part.summer]["opened"][(part.sender, part.segment, part.part)]
        assert got is not None and torch.equal(got, _encoded(codec, part.sender, part.start, part.end)), part
    for me in (0, 1, 3):
        assert len(results[me]["opened"]) == sum(1 for s in plan.sends if s[1] == me)
        # Each summer's own share of the dead segment is encoded locally, not sent.
        (own_key, own), = results[me]["own"].items()
        start, end = part_range(codec, segments, plan, *own_key)
        assert own_key == (2, [0, 1, 3].index(me)) and torch.equal(own, _encoded(codec, me, start, end))
        assert results[me]["sent"] == sum(frame_bytes(codec, framings[me], p)
                                          for p in planned_parts(codec, segments, plan) if p.sender == me)
    # The dead segment's parts tile it on the codec's blocks: every value summed once.
    cuts = [part_range(codec, segments, plan, 2, part) for part in range(3)]
    assert cuts[0][0] == segments[2][0] and cuts[-1][1] == segments[2][1]
    assert all(a[1] == b[0] and (a[1] - segments[2][0]) % 32 == 0 for a, b in zip(cuts, cuts[1:]))


def test_a_survivor_signing_as_another_island_or_with_another_key_is_refused_by_every_receiver():
    codec = Int8Codec(NUMEL, 32)
    key = FederationKey(SECRET)
    plan = segment_repair(ALIVE, HOLDS)
    framings = {j: _framing(key, ISLANDS[j]) for j in range(4)}
    framings[1] = _framing(key, ISLANDS[0])                    # member 1 signs as member 0's island
    framings[3] = _framing(FederationKey(os.urandom(32)), ISLANDS[3])  # member 3 has another federation's key
    results = _run_survivors(codec, plan, {j: framings[j] for j in range(4)}, {j: 1.0 for j in range(4)})
    for part in planned_parts(codec, codec.segments(4), plan):
        got = results[part.summer]["opened"][(part.sender, part.segment, part.part)]
        if part.sender in (1, 3) or part.summer == 3:  # member 3 cannot check the federation's tags either
            assert got is None, part
        else:  # member 0 is honest: its parts open on member 1
            assert torch.equal(got, _encoded(codec, 0, part.start, part.end)), part


def test_a_part_addressed_elsewhere_or_of_another_round_is_refused():
    codec = Int8Codec(NUMEL, 32)
    key = FederationKey(SECRET)
    plan = segment_repair(ALIVE, HOLDS)
    segments = codec.segments(4)
    to_zero = [p for p in planned_parts(codec, segments, plan) if p.summer == 0]
    honest, sender = _framing(key, ISLANDS[3]), 3
    wanted = next(p for p in to_zero if p.sender == sender)
    other = next(p for p in planned_parts(codec, segments, plan) if p.sender == sender and p.summer == 1)

    def frame(framing, part, address_of):
        payload = _addressed(address_of, _encoded(codec, sender, part.start, part.end))
        return framing.frame(103, 1.0, payload, frame_bytes(codec, framing, part), kind=9, segment=part.segment)

    def opened(row):
        inflight = PartsInFlight(_Done(), row, [wanted], [0])
        return open_parts(inflight, codec, _framing(key, ISLANDS[0]), ISLANDS)[(sender, wanted.segment, wanted.part)]

    assert opened(frame(honest, wanted, wanted)) is not None
    readdressed = type(wanted)(wanted.sender, other.summer, wanted.segment, other.part, wanted.start, wanted.end)
    assert opened(frame(honest, wanted, readdressed)) is None       # meant for summer 1's part
    stale = Framing(key, quorum=9, step=2, fragment=0, island=ISLANDS[3])
    assert opened(frame(stale, wanted, wanted)) is None             # the previous round's frame
    tampered = frame(honest, wanted, wanted).clone()
    tampered[-40] ^= 1
    assert opened(tampered) is None


def test_an_island_of_weight_zero_sends_zeros_and_they_arrive_as_zeros():
    codec = Int8Codec(NUMEL, 32)
    plan = segment_repair(ALIVE, HOLDS)
    framings = {j: Framing(None, island=ISLANDS[j]) for j in range(4)}  # plain rows: no key
    results = _run_survivors(codec, plan, framings, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0})
    for part in planned_parts(codec, codec.segments(4), plan):
        got = results[part.summer]["opened"][(part.sender, part.segment, part.part)]
        if part.sender == 1:
            assert got is not None and not got.any()
        else:
            assert torch.equal(got, _encoded(codec, part.sender, part.start, part.end))
