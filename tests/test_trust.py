"""Trust between islands: the federation secret, derived keys and signed frames."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import stat
import tracemalloc
import uuid

import pytest
from conftest import FinishedWork

from archipelago.config import ConfigError
from archipelago.federation.trust import (
    HEADER_BYTES,
    TAG_BYTES,
    FederationKey,
    FrameHeader,
    FrameRefused,
    load_key,
    new_secret,
    open_frame,
    seal,
)

SECRET = bytes.fromhex(new_secret())
HEADER = FrameHeader(quorum=3, step=10, fragment=1, island=2, kind=7, tokens=4096, weight=4096.0)


def test_derived_keys_follow_hkdf_from_the_secret():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

    key = FederationKey(SECRET)
    # HKDF without salt (RFC 5869): PRK = HMAC(zeros, secret), then one expand block per 32 bytes.
    prk = hmac.new(b"\0" * 32, SECRET, hashlib.sha256).digest()
    expected = HKDFExpand(algorithm=hashes.SHA256(), length=32, info=b"archipelago island 2").derive(prk)
    assert key.island_key(2) == expected
    assert len({key.island_key(i) for i in range(4)}) == 4
    assert FederationKey(SECRET).federation_id == key.federation_id != FederationKey(os.urandom(32)).federation_id


def test_a_sealed_frame_opens_with_its_claims():
    key = FederationKey(SECRET)
    got, payload = open_frame(key, seal(key, HEADER, b"pseudo-gradient"), HEADER)
    assert payload == b"pseudo-gradient" and got == HEADER


def test_a_frame_signed_with_another_secret_is_refused_before_its_fields_are_read():
    outsider = FederationKey(os.urandom(32))
    with pytest.raises(FrameRefused, match="without the federation's key"):
        open_frame(FederationKey(SECRET), seal(outsider, HEADER, b"x" * 100), HEADER)


@pytest.mark.parametrize("where", [0, 30, HEADER_BYTES - 1, HEADER_BYTES + 3, -1],
                         ids=["magic", "header", "digest", "payload", "tag"])
def test_one_flipped_byte_anywhere_is_refused(where):
    key = FederationKey(SECRET)
    frame = bytearray(seal(key, HEADER, b"y" * 64))
    frame[where] ^= 0x01
    with pytest.raises(FrameRefused):
        open_frame(key, bytes(frame), HEADER)


@pytest.mark.parametrize("field,value", [("step", 11), ("quorum", 4), ("fragment", 0), ("island", 1), ("kind", 1)])
def test_a_valid_frame_replayed_elsewhere_is_refused(field, value):
    key = FederationKey(SECRET)
    frame = seal(key, HEADER, b"z")
    with pytest.raises(FrameRefused, match="a replay"):
        open_frame(key, frame, dataclasses.replace(HEADER, **{field: value}))


def test_a_frame_of_any_island_opens_when_allowed_but_still_not_elsewhere():
    key = FederationKey(SECRET)
    frame = seal(key, HEADER, b"state")
    assert open_frame(key, frame, dataclasses.replace(HEADER, island=0), any_island=True)[0].island == 2
    with pytest.raises(FrameRefused, match="a replay"):
        open_frame(key, frame, dataclasses.replace(HEADER, island=0, step=9), any_island=True)


def test_a_truncated_frame_is_refused():
    key = FederationKey(SECRET)
    with pytest.raises(FrameRefused, match="shorter"):
        open_frame(key, seal(key, HEADER, b"")[:HEADER_BYTES + TAG_BYTES - 1], HEADER)


def test_key_files_load_from_the_option_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("ARCHIPELAGO_FEDERATION_KEY_FILE", raising=False)
    assert load_key("") is None
    path = tmp_path / "fed.key"
    path.write_text(SECRET.hex() + "\n")
    path.chmod(0o600)
    assert load_key(str(path)).federation_id == FederationKey(SECRET).federation_id
    monkeypatch.setenv("ARCHIPELAGO_FEDERATION_KEY_FILE", str(path))
    assert load_key("").federation_id == FederationKey(SECRET).federation_id
    path.write_text("not hex")
    with pytest.raises(ConfigError, match="archipelago secret new"):
        load_key(str(path))
    path.write_text("abcd")
    with pytest.raises(ConfigError, match="at least 32 are needed"):
        load_key(str(path))
    with pytest.raises(ConfigError, match="cannot read the federation key file"):
        load_key(str(tmp_path / "missing.key"))


@pytest.mark.parametrize("address,refused", [("", False), ("127.0.0.5", False), ("::1", False),
                                             ("localhost", False), ("10.0.0.1", True), ("fd00::11", True),
                                             ("island-3.example", True)])
def test_an_island_exposed_beyond_loopback_needs_a_key_or_insecure(monkeypatch, caplog, address, refused):
    from archipelago.federation.trust import refuse_exposed_without_key

    monkeypatch.setenv("LOCAL_ADDR", address)
    refuse_exposed_without_key(FederationKey(SECRET), insecure=False)  # a key: always fine
    if not refused:
        refuse_exposed_without_key(None, insecure=False)
        return
    with pytest.raises(ConfigError, match="archipelago secret new.*--federation_security.insecure"):
        refuse_exposed_without_key(None, insecure=False)
    refuse_exposed_without_key(None, insecure=True)
    assert "anyone who reaches that address" in caplog.text


# ---- signed rows of a round (federation/exchange.py) -------------------------------


class _Quiet:
    """What inspect_gather asks of a manager when the collective went well (and a done work)."""

    def errored(self) -> None:
        return None

    def wait(self) -> bool:
        return True


def _rows(framing_of, payloads, tokens=(100.0, 300.0)):
    from archipelago.federation.codecs import Codec

    codec = Codec(4)
    return codec, [framing_of(k).frame(t, t, p, framing_of(k).row_bytes(16)) for k, (t, p) in
                   enumerate(zip(tokens, payloads))]


def _inspect(codec, rows, framing):
    from archipelago.federation.exchange import Gathered, SkippedWork, inspect_gather

    gathered = Gathered(SkippedWork(), framing, rows)
    return inspect_gather(gathered, codec, _Quiet(), len(rows)), gathered


def test_signed_rows_open_on_every_receiver_and_a_flipped_byte_or_a_replay_is_refused():
    import torch

    from archipelago.federation.exchange import FRAME, ISLAND, SUMSQ, TOKENS, Framing
    from archipelago.federation.policy import FRAME_OK, FRAME_UNSIGNED

    key = FederationKey(SECRET)
    values = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 0.5, 0.5, 0.5])]
    payloads = [v.view(torch.uint8) for v in values]

    def at(step):
        return lambda island: Framing(key, quorum=7, step=step, fragment=0, island=island)

    codec, rows = _rows(at(5), payloads)
    table, gathered = _inspect(codec, rows, at(5)(0))
    assert table[:, FRAME].tolist() == [FRAME_OK, FRAME_OK] and table[:, ISLAND].tolist() == [0, 1]
    assert table[:, TOKENS].tolist() == [100.0, 300.0] and table[:, SUMSQ].tolist() == [30.0, 1.0]
    assert torch.equal(gathered.payloads[1].view(torch.float32), values[1])
    for where in (10, HEADER_BYTES + 3, HEADER_BYTES + 16 + 5):  # header, payload, tag
        tampered = [rows[0], rows[1].clone()]
        tampered[1][where] ^= 1
        table, gathered = _inspect(codec, tampered, at(5)(0))
        assert table[:, FRAME].tolist() == [FRAME_OK, FRAME_UNSIGNED] and gathered.payloads[1] is None
    _, old = _rows(at(4), payloads)  # island 1's valid row of the previous round, replayed
    table, _ = _inspect(codec, [rows[0], old[1]], at(5)(0))
    assert table[:, FRAME].tolist() == [FRAME_OK, FRAME_UNSIGNED]
    table, _ = _inspect(codec, [rows[0], rows[0]], at(5)(0))  # island 0's row in island 1's place
    assert table[:, FRAME].tolist() == [FRAME_OK, FRAME_UNSIGNED]
    outsider = Framing(FederationKey(os.urandom(32)), quorum=7, step=5, fragment=0, island=1)
    _, foreign = _rows(lambda island: outsider, payloads)
    table, _ = _inspect(codec, [rows[0], foreign[1]], at(5)(0))
    assert table[:, FRAME].tolist() == [FRAME_OK, FRAME_UNSIGNED]


def test_a_join_frame_authenticates_a_fingerprint_for_one_quorum_only():
    import torch

    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation.membership import _row_bytes, fingerprint, fingerprint_row, read_fingerprint_row

    key = FederationKey(SECRET)
    mine = fingerprint("llama3/debug", [("w", (2, 3))], FaultToleranceConfig(enable=True, replica_id=2), 1,
                       tokens_per_step=1024, key=key, inner_lr=2e-3)
    row = fingerprint_row(mine, key, quorum=7)
    assert b"\x00" in row  # binary: the exchange carries zero bytes, and says how many
    gathered = torch.zeros(3, 1026, dtype=torch.uint8)
    gathered[1, :2] = torch.tensor(list(len(row).to_bytes(2, "big")), dtype=torch.uint8)
    gathered[1, 2:2 + len(row)] = torch.tensor(list(row), dtype=torch.uint8)
    gathered[2, :2] = 255  # a length that does not fit the row
    assert [_row_bytes(r) for r in gathered] == [b"", row, b""]
    assert read_fingerprint_row(row, key, 7) == mine
    assert read_fingerprint_row(row, key, 8)["unauthenticated"]  # a replay at another quorum
    outsider = fingerprint_row(dict(mine, tokens_per_step=10**15), FederationKey(os.urandom(32)), 7)
    assert read_fingerprint_row(outsider, key, 7)["unauthenticated"]  # declares nothing
    plain = fingerprint_row(mine, None, 7)
    assert read_fingerprint_row(plain, key, 7)["unauthenticated"]  # no key at all
    assert read_fingerprint_row(plain, None, 7) == mine  # a federation without a key reads JSON
    forged = bytearray(row)
    forged[-40] ^= 1  # inside the JSON: the tag no longer matches
    assert read_fingerprint_row(bytes(forged), key, 7)["unauthenticated"]


class _Quorum:
    """A manager whose fingerprint all-gather brings the other members' rows (replica ranks 1..)."""

    _quorum_id = 5

    def __init__(self, rows: list[bytes]) -> None:
        self.rows = rows
        self._pg = self

    def allgather(self, outputs, inputs, options=None):
        import torch

        outputs[0][0].copy_(inputs[0])
        for k, raw in enumerate(self.rows, start=1):
            outputs[0][k][:2] = torch.tensor(list(len(raw).to_bytes(2, "big")), dtype=torch.uint8)
            outputs[0][k][2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        return FinishedWork()

    def register_state_dict_fn(self, *args) -> None:
        pass

    def current_step(self) -> int:
        return 0

    def num_participants(self) -> int:
        return len(self.rows) + 1

    def participating_rank(self) -> int:
        return 0

    def errored(self) -> None:
        return None


def test_an_island_among_impostors_trains_on_and_one_among_members_is_reported(caplog):
    from torch import nn

    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation.diloco import OuterLoop
    from archipelago.federation.membership import fingerprint, fingerprint_row

    ours, theirs = FederationKey(SECRET), FederationKey(os.urandom(32))

    def island(replica: int, key: FederationKey):
        ft = FaultToleranceConfig(enable=True, replica_id=replica)
        model = nn.Linear(3, 2)
        fp = fingerprint("linear", [(n, tuple(p.shape)) for n, p in model.named_parameters()], ft, 1,
                         tokens_per_step=64, key=key, inner_lr=1e-3)
        return ft, model, fp

    def row(replica: int, key: FederationKey) -> bytes:
        return fingerprint_row(dict(island(replica, key)[2], step=0), key, _Quorum._quorum_id)

    ft, model, fp = island(0, ours)
    alone = OuterLoop(ft, [list(model.parameters())], 0, 1, _Quorum([row(1, theirs), row(2, theirs)]), fp, key=ours)
    # Alone with members that replay tokens but sign nothing: it neither exits nor blames its own
    # key (cb92e48 raised FederationMismatch here); it refuses their rows and goes on.
    assert alone.quorum.check_members(alone.fingerprint, alone.established) is False
    assert "none of the 2 other island(s) of quorum 5" in caplog.text and "impostors" in caplog.text
    assert [p.get("unauthenticated", False) for p in alone.quorum.peers] == [False, True, True]
    member = OuterLoop(ft, [list(model.parameters())], 0, 1, _Quorum([row(1, theirs), row(2, ours)]), fp, key=ours)
    # the outsider is no mismatch: its rows are refused
    assert member.quorum.check_members(member.fingerprint, member.established) is False
    assert "unauthenticated member at replica rank 1 of quorum 5" in caplog.text
    assert [p.get("unauthenticated", False) for p in member.quorum.peers] == [False, True, False]


def test_member_ids_carry_a_token_only_the_key_makes():
    from archipelago.federation.trust import check_member_id, member_id

    key, other = FederationKey(SECRET), FederationKey(bytes.fromhex(new_secret()))
    assert member_id(None, 3) == "island_3"
    made = member_id(key, 3)
    # One token per island and key in a process: the one it proves to the gate is the one torchft sends.
    assert made.startswith("island_3:") and made == member_id(key, 3) != member_id(key, 4) != member_id(other, 4)
    assert check_member_id(key, made) == 3
    assert check_member_id(key, f"{made}:{uuid.uuid4()}") == 3  # torchft's suffix
    name, token = made.split(":")
    guess = hmac.new(b"guess", b"", "sha256").hexdigest()[:32]
    forged = [member_id(other, 3), f"island_4:{token}", made[:-1] + ("0" if made[-1] != "0" else "1"),
              "island_3", f"island_3:{token}x", f"{name}:{token[:16]}{guess}"]
    assert [check_member_id(key, f) for f in forged] == [None] * len(forged)


def test_the_island_a_member_id_names_is_checked_with_a_key_and_read_without():
    from archipelago.federation.trust import member_id, member_island

    key, other = FederationKey(SECRET), FederationKey(bytes.fromhex(new_secret()))
    suffix = f":{uuid.uuid4()}"
    assert member_island(key, member_id(key, 12) + suffix) == 12
    assert member_island(key, member_id(other, 12) + suffix) == -1  # another federation's token
    assert member_island(key, "island_12" + suffix) == -1            # no token at all
    assert member_island(None, "island_12" + suffix) == 12 and member_island(None, "island_7") == 7
    assert [member_island(None, bad) for bad in ("island_", "island_012", "islandx_1", "node_3:1")] == [-1] * 4


def test_an_island_neither_heals_from_nor_serves_a_quorum_with_an_outsider():
    from types import SimpleNamespace

    from archipelago.federation.membership import MembersOnly
    from archipelago.federation.trust import member_id

    key = FederationKey(SECRET)
    members = [f"{member_id(key, 0)}:{uuid.uuid4()}", f"{member_id(key, 1)}:{uuid.uuid4()}"]
    quorum = SimpleNamespace(quorum_id=4, replica_rank=1, replica_world_size=3, recover_src_manager_address="rogue",
                             recover_src_replica_rank=2, recover_dst_replica_ranks=[0], store_address="s",
                             max_step=10**9, max_replica_rank=2, max_world_size=1, heal=True, commit_failures=0,
                             replica_ids=members)
    manager = SimpleNamespace()
    client = SimpleNamespace(_quorum=lambda **kw: quorum, should_commit=lambda *a: True)
    checked = MembersOnly(client, key, manager)
    assert checked._quorum(step=3) is quorum and manager._archipelago_outsiders == []
    assert checked.should_commit() is True  # everything else is torchft's client
    quorum.replica_ids = [*members, "island_2:rogue"]
    seen = checked._quorum(step=3)
    assert manager._archipelago_outsiders == ["island_2:rogue"]
    assert seen.heal is False and seen.recover_dst_replica_ranks == []
    assert (seen.quorum_id, seen.replica_rank, seen.max_step) == (4, 1, 10**9)


def test_a_round_in_a_quorum_with_an_outsider_reports_an_error_and_names_it_once(caplog):
    from torch import nn

    from archipelago.config.schema import FaultToleranceConfig
    from archipelago.federation.diloco import OuterLoop

    class WithOutsider(_Quorum):
        _archipelago_outsiders = ["island_2:rogue"]
        errors: list = []

        def report_error(self, exc) -> None:
            self.errors.append(exc)

    ft = FaultToleranceConfig(enable=True, replica_id=0, lighthouse="http://127.0.0.1:1")
    model = nn.Linear(3, 2)
    manager = WithOutsider([])
    loop = OuterLoop(ft, [list(model.parameters())], 0, 1, manager, {}, key=FederationKey(SECRET))
    loop.quorum.refuse_outsiders()
    loop.quorum.refuse_outsiders()  # the next round of the same quorum: refused again, not logged again
    assert len(manager.errors) == 2 and "'island_2:rogue'" in str(manager.errors[0])
    assert caplog.text.count("unauthenticated member(s) 'island_2:rogue' in quorum 5") == 1
    assert "archipelago lighthouse --key-file" in caplog.text


def test_one_token_names_one_member_id_only_whole_and_canonical():
    from archipelago.federation.trust import check_member_id, member_id

    key = FederationKey(SECRET)
    made = member_id(key, 7)
    name, token = made.split(":")
    suffix = str(uuid.uuid4())
    # Anything but nothing or exactly torchft's `:UUID` after a valid token would mint members.
    sybils = [f"{made}:sybil0", f"{made}:sybil1", f"{made}:", f"{made}:{suffix}x", f"{made}:{suffix}:{suffix}",
              f"{made}:{suffix.upper()}", f"{made}:{suffix[:-1]}", f"{made}\n", f"{made}:{suffix}\n", f" {made}",
              f"island_07:{token}", f"island_\u0667:{token}", f"island_007:{token}:{suffix}"]
    assert [check_member_id(key, s) for s in sybils] == [None] * len(sybils)
    assert check_member_id(key, f"{made}:{suffix}") == check_member_id(key, made) == 7

    from archipelago.federation.trust import verified_member

    assert verified_member(key, f"{made}:{suffix}") == (7, made)  # the token the gate binds to one member


def test_island_keys_cost_bounded_memory_whatever_ids_are_asked_for():
    from archipelago.federation.trust import check_member_id

    key = FederationKey(SECRET)
    forged = bytearray(seal(key, HEADER, b"p"))
    at = 4 + 16 + 8 + 8 + 4  # the header's island field: magic, federation, quorum, step, fragment
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for island in range(20_000):  # ids an outsider picks: the gate's replica ids, a frame's island field
            assert check_member_id(key, f"island_{island}:{'0' * 48}") is None
            forged[at:at + 4] = (10**6 + island).to_bytes(4, "big")
            with pytest.raises(FrameRefused):
                open_frame(key, bytes(forged), HEADER)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1 << 20, f"{grown} bytes kept for 40,000 ids"  # unbounded: ~5 MB


def test_a_key_file_others_can_read_is_refused_unless_allowed(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("ARCHIPELAGO_ALLOW_READABLE_KEY", raising=False)
    path = tmp_path / "fed.key"
    path.write_text(SECRET.hex() + "\n")
    for mode in (0o644, 0o640, 0o604, 0o620):
        path.chmod(mode)
        with pytest.raises(ConfigError, match=f"chmod 600 {path}"):
            load_key(str(path))
    path.chmod(0o644)
    assert load_key(str(path), allow_readable=True).federation_id == FederationKey(SECRET).federation_id
    monkeypatch.setenv("ARCHIPELAGO_ALLOW_READABLE_KEY", "1")
    assert load_key(str(path)).federation_id == FederationKey(SECRET).federation_id
    assert "can be read by other users" in caplog.text
    path.chmod(0o400)
    monkeypatch.delenv("ARCHIPELAGO_ALLOW_READABLE_KEY")
    assert load_key(str(path)) is not None


def test_secret_new_out_writes_a_private_file_and_never_overwrites_without_force(tmp_path, capsys):
    from archipelago.launch.cli import main

    path = tmp_path / "fed.key"
    old_umask = os.umask(0)  # even a umask that keeps nothing private
    try:
        assert main(["secret", "new", "--out", str(path)]) == 0
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    assert load_key(str(path)) is not None and len(bytes.fromhex(first.strip())) == 32
    assert main(["secret", "new", "--out", str(path)]) == 2
    assert "exists" in capsys.readouterr().err and path.read_text() == first
    path.chmod(0o644)
    assert main(["secret", "new", "--out", str(path), "--force"]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() != first
    assert [p.name for p in tmp_path.iterdir()] == ["fed.key"]  # no temporary file left
    link = tmp_path / "link.key"
    link.symlink_to(tmp_path / "elsewhere.key")
    assert main(["secret", "new", "--out", str(link)]) == 2  # a planted link is not followed
    assert not (tmp_path / "elsewhere.key").exists()
    capsys.readouterr()
    assert main(["secret", "new"]) == 0 and len(capsys.readouterr().out.strip()) == 64  # printed, as before


def test_every_kind_of_signed_frame_has_its_own_number():
    # The kind is part of what a frame's signature binds: two kinds with one number would
    # let a frame of one be opened as the other where the rest of its header matches (a
    # moments row of outer step 0 as a state claim, when both were 7). A new kind goes here.
    from archipelago.federation import carry, exchange, give_up, inner_state, membership, receipts, trust

    kinds = {"HEAL_REQUEST": trust.HEAL_REQUEST, "HEAL_STATE": trust.HEAL_STATE,
             "ROUND_ROW": exchange.ROUND_ROW, "ROUND_SEGMENT": exchange.ROUND_SEGMENT,
             "ROUND_SUM": exchange.ROUND_SUM, "ROUND_AGREE": exchange.ROUND_AGREE,
             "JOIN": membership.JOIN, "CLAIM": membership.CLAIM, "MOMENTS": inner_state.MOMENTS,
             "CARRIED_ROW": carry.CARRIED_ROW, "GLOBAL_WEIGHTS": carry.GLOBAL_WEIGHTS,
             "CARRY_REQUEST": carry.CARRY_REQUEST, "GIVEN_UP": give_up.GIVEN_UP,
             "ROUND_RECEIPT": receipts.ROUND_RECEIPT, "ROUND_TABLE": receipts.ROUND_TABLE}
    numbers: dict[int, list[str]] = {}
    for name, number in kinds.items():
        numbers.setdefault(number, []).append(name)
    assert {n: names for n, names in numbers.items() if len(names) > 1} == {}
