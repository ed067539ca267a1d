"""Tests for fedfusion.datasets.partition."""

from __future__ import annotations

import gzip
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedfusion.datasets import PARTITIONERS, PartitionError, class_histogram, partition_indices

FMNIST_LABELS = Path("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz")
HAS_FLWR_DATASETS = importlib.util.find_spec("flwr_datasets") is not None
FRACTIONS = (0.5, 0.2, 0.2, 0.1)


def _options(scheme: str) -> dict[str, Any]:
    """Per-scheme keyword arguments for a 4-client split."""
    return {"fractions": FRACTIONS} if scheme == "fractions" else {}


def _skip_without_flwr(scheme: str) -> None:
    if scheme == "flwr-dirichlet" and not HAS_FLWR_DATASETS:
        pytest.skip("flwr-datasets is not installed")


@pytest.fixture(scope="module")
def small_labels() -> np.ndarray:
    return np.random.default_rng(123).integers(0, 10, size=2000)


@pytest.fixture(scope="module")
def fmnist_labels() -> np.ndarray:
    if not FMNIST_LABELS.is_file():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    with gzip.open(FMNIST_LABELS, "rb") as handle:
        return np.frombuffer(handle.read(), dtype=np.uint8, offset=8).astype(np.int64)


def _skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean over clients of the total-variation distance to the global label distribution."""
    histogram = class_histogram(labels, parts, 10).astype(np.float64)
    global_dist = np.bincount(labels, minlength=10) / len(labels)
    client_dist = histogram / histogram.sum(axis=1, keepdims=True)
    return float(np.mean(0.5 * np.abs(client_dist - global_dist).sum(axis=1)))


@pytest.mark.parametrize("scheme", PARTITIONERS)
def test_parts_are_disjoint_sorted_and_cover_the_pool(
    small_labels: np.ndarray, scheme: str
) -> None:
    _skip_without_flwr(scheme)
    parts = partition_indices(small_labels, scheme, 4, seed=0, **_options(scheme))
    assert len(parts) == 4
    for part in parts:
        assert part.dtype == np.int64 and len(part) > 0
        assert np.all(np.diff(part) > 0)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # disjoint
    if scheme == "hetero-label":  # classes nobody chose stay unused
        held = np.unique(small_labels[joined])
        assert np.array_equal(np.sort(joined), np.flatnonzero(np.isin(small_labels, held)))
    else:
        assert sum(len(part) for part in parts) == len(small_labels)
        assert np.array_equal(np.sort(joined), np.arange(len(small_labels)))


@pytest.mark.parametrize("scheme", PARTITIONERS)
def test_seed_determines_the_split(small_labels: np.ndarray, scheme: str) -> None:
    _skip_without_flwr(scheme)
    first = partition_indices(small_labels, scheme, 4, seed=5, **_options(scheme))
    again = partition_indices(small_labels, scheme, 4, seed=5, **_options(scheme))
    other = partition_indices(small_labels, scheme, 4, seed=6, **_options(scheme))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_split_is_identical_in_another_process(small_labels: np.ndarray) -> None:
    script = (
        "import numpy as np, sys\n"
        "from fedfusion.datasets import partition_indices\n"
        "labels = np.random.default_rng(123).integers(0, 10, size=2000)\n"
        "for scheme in ('dirichlet', 'hetero-label'):\n"
        "    parts = partition_indices(labels, scheme, 4, seed=9)\n"
        "    sys.stdout.write(repr([p.tolist() for p in parts]) + '\\n')\n"
    )
    root = Path(__file__).resolve().parents[2]
    output = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env={**os.environ, "PYTHONHASHSEED": "321"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for scheme, line in zip(("dirichlet", "hetero-label"), output, strict=True):
        parts = partition_indices(small_labels, scheme, 4, seed=9)
        assert line == repr([p.tolist() for p in parts])


@pytest.mark.parametrize("scheme", ["dirichlet", "flwr-dirichlet"])
def test_small_alpha_is_far_more_skewed(fmnist_labels: np.ndarray, scheme: str) -> None:
    _skip_without_flwr(scheme)
    skew = {
        alpha: _skew(fmnist_labels, partition_indices(fmnist_labels, scheme, 5, 0, alpha=alpha))
        for alpha in (0.05, 100.0)
    }
    assert skew[100.0] < 0.1
    assert skew[0.05] > 3 * skew[100.0]


def test_dirichlet_survives_underflowing_alpha(small_labels: np.ndarray) -> None:
    parts = partition_indices(small_labels, "dirichlet", 5, seed=0, alpha=5**-4)
    assert sum(len(part) for part in parts) == len(small_labels)
    assert min(len(part) for part in parts) >= 10
    # alpha -> 0: each client's q is one-hot, so clients hold very few classes.
    assert _skew(small_labels, parts) > 0.5


def test_dirichlet_min_samples_errors(small_labels: np.ndarray) -> None:
    labels = np.arange(1000) % 10
    with pytest.raises(PartitionError, match="min_samples"):
        partition_indices(labels, "dirichlet", 1000, seed=0, min_samples=100)
    # Feasible in total, but a skewed draw practically never gives every client 190 of 2000.
    with pytest.raises(PartitionError, match=r"client \d+ with \d+ samples.*after 4 draws"):
        partition_indices(small_labels, "dirichlet", 10, 0, min_samples=190, max_retries=3)


def test_hetero_label_holds_three_to_six_labels(fmnist_labels: np.ndarray) -> None:
    parts = partition_indices(fmnist_labels, "hetero-label", 20, seed=1)
    histogram = class_histogram(fmnist_labels, parts, 10)
    distinct = (histogram > 0).sum(axis=1)
    assert distinct.min() >= 3 and distinct.max() <= 6
    assert len(set(distinct.tolist())) > 1  # k really is drawn per client
    for k in range(10):  # each class is shared evenly among its holders
        holders = histogram[:, k][histogram[:, k] > 0]
        if holders.size:
            assert holders.max() - holders.min() <= 1
            assert holders.sum() == np.count_nonzero(fmnist_labels == k)


def test_hetero_label_options(small_labels: np.ndarray) -> None:
    parts = partition_indices(small_labels, "hetero-label", 6, 0, labels_per_client=(2, 2))
    assert np.all((class_histogram(small_labels, parts, 10) > 0).sum(axis=1) == 2)
    for bad in ((0, 3), (4, 3), (3, 11)):
        with pytest.raises(PartitionError, match="labels_per_client"):
            partition_indices(small_labels, "hetero-label", 6, 0, labels_per_client=bad)


def test_iid_parts_are_equal(small_labels: np.ndarray) -> None:
    parts = partition_indices(small_labels[:1003], "iid", 4, seed=0)
    sizes = [len(part) for part in parts]
    assert sum(sizes) == 1003 and max(sizes) - min(sizes) <= 1
    with pytest.raises(PartitionError, match="no samples"):
        partition_indices(small_labels[:3], "iid", 4, seed=0)


def test_fraction_sizes_match(small_labels: np.ndarray) -> None:
    labels = small_labels[:1003]
    parts = partition_indices(labels, "fractions", 4, seed=0, fractions=FRACTIONS)
    for part, fraction in zip(parts, FRACTIONS, strict=True):
        assert abs(len(part) - fraction * len(labels)) <= 1
    assert sum(len(part) for part in parts) == len(labels)


@pytest.mark.parametrize(
    ("fractions", "problem"),
    [
        (None, "needs fractions"),
        ((0.5, 0.5), "2 entries but num_clients=4"),
        ((0.5, 0.3, 0.3, -0.1), "positive"),
        ((0.5, 0.5, 0.0, 0.0), "positive"),
        ((0.5, 0.2, 0.2, 0.2), "sum to 1"),
    ],
)
def test_bad_fractions(
    small_labels: np.ndarray, fractions: tuple[float, ...] | None, problem: str
) -> None:
    with pytest.raises(PartitionError, match=problem):
        partition_indices(small_labels, "fractions", 4, seed=0, fractions=fractions)


def test_bad_scheme_and_client_count(small_labels: np.ndarray) -> None:
    with pytest.raises(PartitionError, match="shards") as caught:
        partition_indices(small_labels, "shards", 4, seed=0)
    assert all(scheme in str(caught.value) for scheme in PARTITIONERS)
    with pytest.raises(PartitionError, match="num_clients"):
        partition_indices(small_labels, "iid", 0, seed=0)
    with pytest.raises(PartitionError, match="1-D integer"):
        partition_indices(small_labels.astype(np.float32), "iid", 2, seed=0)


def test_flwr_dirichlet_without_package(
    small_labels: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)
    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", None)
    with pytest.raises(ImportError, match="pip install flwr-datasets"):
        partition_indices(small_labels, "flwr-dirichlet", 4, seed=0)


def test_class_histogram(small_labels: np.ndarray) -> None:
    parts = partition_indices(small_labels, "iid", 3, seed=0)
    histogram = class_histogram(small_labels, parts, 10)
    assert histogram.shape == (3, 10) and histogram.dtype == np.int64
    assert histogram.sum(axis=1).tolist() == [len(part) for part in parts]
    assert np.array_equal(histogram.sum(axis=0), np.bincount(small_labels, minlength=10))
    with pytest.raises(ValueError, match="outside"):
        class_histogram(small_labels, parts, 5)
