"""Tests for fedfusion.datasets.loading: real Fashion-MNIST plus faked torchvision datasets."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.datasets
from helpers.fake_datasets import FakeCIFAR, channel_images, write_mnist_folder

from fedfusion.datasets import (
    DATA_DIR_ENV,
    DATASETS,
    DatasetBundle,
    DatasetNotFoundError,
    load_dataset,
    loading,
)

FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(
    not (FMNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test sees its own fakes/env, not a bundle cached by an earlier test."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    load_dataset.cache_clear()
    yield
    load_dataset.cache_clear()


def _read_raw_idx(path: Path, header_bytes: int) -> np.ndarray:
    """Independent IDX reader for cross-checking: skip the header, keep the bytes."""
    with gzip.open(path, "rb") as handle:
        return np.frombuffer(handle.read(), dtype=np.uint8, offset=header_bytes)


@pytest.fixture(scope="module")
def fmnist() -> DatasetBundle:
    return load_dataset("fmnist")


@pytest.fixture(scope="module")
def fmnist_raw_train() -> tuple[np.ndarray, np.ndarray]:
    images = _read_raw_idx(FMNIST_DIR / "train-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    labels = _read_raw_idx(FMNIST_DIR / "train-labels-idx1-ubyte.gz", 8).astype(np.int64)
    return images, labels


# --- real Fashion-MNIST ------------------------------------------------------------


@needs_fmnist
def test_fmnist_sizes_shapes_and_labels(fmnist: DatasetBundle) -> None:
    assert len(fmnist.train) + len(fmnist.val) == 60000
    assert len(fmnist.val) == 500
    assert len(fmnist.test) == 10000
    assert fmnist.num_classes == 10 and fmnist.input_shape == (1, 28, 28)
    for split in (fmnist.train, fmnist.val, fmnist.test):
        assert split.x.dtype == torch.float32 and split.x.is_contiguous()
        assert split.x.shape == (len(split), 1, 28, 28)
        assert split.y.dtype == torch.int64 and split.y.shape == (len(split),)
        assert set(split.y.unique().tolist()) == set(range(10))


@needs_fmnist
def test_fmnist_holdout_partitions_the_training_set(fmnist: DatasetBundle) -> None:
    val, train = fmnist.val_indices, fmnist.train_indices
    assert len(val) == len(fmnist.val) and len(train) == len(fmnist.train)
    assert np.all(np.diff(val) > 0) and np.all(np.diff(train) > 0)
    assert np.intersect1d(val, train).size == 0
    assert np.array_equal(np.union1d(val, train), np.arange(60000))


@needs_fmnist
def test_fmnist_stats_and_rows_match_raw_idx(
    fmnist: DatasetBundle, fmnist_raw_train: tuple[np.ndarray, np.ndarray]
) -> None:
    images, labels = fmnist_raw_train
    pixels = images.astype(np.float64) / 255.0
    assert fmnist.mean[0] == pytest.approx(pixels.mean(), abs=1e-9)
    assert fmnist.std[0] == pytest.approx(pixels.std(), abs=1e-9)
    assert fmnist.mean[0] == pytest.approx(0.2860, abs=1e-4)
    assert fmnist.std[0] == pytest.approx(0.3530, abs=1e-4)
    # Rows and labels come from the recorded original indices, normalised as documented.
    assert np.array_equal(fmnist.train.y.numpy(), labels[fmnist.train_indices])
    assert np.array_equal(fmnist.val.y.numpy(), labels[fmnist.val_indices])
    for split, indices in ((fmnist.train, fmnist.train_indices), (fmnist.val, fmnist.val_indices)):
        rows = [0, len(indices) // 2, len(indices) - 1]
        expected = (pixels[indices[rows]] - fmnist.mean[0]) / fmnist.std[0]
        np.testing.assert_allclose(split.x[rows, 0].numpy(), expected, atol=1e-5)


@needs_fmnist
def test_fmnist_val_size_zero_and_seeded_holdout(fmnist: DatasetBundle) -> None:
    empty = load_dataset("fmnist", val_size=0)
    assert len(empty.train) == 60000 and len(empty.val) == 0
    assert empty.val.x.shape == (0, 1, 28, 28) and empty.val.y.shape == (0,)
    assert empty.val_indices.size == 0
    assert empty.mean == fmnist.mean  # statistics never depend on the holdout

    assert load_dataset("fmnist") is load_dataset("fmnist")  # cached per process
    load_dataset.cache_clear()
    again = load_dataset("fmnist", seed=0)
    assert np.array_equal(again.val_indices, fmnist.val_indices)
    other = load_dataset("fmnist", seed=1)
    assert not np.array_equal(other.val_indices, fmnist.val_indices)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="cifar100.*svhn"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="val_size"):
        load_dataset("fmnist", val_size=-1)
    assert DATASETS == ("fmnist", "mnist", "cifar10", "cifar100", "svhn", "digits")


# --- IDX files from data_dir / FEDFUSION_DATA_DIR ----------------------------------


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_from_data_dir_idx_files(tmp_path: Path, compress: bool) -> None:
    written = write_mnist_folder(tmp_path, compress)
    bundle = load_dataset("mnist", data_dir=str(tmp_path), val_size=5, seed=3)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (35, 5, 12)
    images, labels = written["train"]
    assert bundle.mean[0] == pytest.approx(images.mean() / 255.0, abs=1e-9)
    assert np.array_equal(bundle.val.y.numpy(), labels[bundle.val_indices])
    np.testing.assert_array_equal(bundle.test.y.numpy(), written["test"][1])
    with pytest.raises(ValueError, match="val_size"):
        load_dataset("mnist", data_dir=str(tmp_path), val_size=40)


def test_data_dir_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mnist_folder(tmp_path, compress=True)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    bundle = load_dataset("mnist", val_size=0)
    assert len(bundle.train) == 40 and len(bundle.test) == 12


# --- torchvision code paths with fakes of the real attribute layouts ----------------


class FakeCIFAR100(FakeCIFAR):
    num_classes = 100


class FakeSVHN:
    """SVHN layout: ``.data`` uint8 [N, 3, 32, 32], ``.labels`` int64 ndarray."""

    def __init__(self, root: str, split: str = "train", download: bool = False) -> None:
        assert split in ("train", "test") and download
        rng = np.random.default_rng(0 if split == "train" else 1)
        count = 50 if split == "train" else 20
        self.data = channel_images(rng, count, 3)
        self.labels = (np.arange(count) % 10).astype(np.int64)


class FakeMNIST:
    """MNIST/FashionMNIST layout: ``.data`` uint8 tensor [N, 28, 28], ``.targets`` tensor."""

    def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
        generator = torch.Generator().manual_seed(0 if train else 1)
        count = 40 if train else 10
        self.data = torch.randint(0, 256, (count, 28, 28), dtype=torch.uint8, generator=generator)
        self.targets = torch.arange(count) % 10


def _check_normalised(bundle: DatasetBundle, channels: int) -> None:
    """Train+val is exactly standardised per channel; train alone approximately."""
    pool = torch.cat([bundle.train.x, bundle.val.x]).double()
    per_channel = pool.transpose(0, 1).reshape(channels, -1)
    np.testing.assert_allclose(per_channel.mean(1).numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(per_channel.std(1, correction=0).numpy(), 1.0, atol=1e-5)
    train = bundle.train.x.double().transpose(0, 1).reshape(channels, -1)
    np.testing.assert_allclose(train.mean(1).numpy(), 0.0, atol=0.05)
    np.testing.assert_allclose(train.std(1).numpy(), 1.0, atol=0.05)


@pytest.mark.parametrize(
    ("name", "attribute", "fake", "num_classes"),
    [("cifar10", "CIFAR10", FakeCIFAR, 10), ("cifar100", "CIFAR100", FakeCIFAR100, 100)],
)
def test_cifar_layout(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    attribute: str,
    fake: type[FakeCIFAR],
    num_classes: int,
) -> None:
    monkeypatch.setattr(torchvision.datasets, attribute, fake)
    monkeypatch.setattr(fake, "calls", [])
    bundle = load_dataset(name, data_dir=str(tmp_path), val_size=4, seed=2)
    assert fake.calls == [
        {"root": str(tmp_path), "train": True, "download": True},
        {"root": str(tmp_path), "train": False, "download": True},
    ]
    assert bundle.num_classes == num_classes and bundle.input_shape == (3, 32, 32)
    assert bundle.train.x.shape == (3 * num_classes - 4, 3, 32, 32)
    assert bundle.test.x.shape == (num_classes, 3, 32, 32)
    assert np.intersect1d(bundle.val_indices, bundle.train_indices).size == 0
    assert len(bundle.val_indices) + len(bundle.train_indices) == 3 * num_classes
    _check_normalised(bundle, channels=3)

    raw = fake(str(tmp_path), train=True)
    hwc = raw.data.astype(np.float64) / 255.0
    assert bundle.mean == pytest.approx(tuple(hwc.mean(axis=(0, 1, 2))), abs=1e-9)
    assert bundle.std == pytest.approx(tuple(hwc.std(axis=(0, 1, 2))), abs=1e-9)
    # HWC -> CHW must be a transpose, not a reshape: compare one image pixel by pixel.
    row = int(bundle.val_indices[0])
    expected = (hwc[row] - np.array(bundle.mean)) / np.array(bundle.std)
    np.testing.assert_allclose(bundle.val.x[0].numpy(), expected.transpose(2, 0, 1), atol=1e-5)
    assert bundle.val.y[0].item() == raw.targets[row]


def test_svhn_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchvision.datasets, "SVHN", FakeSVHN)
    bundle = load_dataset("svhn", data_dir=str(tmp_path), val_size=5)
    assert bundle.num_classes == 10 and bundle.input_shape == (3, 32, 32)
    assert bundle.train.x.shape == (45, 3, 32, 32) and bundle.test.x.shape == (20, 3, 32, 32)
    assert bundle.train.y.dtype == torch.int64
    assert np.intersect1d(bundle.val_indices, bundle.train_indices).size == 0
    _check_normalised(bundle, channels=3)
    raw = FakeSVHN(str(tmp_path), split="train", download=True)
    row = int(bundle.train_indices[-1])
    expected = (raw.data[row] / 255.0 - np.array(bundle.mean)[:, None, None]) / np.array(
        bundle.std
    )[:, None, None]
    np.testing.assert_allclose(bundle.train.x[-1].numpy(), expected, atol=1e-5)


def test_mnist_torchvision_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchvision.datasets, "MNIST", FakeMNIST)
    bundle = load_dataset("mnist", data_dir=str(tmp_path / "no-idx-here"), val_size=3)
    assert bundle.input_shape == (1, 28, 28)
    assert bundle.train.x.shape == (37, 1, 28, 28) and bundle.test.x.shape == (10, 1, 28, 28)
    assert np.array_equal(bundle.val.y.numpy(), bundle.val_indices % 10)
    _check_normalised(bundle, channels=1)


# --- offline failure -------------------------------------------------------------------


def _offline(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("Error downloading train_32x32.mat: network is unreachable")


def test_offline_failure_explains_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", _offline)
    with pytest.raises(DatasetNotFoundError) as caught:
        load_dataset("cifar10", data_dir=str(tmp_path / "missing"))
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    assert "`data-dir`" in message and DATA_DIR_ENV in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "torchvision download" in message and "network is unreachable" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_fmnist_offline_without_debian_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loading, "DEBIAN_FMNIST_DIR", tmp_path / "not-installed")
    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", _offline)
    with pytest.raises(DatasetNotFoundError, match="not set") as caught:
        load_dataset("fmnist")
    assert str(tmp_path / "not-installed") in str(caught.value)


def test_digits_are_integer_tokens_with_a_fixed_test_split() -> None:
    """digits: int64 tokens 0..16, unnormalised; the seed moves the validation rows only."""
    from sklearn.datasets import load_digits

    first = load_dataset("digits", val_size=200, seed=1)
    second = load_dataset("digits", val_size=100, seed=2)
    assert first.input_shape == (64,) and first.mean == () and first.num_classes == 10
    for split in (first.train, first.val, first.test):
        assert split.x.dtype == torch.int64 and split.x.shape[1] == 64
        assert 0 <= int(split.x.min()) and int(split.x.max()) <= 16
    assert (len(first.train), len(first.val), len(first.test)) == (1200, 200, 397)
    assert torch.equal(first.test.x, second.test.x) and len(second.val) == 100
    # every row of scikit-learn's data is in exactly one split, with its label
    rows = {tuple(r) + (int(t),) for r, t in zip(load_digits().data.astype(int).tolist(),
                                                   load_digits().target, strict=True)}
    ours = [tuple(r) + (int(t),) for s in (first.train, first.val, first.test)
            for r, t in zip(s.x.tolist(), s.y, strict=True)]
    assert len(ours) == 1797 and set(ours) == rows
