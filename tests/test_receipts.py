"""Members confirm what they received before anything is summed (federation/receipts.py).

At ac842c6, with the same drills applied to its exchange (a dishonest member's own process
changing only what it sends): an island that sent each peer a different validly signed
row split the honest islands (three global hashes, two of them different; "agree: NO" in
the end-of-run summary only), and a summer that called the others' segments unsigned got
every honest island's row refused ("not signed with the federation key") while its own
became the whole outer step. Now every honest island refuses the liar in that round, and
the honest islands end with one global hash.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY, records, run_cli, run_cli_here
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from archipelago.federation import receipts
from archipelago.federation.confirm import CONFIRMED_COLUMNS
from archipelago.federation.exchange import COLUMNS, ROUND_ROW, ROUND_SEGMENT, SUMSQ, WEIGHT, Framing, empty_table
from archipelago.federation.trust import HEADER_BYTES, FederationKey

KEY = FederationKey(b"\x05" * 32)
SIGNERS = [Ed25519PrivateKey.generate() for _ in range(3)]
PUBLIC = tuple(s.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for s in SIGNERS)
PAYLOAD = 16


def _framing(member: int, signer: Ed25519PrivateKey | None = None) -> Framing:
    return Framing(KEY, quorum=9, step=4, fragment=0, island=member, signer=signer or SIGNERS[member],
                   members=PUBLIC, islands=(0, 1, 2))


def _evidence(member: int, value: float, kind: int = ROUND_ROW, segment: int = 0, weight: float = 1.0,
              signer: Ed25519PrivateKey | None = None) -> bytes:
    """The evidence of a row of `member` whose payload is all `value`."""
    framing = _framing(member, signer)
    payload = torch.full((PAYLOAD,), int(value), dtype=torch.uint8)
    row = framing.frame(64.0, weight, payload, framing.row_bytes(PAYLOAD), kind, segment)
    return framing.evidence(row, PAYLOAD)


def test_honest_receipts_refuse_nobody():
    rows = [_evidence(k, 1) for k in range(3)]
    assert receipts.judge_receipts(_framing(0), [rows, rows, rows], ROUND_ROW).rows == {}


def test_two_signed_versions_of_one_row_refuse_their_sender_only():
    """Member 2 sent member 0 one row and member 1 another, both signed by it."""
    a = [_evidence(0, 1), _evidence(1, 1), _evidence(2, 7)]
    b = [_evidence(0, 1), _evidence(1, 1), _evidence(2, 8)]
    refusals = receipts.judge_receipts(_framing(0), [a, b, a], ROUND_ROW)
    assert list(refusals.rows) == [2] and "equivocation" in refusals.rows[2]


def test_a_members_word_on_its_own_row_is_no_evidence():
    """Member 2 sent everyone one row but shows a second signed version in its own receipt
    (which it could send to some members only): that proves nothing, nobody is refused."""
    honest = [_evidence(0, 1), _evidence(1, 1), _evidence(2, 7)]
    own = [_evidence(0, 1), _evidence(1, 1), _evidence(2, 9)]
    assert receipts.judge_receipts(_framing(0), [honest, honest, own], ROUND_ROW).rows == {}


def test_a_row_missing_at_one_member_refuses_it_and_the_claimer():
    full = [_evidence(k, 1) for k in range(3)]
    claims = [receipts.NO_EVIDENCE, _evidence(1, 1), _evidence(2, 1)]
    refusals = receipts.judge_receipts(_framing(0), [full, claims, full], ROUND_ROW)
    assert sorted(refusals.rows) == [0, 1]
    assert "hold no valid copy" in refusals.rows[0] and "without evidence" in refusals.rows[1]


def test_evidence_signed_by_another_member_proves_nothing():
    """Member 1 shows a second version of member 0's row, which it signed itself (every
    member can make the federation key's tag, not another's signature)."""
    full = [_evidence(k, 1) for k in range(3)]
    forged = [_evidence(0, 5, signer=SIGNERS[1]), _evidence(1, 1), _evidence(2, 1)]
    refusals = receipts.judge_receipts(_framing(0), [full, forged, full], ROUND_ROW)
    assert "equivocation" not in refusals.rows.get(0, "")  # no proof against member 0
    assert 1 in refusals.rows  # the forger pays with its own row


def test_an_unsigned_receipt_refuses_its_member():
    full = [_evidence(k, 1) for k in range(3)]
    refusals = receipts.judge_receipts(_framing(0), [full, None, full], ROUND_ROW)
    assert list(refusals.rows) == [1]


def _statements(sumsq: float = 4.0, censor: bool = False, misreport: dict | None = None,
                second_version: bool = False) -> list[receipts.Statement]:
    """Three members' table frames of a reduce-scatter, opened: member j sums segment j; each
    states the segments it sent (sum of squares `sumsq` each). `censor`: summer 2 shows no
    segment of 0 and 1 and flags them; `misreport`: {(summer, sender): reported sum of
    squares}; `second_version`: summer 1 shows a second signed segment 1 of member 0."""
    statements = []
    for summer in range(3):
        table = empty_table(3)
        received = []
        for sender in range(3):
            evidence = _evidence(sender, 1, ROUND_SEGMENT, summer)
            if second_version and (summer, sender) == (1, 0):
                evidence = _evidence(sender, 2, ROUND_SEGMENT, summer)
            header = evidence[1:1 + HEADER_BYTES]
            table[sender, :] = receipts.stated_report(header, sumsq, CONFIRMED_COLUMNS, len(COLUMNS))
            if censor and summer == 2 and sender != 2:
                evidence, table[sender, CONFIRMED_COLUMNS.frame] = receipts.NO_EVIDENCE, 1.0
            if misreport and (summer, sender) in misreport:
                table[sender, SUMSQ] = misreport[(summer, sender)]
            received.append(evidence)
        sent = [_evidence(summer, 1, ROUND_SEGMENT, segment) for segment in range(3)]
        statements.append(receipts.Statement(table, received, sent, [sumsq] * 3))
    return statements


def _judge_tables(statements) -> receipts.Refusals:
    return receipts.judge_tables(_framing(0), statements, ROUND_SEGMENT, CONFIRMED_COLUMNS)


def test_honest_tables_refuse_nobody():
    refusals = _judge_tables(_statements())
    assert refusals.rows == {} and refusals.summers == {}


def test_a_summer_that_calls_signed_segments_unsigned_is_refused_not_its_victims():
    statements = _statements(censor=True)
    refusals = _judge_tables(statements)
    assert list(refusals.rows) == [2] and list(refusals.summers) == [2]
    assert "the summer is refused, not the sender" in refusals.rows[2]
    reports = torch.stack([s.table for s in statements])
    fixed = receipts.corrected_reports(reports, statements, refusals, CONFIRMED_COLUMNS)
    assert fixed[2, :2, CONFIRMED_COLUMNS.frame].tolist() == [0.0, 0.0]  # its flags on the others are gone
    assert fixed[2, :2, SUMSQ].tolist() == [4.0, 4.0] and fixed[2, :2, WEIGHT].tolist() == [1.0, 1.0]


def test_one_misreported_norm_refuses_the_summer_and_two_refuse_the_sender():
    one = _judge_tables(_statements(misreport={(2, 0): 400.0}))
    assert list(one.rows) == [2] and list(one.summers) == [2]
    # Member 0's statement contradicts both other summers: member 0 is the liar.
    two = _judge_tables(_statements(misreport={(1, 0): 400.0, (2, 0): 400.0}))
    assert list(two.rows) == [0] and two.summers == {}


def test_a_segment_signed_twice_refuses_its_sender():
    refusals = _judge_tables(_statements(second_version=True))
    assert list(refusals.rows) == [0] and "equivocation" in refusals.rows[0]


def test_the_table_frame_payload_round_trips():
    statement = _statements()[1]
    payload = receipts.table_payload(statement.table, statement.received, statement.sent, [1.5, math.nan, 2.0])
    assert len(payload) == receipts.table_payload_bytes(3, len(COLUMNS))
    back = receipts.read_table(payload, 3, len(COLUMNS))
    assert torch.equal(back.table, statement.table) and back.received == statement.received
    assert back.sent == statement.sent and back.sent_sumsq[0] == 1.5 and math.isnan(back.sent_sumsq[1])
    assert receipts.read_table(payload[:-1], 3, len(COLUMNS)) is None


# ---- three real islands on loopback, one dishonest ------------------------------------


def _keyed_federation(tmp_path: Path, monkeypatch, name: str, *extra: str) -> tuple[Path, dict]:
    key_file = tmp_path / "fed.key"
    if not key_file.exists():
        key_file.write_text(run_cli_here(["secret", "new"]).output)
        key_file.chmod(0o600)
    monkeypatch.setenv("ARCHIPELAGO_FEDERATION_KEY_FILE", str(key_file))
    run_dir = tmp_path / name
    done = run_cli(["local", "--islands", "1,1,1", "--no-table", *TINY, "--model.flavor", "tiny",
                    "--fault_tolerance.sync_steps", "4", "--training.steps", "12", "--training.val_every", "0",
                    "--checkpoint.no_enable", "--job.run_dir", str(run_dir), *extra], timeout=300)
    assert done.returncode == 0, done.output[-4000:]
    return run_dir, json.loads((run_dir / "federation.json").read_text())


def _refused_by_each(run_dir: Path) -> list[set[tuple[int, int]]]:
    """Per island, the (outer step, refused island) its receivers refused."""
    return [{(r["outer_step"], r["refused_island"]) for r in records(run_dir / f"island-{k}")
             if r.get("event") == "refused" and r.get("by") == "receivers"} for k in range(3)]


@pytest.mark.timeout(400)
def test_an_equivocating_member_is_refused_by_every_island_and_the_honest_agree(tmp_path, monkeypatch):
    run_dir, fed = _keyed_federation(tmp_path, monkeypatch, "equivocate", "--fault_tolerance.codec", "fp32",
                                     "--inject", "2:equivocate@2")
    assert _refused_by_each(run_dir) == [{(2, 2)}] * 3
    hashes = {island["global_hash"] for island in fed["islands"][:2]}
    assert len(hashes) == 1 and fed["global_hash_agree"]
    log = (run_dir / "island-0" / "train.log").read_text()
    assert "refused island 2: it sent different signed versions of its row to different members" in log


@pytest.mark.slow  # about 30 s on 2 cores: make test-slow (the rule is tested above, in-process)
@pytest.mark.timeout(400)
def test_a_censoring_summer_is_refused_not_its_victims(tmp_path, monkeypatch):
    run_dir, fed = _keyed_federation(tmp_path, monkeypatch, "censor", "--fault_tolerance.codec", "int8",
                                     "--inject", "2:censor@2")
    assert _refused_by_each(run_dir) == [{(2, 2)}] * 3
    assert fed["global_hash_agree"] and len({island["global_hash"] for island in fed["islands"]}) == 1
    log = (run_dir / "island-1" / "train.log").read_text()
    assert "the sum of segment 2 (by island 2) is not used" in log


@pytest.mark.slow  # about 30 s on 2 cores: make test-slow
@pytest.mark.timeout(400)
def test_a_receipt_sent_two_ways_fails_the_round_everywhere_and_the_honest_agree(tmp_path, monkeypatch):
    """Island 2 tells island 0 in its receipt that island 1's row never arrived, and island
    1 the truth: island 0 alone would refuse islands 1 and 2 and commit other weights. The
    receipts ride again in the agreement's flags, so every member sees that they reached
    members two ways: nobody applies that attempt, the retry commits, and all end alike."""
    run_dir, fed = _keyed_federation(tmp_path, monkeypatch, "split", "--fault_tolerance.codec", "fp32",
                                     "--inject", "2:split_receipt@2")
    assert fed["global_hash_agree"] and len({island["global_hash"] for island in fed["islands"]}) == 1
    for k in range(3):
        log = (run_dir / f"island-{k}" / "train.log").read_text()
        assert "the receipts of outer step 2 did not reach every member alike" in log
        assert "committed states of outer step" not in log  # nothing diverged


def test_members_whose_committed_states_differ_are_named_by_the_majority():
    """The backstop after every commit (healing.Healing.alarm_on_divergence): the members
    that claim another state than the majority for their step, by replica rank."""
    from archipelago.federation.policy import StateClaim, diverged

    def claim(digest: str, step: int = 5, current: bool = True) -> StateClaim:
        return StateClaim(step=step, digest=digest, current=current)

    assert diverged([claim("a"), claim("a"), claim("a")], 0) == []
    assert diverged([claim("b"), claim("a"), claim("a")], 1) == [0]
    assert diverged([claim("b"), claim("a"), claim("a")], 0) == [0]  # this island is the odd one
    assert diverged([claim("b"), claim("a", step=4), claim("a", current=False)], 0) == []  # nothing to compare
    assert diverged([claim("b"), claim("a")], 0) == [1]  # a tie keeps this island's own as the reference


def test_a_sum_that_reached_members_two_ways_fails_the_round_on_every_member(caplog):
    """The summed segments ride in the agreement's flags: summer 1 sent member 0 one signed
    sum and member 2 another. No member may apply the round; a summer the receipts already
    refused (its segment is zero everywhere) is not judged."""
    from archipelago.federation.agreement import arrived_differently
    from archipelago.federation.exchange import ROUND_SUM

    def sums(version: int) -> list[bytes]:
        return [_evidence(j, version if j == 1 else 1, ROUND_SUM, j) for j in range(3)]

    def differ(shown, refused=()) -> bool:
        groups = [receipts.Shown(ROUND_SUM, None, sums(1), set(refused))]
        return arrived_differently(_framing(0), groups, shown)

    assert not differ([sums(1), sums(1), sums(1)])
    assert differ([sums(1), sums(1), sums(2)])
    assert "summed segments of outer step 5 did not reach every member alike" in caplog.text
    assert not differ([sums(1), sums(1), sums(2)], {1})
    assert differ([sums(1), None, sums(1)])  # a flag that is not its member's
