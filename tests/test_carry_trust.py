"""Who may carry a thin island's rows (federation/carry.py, CarrierBook): a member holding
the federation's secret can sign as the thin island, so the carrier binds the carry to the
thin island's carry token (derived from its local key) and takes one row a round.

The attacks reproduced here, on loopback: another member, asking in the thin island's name
from its own process, pushes the thin island's download out of the carrier's book (its row
is refused and the member's chosen row goes in with `carried_tokens` of weight); and two
rows in one round, which make every receiver refuse the carrier's whole row."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import archipelago
from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarrierBook, CarryRefused, open_weights, pack_request
from archipelago.federation.carry_link import CarryClient, CarryServer
from archipelago.federation.carrying import Carrying, declared_tokens_per_step
from archipelago.federation.codecs import build_codec
from archipelago.federation.outer_core import OuterCore
from archipelago.federation.policy import Allowance, Contribution, judge_contributions, steps_between_exchanges
from archipelago.federation.trust import FederationKey, new_secret

NUMEL = 1000
CARRIER, THIN = 0, 2
CARRIED = 640  # tokens one upload claims (fault_tolerance.carried_tokens)

pytestmark = pytest.mark.timeout(120)

# Another member of the federation (it holds the secret), in its own process: it asks the
# carrier for the global weights in the thin island's name eight times, then uploads a row
# of its choosing against its last download. It prints what it got.
MEMBER_ASKING_AS_THIN = """
import json, sys
import torch
from archipelago.config.schema import FaultToleranceConfig
from archipelago.federation.carry import CarryRefused
from archipelago.federation.carry_link import CarryClient
from archipelago.federation.codecs import build_codec
from archipelago.federation.trust import FederationKey

url, secret, numel, thin, carrier, tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
client = CarryClient(FederationKey(bytes.fromhex(secret)), thin, carrier, url, numel, timeout=20)
got, refusals = [], []
for _ in range(8):
    try:
        got.append(client.download())
    except CarryRefused as exc:
        refusals.append(str(exc))
uploaded = False
if got:
    try:
        client.upload(got[-1], tokens, build_codec(FaultToleranceConfig(codec="int8"), numel),
                      torch.full((numel,), 0.01))
        uploaded = True
    except CarryRefused as exc:
        refusals.append(str(exc))
print(json.dumps({"downloads": len(got), "uploaded": uploaded, "refusals": refusals}))
"""


def _codec():  # noqa: ANN202 - a Codec
    return build_codec(FaultToleranceConfig(codec="int8"), NUMEL)


def _another_member(url: str, secret: str, tmp_path: Path) -> dict:
    """Run MEMBER_ASKING_AS_THIN in a process of its own (another machine's member: its own
    local key file), killed if it outlives its timeout."""
    root = str(Path(archipelago.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root, ARCHIPELAGO_CHECKPOINT_KEY_FILE=str(tmp_path / "member.key"))
    done = subprocess.run([sys.executable, "-c", MEMBER_ASKING_AS_THIN, url, secret, str(NUMEL), str(THIN),
                           str(CARRIER), str(CARRIED)], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_another_member_asking_in_the_thin_islands_name_cannot_push_out_its_download(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    secret = new_secret()
    key = FederationKey(bytes.fromhex(secret))
    server = CarryServer(CarrierBook(key, CARRIER, {THIN}), _codec(), Allowance(4096, 1e3), request_timeout=5.0)
    try:
        server.publish(3, torch.zeros(NUMEL))
        thin = CarryClient(key, THIN, CARRIER, server.address(), NUMEL, timeout=20)
        trained_from = thin.download()  # the thin island's download, which it trains from
        member = _another_member(server.address(), secret, tmp_path)
        row, refused = torch.full((NUMEL,), -0.002), None
        try:
            thin.upload(trained_from, 320, _codec(), row)
        except CarryRefused as exc:  # (ac842c6: its download was pushed out of the 8 remembered)
            refused = str(exc)
        taken = [(u.island, u.base_step, u.tokens) for u in server.take_uploads()]
        assert refused is None and taken == [(THIN, 3, 320.0)], (refused, taken)  # its row, and no other
        # The member's requests carry another carry token: none is served, so it had no
        # download to upload against, and the thin island's stayed in the book.
        assert member["downloads"] == 0 and not member["uploaded"], member
        assert all("another carry token" in why for why in member["refusals"]), member["refusals"]
    finally:
        server.close()


def _carrier(monkeypatch: pytest.MonkeyPatch) -> tuple[FederationKey, FaultToleranceConfig, Carrying, OuterCore]:
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    key = FederationKey(bytes.fromhex(new_secret()))
    ft = FaultToleranceConfig(replica_id=CARRIER, carries=THIN, carried_tokens=CARRIED, codec="int8")
    carrying = Carrying(ft, key, NUMEL, tokens_per_step=100, inner_lr=0.01)
    core = OuterCore(ft, [torch.zeros(NUMEL)])
    return key, ft, carrying, core


def _judged_by_a_receiver(ft: FaultToleranceConfig, tokens: float) -> bool:
    """Whether every receiver takes the carrier's row claiming `tokens`: they hold it to what
    the carrier declared at the join, per inner step, times the steps of an exchange."""
    steps = steps_between_exchanges(ft.round_pacing, ft.sync_steps, ft.max_inner_steps, 1)
    allowance = Allowance(declared_tokens_per_step(ft, 100) * steps, math.inf)
    return judge_contributions([Contribution(tokens, tokens, norm=1.0)], [allowance], "tokens", 0.0)[0].accepted


def test_two_uploads_in_one_round_leave_the_first_and_the_carriers_row_valid(monkeypatch):
    key, ft, carrying, core = _carrier(monkeypatch)
    try:
        own_tokens = 100 * ft.sync_steps
        carrying.publish(3, core.globals[0])
        client = CarryClient(key, THIN, CARRIER, carrying.server.address(), NUMEL, timeout=20)
        codec = build_codec(ft, NUMEL)
        first = torch.full((NUMEL,), 1e-3)
        client.upload(client.download(), CARRIED, codec, first)
        # A second download at the same outer step, and its row: a thin island faster than
        # its carrier, or anyone holding its token. Refused at the carrier, the first kept.
        refused = ""
        try:
            client.upload(client.download(), CARRIED, codec, torch.full((NUMEL,), 5e-3))
        except CarryRefused as exc:
            refused = str(exc)
        own = torch.full((NUMEL,), 2e-3)
        values, tokens, uploads = carrying.fold(core, own, own_tokens, 0, outer_step=3)
        assert not _judged_by_a_receiver(ft, own_tokens + 2 * CARRIED)  # what two rows would claim
        assert _judged_by_a_receiver(ft, tokens) and tokens == own_tokens + CARRIED, tokens  # (ac842c6: two)
        assert len(uploads) == 1 and torch.equal(uploads[0].values, codec.decode(build_codec(ft, NUMEL).encode(first)))
        assert "one row a round" in refused
        # The next round's weights: its download of them carries a row in again.
        carrying.after_round(uploads, committed=True, step=4, weights=core.globals[0])
        client.upload(client.download(), CARRIED, codec, first)
        assert len(carrying.fold(core, own, own_tokens, 0, outer_step=4)[2]) == 1
    finally:
        carrying.close()


def test_a_row_that_came_while_the_round_carrying_one_failed_waits_for_the_next_row(monkeypatch):
    key, ft, carrying, core = _carrier(monkeypatch)
    try:
        own_tokens, own = 100 * ft.sync_steps, torch.full((NUMEL,), 2e-3)
        client = CarryClient(key, THIN, CARRIER, carrying.server.address(), NUMEL, timeout=20)
        codec = build_codec(ft, NUMEL)
        carrying.publish(3, core.globals[0])
        early = client.download()
        carrying.publish(4, core.globals[0])  # a round committed meanwhile
        client.upload(early, CARRIED, codec, torch.full((NUMEL,), 1e-3))  # trained from step 3
        _, _, carried = carrying.fold(core, own, own_tokens, 0, outer_step=4)  # the round carrying it ...
        client.upload(client.download(), CARRIED, codec, torch.full((NUMEL,), 3e-3))  # (from step 4)
        carrying.after_round(carried, committed=False, step=4, weights=core.globals[0])  # ... fails
        _, tokens, uploads = carrying.fold(core, own, own_tokens, 0, outer_step=4)
        assert [u.base_step for u in uploads] == [3] and _judged_by_a_receiver(ft, tokens)
        carrying.after_round(uploads, committed=True, step=5, weights=core.globals[0])
        _, tokens, uploads = carrying.fold(core, own, own_tokens, 0, outer_step=5)  # the one that waited
        assert [u.base_step for u in uploads] == [4] and tokens == own_tokens + CARRIED
    finally:
        carrying.close()


def test_the_carrier_serves_the_first_carry_token_only_and_a_thin_island_keeps_its_own(monkeypatch, tmp_path):
    from test_thin import _Hooks, _thin_ft

    from archipelago.federation.carry import CARRY_REQUEST, carry_token, derive_carry_token
    from archipelago.federation.outcome import FederationError
    from archipelago.federation.thin import ThinIsland
    from archipelago.federation.trust import FrameHeader, seal

    key = FederationKey(os.urandom(32))
    book, weights = CarrierBook(key, CARRIER, {THIN}), torch.zeros(NUMEL)
    # A thin island's token: from its local key, the same at every restart; another local
    # key, island or federation gives another.
    local = os.urandom(32)
    mine = derive_carry_token(local, key, THIN)
    assert mine == derive_carry_token(local, key, THIN) != derive_carry_token(os.urandom(32), key, THIN)
    assert mine != derive_carry_token(local, key, 3) != derive_carry_token(local, FederationKey(os.urandom(32)), 3)
    open_weights(key, CARRIER, THIN, 1, NUMEL, book.answer(pack_request(key, THIN, 1, mine), 3, weights))
    with pytest.raises(CarryRefused, match="another carry token"):
        book.answer(pack_request(key, THIN, 2, carry_token(key, THIN)), 3, weights)
    assert book.outstanding[THIN] == (1, 3)  # the refused request left the book as it was
    with pytest.raises(CarryRefused, match="no carry token"):  # a request of an older thin island
        book.answer(seal(key, FrameHeader(3, 0, 0, THIN, CARRY_REQUEST), b""), 3, weights)
    open_weights(key, CARRIER, THIN, 4, NUMEL, book.answer(pack_request(key, THIN, 4, mine), 3, weights))
    assert book.outstanding[THIN] == (4, 3)  # its own later download replaces its earlier one
    # A ThinIsland asks with the token of its local key file; a carrier that serves another
    # one (a member that asked first in its name) stops it at the join, naming the key file.
    monkeypatch.delenv("LOCAL_ADDR", raising=False)
    monkeypatch.setenv("ARCHIPELAGO_CHECKPOINT_KEY_FILE", str(tmp_path / "thin.key"))
    server = CarryServer(CarrierBook(key, CARRIER, {THIN}), _codec(), Allowance(4096, 1e3), request_timeout=5.0)
    thin = None
    try:
        server.publish(1, weights)
        server.book.answer(pack_request(key, THIN, 9, "ab" * 16), 1, weights)  # someone else's token first
        model = torch.nn.Linear(NUMEL // 10, 10, bias=False)
        thin = ThinIsland(_thin_ft(server.address()), 10, list(model.parameters()), 0, 1, key, _Hooks())
        assert carry_token(key, THIN) == derive_carry_token(bytes.fromhex((tmp_path / "thin.key").read_text()),
                                                            key, THIN)
        with pytest.raises(FederationError, match="ARCHIPELAGO_CHECKPOINT_KEY_FILE"):
            thin.join(0)
        server.book = CarrierBook(key, CARRIER, {THIN})  # a restarted carrier: the first to ask is taken
        thin.join(0)
        assert server.book.tokens[THIN] == carry_token(key, THIN)
    finally:
        if thin is not None:
            thin.shutdown()
        server.close()
