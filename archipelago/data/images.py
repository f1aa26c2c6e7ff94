"""Fashion-MNIST, offline: the images the ResNet family trains on.

The 70,000 28x28 gray images (60,000 train, 10,000 test, 10 classes) come from Debian's
`dataset-fashion-mnist` package, the original IDX files. Installed, they are read from
/usr/share/datasets/fashion-mnist; otherwise `fetch_fashion_mnist` fetches the package
without root (`apt-get download`, then `dpkg-deb -x` into the cache), the way the text
corpus is fetched with pip. The IDX parser checks every header field before it trusts a
size: the files are local, but a truncated download must fail with a message, not a
short read.

`ImageBatchLoader` shards the training images across islands and ranks exactly as the
text loader shards windows (loader.ShardOrder), and applies a light augmentation (a
random crop after 2 pixels of zero padding, a horizontal flip) drawn from a generator
keyed by (seed, island, epoch, position): the same batch on a resume.
"""

from __future__ import annotations

import gzip
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .loader import ShardOrder, check_val_offset

PACKAGE = "dataset-fashion-mnist"
SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
FILES = {"train_images": "train-images-idx3-ubyte.gz", "train_labels": "train-labels-idx1-ubyte.gz",
         "test_images": "t10k-images-idx3-ubyte.gz", "test_labels": "t10k-labels-idx1-ubyte.gz"}
COUNTS = {"train": 60_000, "test": 10_000}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
# Mean and standard deviation of the training pixels (scaled to [0, 1]), for normalisation.
MEAN, STD = 0.2860, 0.3530
PAD = 2  # pixels of zero padding before the random crop


class ImagesUnavailable(RuntimeError):
    """The Fashion-MNIST files are not here and could not be fetched."""


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FILES.values())


def fetch_fashion_mnist(cache_dir: Path, system_dir: Path = SYSTEM_DIR, timeout_s: float = 600.0) -> Path:
    """The folder holding the four IDX files: the installed package's, else the cache's,
    fetched there first if needed (ImagesUnavailable naming the commands if that fails)."""
    if _complete(system_dir):
        return system_dir
    target = Path(cache_dir) / "fashion-mnist"
    if _complete(target):
        return target
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fashion-mnist-download-", dir=cache_dir))
    try:
        _download_and_extract(tmp, timeout_s)
        found = tmp / "root" / str(system_dir).lstrip("/")
        if not _complete(found):
            raise ImagesUnavailable(_unavailable(target, f"the package holds no {', '.join(FILES.values())}"))
        target.mkdir(parents=True, exist_ok=True)
        for name in FILES.values():
            shutil.move(str(found / name), target / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _download_and_extract(tmp: Path, timeout_s: float) -> None:
    for cmd in (["apt-get", "download", PACKAGE], None):
        if cmd is None:  # extract what apt-get fetched
            debs = sorted(tmp.glob(f"{PACKAGE}_*.deb"))
            if not debs:
                raise ImagesUnavailable(_unavailable(tmp.parent / "fashion-mnist", "apt-get fetched no .deb"))
            cmd = ["dpkg-deb", "-x", str(debs[-1]), str(tmp / "root")]
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ImagesUnavailable(_unavailable(tmp.parent / "fashion-mnist", repr(exc))) from exc
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise ImagesUnavailable(_unavailable(tmp.parent / "fashion-mnist",
                                                 f"{cmd[0]} exited with {proc.returncode}: {tail}"))


def _unavailable(target: Path, detail: str) -> str:
    return (f"cannot get Fashion-MNIST ({detail}). Install the Debian package ({PACKAGE}), or fetch it "
            f"by hand: `apt-get download {PACKAGE} && dpkg-deb -x {PACKAGE}_*.deb root && mkdir -p {target} && "
            f"cp root{SYSTEM_DIR}/*.gz {target}/`")


def read_idx(path: Path, dims: int) -> np.ndarray:
    """A gzip-compressed IDX file of unsigned bytes with `dims` dimensions, as uint8."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    if len(data) < 4 + 4 * dims:
        raise ValueError(f"{path}: {len(data)} bytes, shorter than an IDX header")
    zero, kind, ndim = struct.unpack_from(">HBB", data)
    if zero != 0 or kind != 0x08 or ndim != dims:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes with {dims} dimension(s) "
                         f"(magic {zero:#06x}, type {kind:#04x}, {ndim} dimension(s))")
    shape = struct.unpack_from(f">{dims}I", data, 4)
    body = data[4 + 4 * dims:]
    if len(body) != int(np.prod(shape)):
        raise ValueError(f"{path}: the header says {shape} = {int(np.prod(shape))} values, the file holds "
                         f"{len(body)} (a truncated download? delete it and fetch again)")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def load_split(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 28, 28], labels uint8 [N]) of `split` ("train" or "test")."""
    images = read_idx(folder / FILES[f"{split}_images"], 3)
    labels = read_idx(folder / FILES[f"{split}_labels"], 1)
    if images.shape != (COUNTS[split], 28, 28) or labels.shape != (COUNTS[split],):
        raise ValueError(f"{folder}: Fashion-MNIST {split} should hold {COUNTS[split]} images of 28x28 and as many "
                         f"labels, found {images.shape} and {labels.shape}")
    if labels.max() >= len(CLASSES):
        raise ValueError(f"{folder}: a {split} label of {int(labels.max())}, above the {len(CLASSES)} classes")
    return images, labels


def normalise(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float32 [N, 1, 28, 28], zero mean and unit variance over the train set."""
    return (torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1) - MEAN) / STD


def augment(batch: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """A random crop of each image after PAD pixels of zero (in normalised units: the
    background's value) padding, and a horizontal flip of half of them."""
    n, _, h, w = batch.shape
    padded = torch.nn.functional.pad(batch, (PAD, PAD, PAD, PAD), value=-MEAN / STD)
    dy, dx = rng.integers(0, 2 * PAD + 1, size=(2, n))
    flips = rng.random(n) < 0.5
    out = torch.stack([padded[k, :, dy[k]:dy[k] + h, dx[k]:dx[k] + w] for k in range(n)])
    out[torch.from_numpy(flips)] = out[torch.from_numpy(flips)].flip(-1)
    return out


class ImageBatchLoader:
    """Shuffled, augmented training batches of Fashion-MNIST for one rank of one island."""

    def __init__(self, folder: Path, global_batch_size: int, rank: int, world_size: int, seed: int,
                 island: int = 0, num_islands: int = 1, augmentation: bool = True,
                 log: Callable[[str], None] | None = None, shares: Sequence[int] | None = None) -> None:
        images, labels = load_split(Path(folder), "train")
        self.images, self.labels = normalise(images), torch.from_numpy(labels.astype(np.int64))
        self.augmentation = augmentation
        self._shards = ShardOrder(len(labels), global_batch_size, rank, world_size, seed, island, num_islands,
                                  "images", log, shares)

    @property
    def steps_per_epoch(self) -> int:
        return self._shards.steps_per_epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(images float32 [B, 1, 28, 28], labels int64 [B]), B = this rank's share of the global batch."""
        shards = self._shards
        key = (shards.seed, shards.island, shards.epoch, shards.cursor, shards.rank)
        index = torch.from_numpy(shards.next_indices().astype(np.int64))
        batch = self.images[index]
        if self.augmentation:
            batch = augment(batch, np.random.default_rng(key))
        return batch, self.labels[index]

    def state_dict(self) -> dict:
        return self._shards.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._shards.load_state_dict(state, "Fashion-MNIST's training split")


def validation_image_batches(folder: Path, batch_size: int, rank: int, world_size: int,
                             max_batches: int, offset: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`max_batches` x `batch_size` test images in file order from image `offset` on (no
    shuffle, no augmentation), each batch split across ranks in contiguous blocks, as the
    text validation batches are. Every rank yields the same number of batches."""
    if batch_size % world_size:
        raise ValueError(f"validation batch_size {batch_size} is not divisible by world_size {world_size}; "
                         f"set it to a multiple of {world_size}")
    images, labels = load_split(Path(folder), "test")  # checked now, not at the first evaluation
    check_val_offset(offset, len(labels), batch_size, "the test split", "images")
    images, labels = images[offset:], labels[offset:]
    batches = min(max_batches, len(labels) // batch_size)
    return _iter_validation(images, labels, batch_size, rank, world_size, batches)


def _iter_validation(images: np.ndarray, labels: np.ndarray, batch_size: int, rank: int, world_size: int,
                     batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    local = batch_size // world_size
    for j in range(batches):
        lo = j * batch_size + rank * local
        yield normalise(images[lo:lo + local]), torch.from_numpy(labels[lo:lo + local].astype(np.int64))
