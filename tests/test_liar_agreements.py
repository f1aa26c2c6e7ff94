"""Agreements one lying member cannot move ("Trust, third round", item 6).

The members all-gather what they measured, and every island decides from those claims
alike: codec = "auto"'s link and round (auto_codec.agree_on_link), decoupled rounds'
overlap and staleness (decoupled.Handoffs.decide, from agreement.agree_on_exchange's
signed facts). A decision one claim can move far is one a liar moves for every island.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation import auto_codec
from archipelago.federation.codecs import AutoCodec as AutoCodecOptions
from archipelago.federation.decoupled import OVERLAP_SCALE, Handoffs
from archipelago.federation.exchange import ROUND_AGREE, Framing
from archipelago.federation.trust import FederationKey

NUMEL = 10_000
LINK = 8e6  # 1 MB/s


class _Done:
    def wait(self) -> None:
        pass


class _Manager:
    """What the auto codec's agreement reads of a torchft manager."""

    _pg = object()  # gloo-like: rows cross in host memory

    def __init__(self, participants: int) -> None:
        self.participants = participants

    def errored(self) -> None:
        return None

    def num_participants(self) -> int:
        return self.participants


def _claims(monkeypatch: pytest.MonkeyPatch, rows: list[list[float]]) -> None:
    """The all-gather hands back `rows` (link, round, then every codec's CPU seconds)."""
    width = 2 + len(auto_codec.CPU_KEYS)

    def allgather(manager: Any, values: torch.Tensor, count: int) -> tuple[_Done, list[torch.Tensor]]:
        assert count == len(rows)
        return _Done(), [torch.tensor(row + [0.0] * (width - len(row)), dtype=torch.float64) for row in rows]

    monkeypatch.setattr(auto_codec, "allgather", allgather)


def _choice(monkeypatch: pytest.MonkeyPatch, rows: list[list[float]]) -> tuple[str, bool]:
    """(codec, moments ride) an honest island's outer loop takes when the members claim `rows`
    (its own first), with averaged moments (8 bytes a value: AdamW's two in fp32)."""
    ft = FaultToleranceConfig(codec="auto", codec_block_size=256, average_optimizer_state=True, sync_steps=100)
    _claims(monkeypatch, rows)
    chooser = auto_codec.AutoCodec(ft, _Manager(len(rows)), None, 100, moments_bytes_per_value=8)
    chooser.link_bits_s, chooser.last_round_s = rows[0][0], rows[0][1]
    codec = AutoCodecOptions(NUMEL, ft)
    chooser.rechoose(codec, torch.device("cpu"))
    return codec.current, chooser.carries_moments


def test_one_claim_of_a_huge_round_does_not_make_every_link_carry_fp32_and_the_moments(monkeypatch):
    # Two islands over 1 MB/s with 0.3 s rounds: a 0.015 s target (5%), which int8's 10.4 kB
    # meet, and not bf16's 20 kB nor the moments' 80 kB. A liar claiming a 10^12 s round made
    # the median (their mean, 5 x 10^11 s) every island's round: fp32 and the moments for
    # all, however thin the link (on ac842c6: ('fp32', True)).
    honest = _choice(monkeypatch, [[LINK, 0.3], [LINK, 0.3]])
    assert honest == ("int8", False)
    assert _choice(monkeypatch, [[LINK, 0.3], [LINK, 1e12]]) == honest
    # The agreed round is the lower median: with two islands the lower claim, with three
    # the middle one, whatever one member claims.
    _claims(monkeypatch, [[LINK, 10.0], [LINK, 1e12]])
    agreed = auto_codec.agree_on_link(_Manager(2), LINK, 10.0, 2, torch.device("cpu"))
    assert agreed is not None and agreed.round_s == 10.0
    _claims(monkeypatch, [[LINK, 10.0], [LINK, 12.0], [LINK, 1e12]])
    agreed = auto_codec.agree_on_link(_Manager(3), LINK, 10.0, 3, torch.device("cpu"))
    assert agreed is not None and agreed.round_s == 12.0
    # What a liar can still do: claim a shorter round (or a thinner link), which makes the
    # choice sparser for all, never denser.
    assert _choice(monkeypatch, [[LINK, 10.0], [LINK, 1e-3]]) == ("topk", False)


def test_a_link_claimed_too_thin_to_price_falls_to_the_fewest_bytes_not_the_densest(monkeypatch):
    # A link of 1e-305 bit/s is finite and positive (measured), and the slowest link is the
    # agreed one; every codec's seconds then overflow to inf, and the first of equal seconds
    # was the densest: fp32 for every island (on ac842c6). Ties go to the fewest bytes.
    assert _choice(monkeypatch, [[LINK, 10.0], [1e-305, 10.0]]) == ("topk", False)
    received = {"fp32": 40_016, "bf16": 20_016, "int8": 10_416, "topk": 1_776}
    assert auto_codec.densest_within(received, 1e-305, 1.0) == "topk"
    assert auto_codec.densest_within(received, LINK, 1e-9) == "topk"  # finite seconds: the fewest, as before


def _facts(*claims: tuple[float, bool]) -> list[tuple[float, float]]:
    """Every member's agreement facts as agree_on_exchange collects them from signed flags
    (exchange seconds / round seconds, trained on while it travelled)."""
    from archipelago.federation.agreement import agree_on_exchange

    key = FederationKey(os.urandom(32))
    own = Framing(key, quorum=7, step=3, fragment=0, island=0)
    rows = [Framing(key, 7, 3, 0, island).frame(measured * OVERLAP_SCALE, float(overlapped),
                                                torch.tensor([1], dtype=torch.uint8), own.row_bytes(1), ROUND_AGREE)
            for island, (measured, overlapped) in enumerate(claims[1:], start=1)]

    class Group:
        def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], options: Any) -> Any:
            for out, row in zip(outputs[0], [inputs[0], *rows]):
                out.copy_(row)
            return _Finished()

    class Manager:
        _pg = Group()

        def num_participants(self) -> int:
            return len(claims)

        def errored(self) -> None:
            return None

        def report_error(self, exc: Exception) -> None:
            raise AssertionError(exc)

    facts: list[tuple[float, float]] = []
    measured, overlapped = claims[0]
    assert agree_on_exchange(Manager(), own, torch.device("cpu"), measured * OVERLAP_SCALE, overlapped, facts)
    return facts


class _Finished:
    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done


def test_one_lying_member_cannot_make_every_island_overlap_or_discount_its_rows():
    # Two honest islands whose exchanges took 1% and 2% of their rounds (threshold 10%: wait
    # for them) and did not overlap the last one. One member claiming its exchange took
    # 10^6 rounds and that it trained on made every island overlap the next exchange and
    # discount its rows as stale (`any` and `max`; on ac842c6: (True, True)).
    threshold = 0.1
    facts = _facts((0.01, False), (0.02, False), (1e6, True))
    assert Handoffs(threshold).decide(facts) == (False, False)
    waiting = Handoffs(threshold)
    waiting.settle(*waiting.decide(facts), applied=True)
    assert not waiting.stale and not waiting.overlaps  # fresh rows, the next exchange waited for
    # Two islands, one of them lying: the lower claim. The liar cannot force an overlap or
    # a discount ...
    assert Handoffs(threshold).decide(_facts((0.01, False), (1e6, True))) == (False, False)
    # ... but can keep exchanges waited for and overlapped rows undiscounted, as if
    # staleness_exponent were 0 (it could send a wrong update of plausible size anyway).
    assert Handoffs(threshold).decide(_facts((0.3, True), (1e-6, False))) == (False, False)
    # With three, a majority of honest members decides either way.
    assert Handoffs(threshold).decide(_facts((0.3, True), (0.25, True), (1e-6, False))) == (True, True)
    # A member whose flag is not signed for the round says nothing (its facts are (0, 0)).
    assert Handoffs(threshold).decide([(0.3 * OVERLAP_SCALE, 1.0), (0.0, 0.0)]) == (True, True)
