"""The segment repair's transport (federation/repair.py): the parts policy.segment_repair
plans cross among the survivors in one all-to-all with per-pair sizes (gloo, one thread per
survivor), each summer ends with exactly every survivor's encoding of the parts it sums,
and a frame that is forged, signed by the wrong island or addressed to another part is
refused by its receiver."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from archipelago.federation.codecs import Int8Codec
from archipelago.federation.exchange import FRAME, ISLAND, TOKENS, WEIGHT, Framing, SkippedWork
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
from archipelago.federation.trust import SIGNATURE_BYTES, FederationKey

NUMEL = 1000
SECRET = bytes(range(32))
# Four members; member 2 died in the first phase; summer 0 lacks member 1's segment 0.
ALIVE = [True, True, False, True]
HOLDS = [[True, False, True, True], [True, True, False, True], [True, True, True, True], [True, True, False, True]]
ISLANDS = [10, 11, 12, 13]  # island ids at replica ranks 0-3


def _chunk(member: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(member))


def _framing(key: FederationKey, island: int) -> Framing:
    return Framing(key, quorum=9, step=3, fragment=0, island=island)


def _in_threads(survivor, members: list[int]) -> None:
    """survivor(rank, member) for each member in a thread of its own, with a hard timeout."""
    threads = [threading.Thread(target=survivor, args=(rank, me), daemon=True) for rank, me in enumerate(members)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a survivor hung in the repair"


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

    _in_threads(survivor, live)
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
        inflight = PartsInFlight(SkippedWork(), row, [wanted], [0])
        return open_parts(inflight, codec, _framing(key, ISLANDS[0]), ISLANDS)[(sender, wanted.segment, wanted.part)]

    assert opened(frame(honest, wanted, wanted)) is not None
    readdressed = type(wanted)(wanted.sender, other.summer, wanted.segment, other.part, wanted.start, wanted.end)
    assert opened(frame(honest, wanted, readdressed)) is None       # meant for summer 1's part
    stale = Framing(key, quorum=9, step=2, fragment=0, island=ISLANDS[3])
    assert opened(frame(stale, wanted, wanted)) is None             # the previous round's frame
    tampered = frame(honest, wanted, wanted).clone()
    tampered[-40 - SIGNATURE_BYTES] ^= 1  # in the tag (the member's signature follows it)
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


# ---- the whole repaired exchange ------------------------------------------------------

class _Manager:
    """What the repair asks of torchft's manager: its group, and errors reported to it."""

    def __init__(self, group) -> None:
        self._pg, self.error = group, None

    def errored(self):
        return self.error

    def report_error(self, exc) -> None:
        self.error = exc

    def wrap_future(self, fut, default):
        return fut


def _old_gathered(codec, key, me: int, tokens, weights, cut_half=()):
    """Summer `me`'s first phase as the death left it: the rows HOLDS says arrived, whole;
    the others zeros, or half of them (`cut_half`: a row cut off mid-transfer)."""
    from archipelago.federation.exchange import ROUND_SEGMENT, Gathered

    segments = codec.segments(4)
    start, end = segments[me]
    piece = codec.for_length(end - start)
    framings = [Framing(key, quorum=8, step=3, fragment=0, island=ISLANDS[j]) for j in range(4)]
    size = framings[0].row_bytes(max(codec.for_length(e - s).payload_bytes() for s, e in segments))
    rows = torch.stack([framings[j].frame(tokens[j], weights[j], piece.encode(_chunk(j)[start:end]), size,
                                          ROUND_SEGMENT, me) for j in range(4)])
    for j in range(4):
        if not HOLDS[me][j]:
            rows[j].zero_()
        elif j in cut_half and j != me:
            rows[j, size // 2:].zero_()
    return Gathered(None, framings[me], [rows], segments=segments, rank=me)


def _repair_all(codec, key, tokens, weights, framing_of=None, cut_half=()):
    """Every survivor's repaired exchange in a thread: (merged table, result, manager error)."""
    from archipelago.federation.repair import finish_repair, repair_first_phase

    survivors = [j for j in range(4) if ALIVE[j]]
    store = dist.HashStore()
    out: dict[int, tuple] = {}

    def survivor(rank: int, me: int) -> None:
        try:
            manager = _Manager(dist.ProcessGroupGloo(store, rank, len(survivors), timedelta(seconds=30)))
            framing = (framing_of or (lambda j: Framing(key, quorum=9, step=3, fragment=0, island=ISLANDS[j])))(me)
            repaired, table = repair_first_phase(manager, codec, _old_gathered(codec, key, me, tokens, weights,
                                                                               cut_half),
                                                 framing, _chunk(me), tokens[me], weights[me], survivors, ISLANDS)
            verdicts = [w if table[i, FRAME] == 0 else 0.0 for i, w in enumerate(table[:, WEIGHT].tolist())]
            into = torch.empty(NUMEL + 2)
            kept = sum(tokens[j] for j, w in zip(survivors, verdicts) if w)
            finish_repair(repaired, codec, into, verdicts, kept, manager)
            out[me] = (table, into, manager.error, repaired)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out[me] = (None, None, exc, None)

    _in_threads(survivor, survivors)
    return out


def _expected(codec, weights, plan, survivors) -> torch.Tensor:
    """The survivors' rows summed unit by unit from their own chunks (each unit encoded as
    its own piece, summed in survivor order, encoded again), without the repair's code paths."""
    from archipelago.federation.repair import part_range

    segments = codec.segments(4)
    total = torch.zeros(NUMEL)
    for k, summers in enumerate(plan.summers):
        for part in range(len(summers)):
            start, end = part_range(codec, segments, plan, k, part)
            piece = codec.for_length(end - start)
            acc = torch.zeros(end - start)
            for j in survivors:
                acc += weights[j] * piece.decode(piece.encode(_chunk(j)[start:end]))
            total[start:end] = piece.decode(piece.encode(acc))
    return total


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "plain"])
def test_the_repaired_exchange_sums_exactly_the_survivors_rows_alike_on_every_survivor(signed):
    # Plain rows cannot say whether they arrived whole: all of them travel again.
    codec = Int8Codec(NUMEL, 32)
    key = FederationKey(SECRET) if signed else None
    tokens, weights = [100.0, 300.0, 200.0, 400.0], [100.0, 300.0, 200.0, 400.0]
    # Summer 1 holds member 3's row only half: not held, so it travels again.
    out = _repair_all(codec, key, tokens, weights, cut_half=(3,))
    assert all(error is None for _, _, error, _ in out.values()), [e for _, _, e, _ in out.values()]
    holds = [row[:] for row in HOLDS] if signed else [[j == k for j in range(4)] for k in range(4)]
    holds[1][3] = False
    plan = segment_repair(ALIVE, holds)
    expected = _expected(codec, weights, plan, [0, 1, 3])
    for me, (table, into, _, _) in out.items():
        assert table[:, TOKENS].tolist() == [100.0, 300.0, 400.0] and table[:, FRAME].tolist() == [0, 0, 0]
        assert table[:, ISLAND].tolist() == ([10, 11, 13] if signed else [-1, -1, -1])
        assert torch.equal(into[:-2], expected), me
        assert into[-2:].tolist() == [800.0, 800.0]
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][1], out[3][1])
    # Signed: summer 1 received member 3's segment 1 again, and summer 0 member 1's segment
    # 0; only the dead segment's parts and those two rows travelled.
    resent = [(p.sender, p.summer) for p in planned_parts(codec, codec.segments(4), plan) if p.segment != 2]
    assert resent == ([(1, 0), (3, 1)] if signed else [(1, 0), (3, 0), (0, 1), (3, 1), (0, 3), (1, 3)])


def test_a_part_signed_as_another_island_refuses_its_sender_on_every_survivor_alike():
    codec = Int8Codec(NUMEL, 32)
    key = FederationKey(SECRET)
    tokens, weights = [100.0, 300.0, 200.0, 400.0], [100.0, 300.0, 200.0, 400.0]
    # Member 3 signs its parts as island 10 (member 0's): every receiver refuses them.
    out = _repair_all(codec, key, tokens, weights, framing_of=lambda j: Framing(
        key, quorum=9, step=3, fragment=0, island=ISLANDS[0] if j == 3 else ISLANDS[j]))
    assert all(error is None for _, _, error, _ in out.values()), [e for _, _, e, _ in out.values()]
    for table, into, _, _ in out.values():  # member 3's row is left out by all three, itself included
        assert table[2, FRAME] != 0 and table[0, FRAME] == 0 and table[1, FRAME] == 0
        assert into[-2:].tolist() == [400.0, 400.0]
    plan = segment_repair(ALIVE, HOLDS)
    expected = _expected(codec, {0: 100.0, 1: 300.0, 3: 0.0}, plan, [0, 1, 3])
    assert all(torch.equal(into[:-2], expected) for _, into, _, _ in out.values())
