"""The messages between a thin island and the member carrying it (federation/carry.py):
what each side takes of the other's bytes, checked against forged, replayed and malformed
frames, and the accepted row folded as OuterCore.fold computes by hand."""

from __future__ import annotations

import os

import pytest
import torch

from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarrierBook, CarryRefused, open_weights, pack_request, pack_row
from archipelago.federation.codecs import build_codec
from archipelago.federation.outer_core import Carried, OuterCore
from archipelago.federation.policy import Allowance
from archipelago.federation.trust import FederationKey

NUMEL = 1000
CARRIER, THIN, OTHER = 0, 2, 1
ALLOW = Allowance(max_tokens=4096, max_norm=1e3)


def _setup() -> tuple[FederationKey, CarrierBook, torch.Tensor]:
    key = FederationKey(os.urandom(32))
    return key, CarrierBook(key, CARRIER, {THIN}), torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))


def _codec():  # noqa: ANN202 - a Codec
    return build_codec(FaultToleranceConfig(codec="int8"), NUMEL)


def test_a_thin_island_takes_only_its_own_fresh_answer_from_its_carrier():
    key, book, weights = _setup()
    frame = book.answer(pack_request(key, THIN, 77), step=5, weights=weights)
    step, got = open_weights(key, CARRIER, THIN, 77, NUMEL, frame)
    assert step == 5 and torch.equal(got, weights.bfloat16().float())
    for carrier, island, nonce, why in ((CARRIER, THIN, 78, "replay"), (OTHER, THIN, 77, "island 0"),
                                        (CARRIER, OTHER, 77, "replay")):
        with pytest.raises(CarryRefused, match=why):  # another request, signer, or thin island
            open_weights(key, carrier, island, nonce, NUMEL, frame)
    with pytest.raises(CarryRefused, match="signed without"):
        open_weights(FederationKey(os.urandom(32)), CARRIER, THIN, 77, NUMEL, frame)
    with pytest.raises(CarryRefused, match="bytes, expected"):
        open_weights(key, CARRIER, THIN, 77, NUMEL + 1, frame)
    bad = book.serve(THIN, nonce=79, step=5, weights=torch.full((NUMEL,), float("nan")))
    with pytest.raises(CarryRefused, match="not finite"):
        open_weights(key, CARRIER, THIN, 79, NUMEL, bad)
    with pytest.raises(CarryRefused, match="not a thin island"):
        book.answer(pack_request(key, OTHER, 1), step=5, weights=weights)
    # The carrier answers each nonce once, and only requests signed with the federation's key.
    with pytest.raises(CarryRefused, match="answered before"):
        book.answer(pack_request(key, THIN, 77), step=6, weights=weights)
    with pytest.raises(CarryRefused, match="signed without"):
        book.answer(pack_request(FederationKey(os.urandom(32)), THIN, 80), step=6, weights=weights)


def test_the_carrier_takes_one_row_per_download_at_the_step_it_served():
    key, book, weights = _setup()
    book.serve(THIN, nonce=11, step=3, weights=weights)
    row = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)) * 1e-2
    upload = book.receive(pack_row(key, THIN, 11, 640, _codec(), row), _codec(), ALLOW)
    expected = _codec().decode(_codec().encode(row))  # int8 is stateless: what any receiver decodes
    assert (upload.island, upload.base_step, upload.tokens) == (THIN, 3, 640.0)
    assert torch.equal(upload.values, expected)
    # The same upload again, or one naming a download never served: the discount would
    # follow a step the thin island chose.
    for nonce in (11, 12):
        with pytest.raises(CarryRefused, match="names no download"):
            book.receive(pack_row(key, THIN, nonce, 640, _codec(), row), _codec(), ALLOW)
    # Staleness from the served step: entering at outer step 5, it is 2 steps stale, and
    # folded into the carrier's row it adds its tokens-weighted, discounted share.
    core = OuterCore(FaultToleranceConfig(staleness_exponent=1.0), [torch.zeros(NUMEL)])
    own = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2)) * 1e-2
    values, tokens = core.fold(own, 1280, 0, [Carried(upload.values, upload.tokens, 5 - upload.base_step)])
    assert tokens == 1920
    assert torch.allclose(values * tokens, 1280 * own + 640 / 3 * expected, atol=1e-6)


@pytest.mark.parametrize("case,why", [
    ("other key", "signed without"), ("not carried", "not a thin island"),
    ("tokens", "raise carried_tokens on the carrier"),
    ("nan", "non-finite"), ("nan weight 0", "non-finite"), ("norm", "absolute bound"), ("malformed", "malformed"),
])
def test_the_carrier_refuses_what_a_receiver_would(case: str, why: str):
    key, book, weights = _setup()
    book.serve(THIN, nonce=5, step=1, weights=weights)
    row, tokens, codec, signer, island = torch.full((NUMEL,), 1e-3), 640.0, _codec(), key, THIN
    if case == "other key":
        signer = FederationKey(os.urandom(32))
    elif case == "not carried":
        island = OTHER
    elif case == "tokens":
        tokens = 10 * ALLOW.max_tokens
    elif case.startswith("nan"):
        row = row.clone()
        row[3] = float("nan")
        tokens = 0.0 if "weight 0" in case else tokens
    elif case == "norm":
        row = torch.full((NUMEL,), 100.0)
    elif case == "malformed":  # a payload of another length
        codec, row = build_codec(FaultToleranceConfig(codec="int8"), NUMEL // 2), row[:NUMEL // 2]
    with pytest.raises(CarryRefused, match=why):
        book.receive(pack_row(signer, island, 5, tokens, codec, row), _codec(), ALLOW)


def test_a_later_download_replaces_the_earlier_one_and_each_round_carries_one_row():
    key, book, weights = _setup()
    for nonce in range(3):  # a thin island retrying a download whose answer it lost
        book.answer(pack_request(key, THIN, nonce), step=1, weights=weights)
    with pytest.raises(CarryRefused, match="followed by a later download"):  # it trains from the last one
        book.receive(pack_row(key, THIN, 0, 1, _codec(), torch.zeros(NUMEL)), _codec(), ALLOW)
    book.answer(pack_request(key, THIN, 3), step=1, weights=weights)
    assert book.receive(pack_row(key, THIN, 3, 1, _codec(), torch.zeros(NUMEL)), _codec(), ALLOW).base_step == 1
    # Another download of the weights of outer step 1 carries no second row in; one of step 2 does.
    book.answer(pack_request(key, THIN, 4), step=1, weights=weights)
    with pytest.raises(CarryRefused, match="one row a round"):
        book.receive(pack_row(key, THIN, 4, 1, _codec(), torch.zeros(NUMEL)), _codec(), ALLOW)
    book.answer(pack_request(key, THIN, 5), step=2, weights=weights)
    assert book.receive(pack_row(key, THIN, 5, 1, _codec(), torch.zeros(NUMEL)), _codec(), ALLOW).base_step == 2
