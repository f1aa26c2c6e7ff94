"""Fashion-MNIST from the Debian package: the IDX reader, the fetch, and the sharded loader."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch

from archipelago.data.images import (
    FILES,
    MEAN,
    STD,
    ImageBatchLoader,
    ImagesUnavailable,
    fetch_fashion_mnist,
    load_split,
    read_idx,
)


def _write_idx(path, array: np.ndarray, kind: int = 0x08) -> None:
    header = struct.pack(">HBB", 0, kind, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_files_are_read_and_damaged_ones_refused(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "ok.gz", array)
    np.testing.assert_array_equal(read_idx(tmp_path / "ok.gz", 3), array)
    with pytest.raises(ValueError, match="dimension"):
        read_idx(tmp_path / "ok.gz", 1)
    _write_idx(tmp_path / "floats.gz", array, kind=0x0D)
    with pytest.raises(ValueError, match="unsigned bytes"):
        read_idx(tmp_path / "floats.gz", 3)
    with gzip.open(tmp_path / "ok.gz", "rb") as f:
        data = f.read()
    with gzip.open(tmp_path / "short.gz", "wb") as f:
        f.write(data[:-5])
    with pytest.raises(ValueError, match="truncated download"):
        read_idx(tmp_path / "short.gz", 3)


def test_without_apt_the_error_names_the_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get, no dpkg-deb
    with pytest.raises(ImagesUnavailable, match="apt-get download dataset-fashion-mnist"):
        fetch_fashion_mnist(tmp_path / "cache", system_dir=tmp_path / "none")


def test_the_package_holds_fashion_mnist(fashion_mnist):
    for split, count in (("train", 60_000), ("test", 10_000)):
        images, labels = load_split(fashion_mnist, split)
        assert images.shape == (count, 28, 28)
        # Fashion-MNIST is balanced: as many images of each of the 10 classes.
        assert np.bincount(labels).tolist() == [count // 10] * 10
    pixels = load_split(fashion_mnist, "train")[0] / 255.0
    assert abs(pixels.mean() - MEAN) < 1e-3 and abs(pixels.std() - STD) < 1e-3


def test_a_cached_copy_is_found_without_fetching(tmp_path, fashion_mnist, monkeypatch):
    (tmp_path / "fashion-mnist").mkdir()
    for name in FILES.values():
        (tmp_path / "fashion-mnist" / name).symlink_to(fashion_mnist / name)
    monkeypatch.setenv("PATH", "")  # fetching would fail
    assert fetch_fashion_mnist(tmp_path, system_dir=tmp_path / "none") == tmp_path / "fashion-mnist"


def test_shards_are_disjoint_ranks_add_up_and_a_resume_repeats_the_batch(fashion_mnist):
    whole = ImageBatchLoader(fashion_mnist, 8, rank=0, world_size=1, seed=3, island=0, num_islands=2,
                             augmentation=False)
    ranks = [ImageBatchLoader(fashion_mnist, 8, rank=r, world_size=2, seed=3, island=0, num_islands=2,
                              augmentation=False) for r in range(2)]
    other = ImageBatchLoader(fashion_mnist, 8, rank=0, world_size=1, seed=3, island=1, num_islands=2,
                             augmentation=False)
    for _ in range(3):
        images, labels = whole.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), images, rtol=0, atol=0)
        assert torch.equal(torch.cat([p[1] for p in parts]), labels)
    island0 = set(whole._shards.order.tolist())
    assert not island0 & set(other._shards.order.tolist())
    assert len(island0) + len(other._shards.order) == 60_000

    augmented = ImageBatchLoader(fashion_mnist, 8, rank=0, world_size=1, seed=3)
    augmented.next_batch()
    state = augmented.state_dict()
    expected = augmented.next_batch()
    resumed = ImageBatchLoader(fashion_mnist, 8, rank=0, world_size=1, seed=3)
    resumed.load_state_dict(state)
    got = resumed.next_batch()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    plain = ImageBatchLoader(fashion_mnist, 8, rank=0, world_size=1, seed=3, augmentation=False)
    plain.load_state_dict(state)
    assert not torch.equal(plain.next_batch()[0], expected[0])  # augmentation changed the pixels


def test_validation_images_are_the_test_split_in_order_shared_out_over_ranks(fashion_mnist):
    from archipelago.data import validation_image_batches

    images, labels = load_split(fashion_mnist, "test")
    whole = list(validation_image_batches(fashion_mnist, 8, rank=0, world_size=1, max_batches=3))
    halves = [list(validation_image_batches(fashion_mnist, 8, rank=r, world_size=2, max_batches=3)) for r in (0, 1)]
    assert len(whole) == len(halves[0]) == len(halves[1]) == 3
    for j, (x, y) in enumerate(whole):
        # Unaugmented, normalised, the j-th 8 test images; rank r holds the r-th 4 of them.
        assert torch.equal(y, torch.from_numpy(labels[8 * j:8 * j + 8].astype(np.int64)))
        torch.testing.assert_close(x[:, 0] * STD + MEAN, torch.from_numpy(images[8 * j:8 * j + 8] / 255.0).float())
        assert torch.equal(torch.cat([halves[0][j][0], halves[1][j][0]]), x)
    later = list(validation_image_batches(fashion_mnist, 8, rank=0, world_size=1, max_batches=2, offset=12))
    assert torch.equal(later[1][1], torch.from_numpy(labels[20:28].astype(np.int64)))  # from image 12 on
    with pytest.raises(ValueError, match=f"at most {len(labels) - 8} can be skipped"):
        validation_image_batches(fashion_mnist, 8, rank=0, world_size=1, max_batches=1, offset=len(labels) - 7)
    with pytest.raises(ValueError, match="multiple of 2"):
        validation_image_batches(fashion_mnist, 7, rank=0, world_size=2, max_batches=1)  # refused on the call
