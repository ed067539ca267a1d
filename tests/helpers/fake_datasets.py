"""Fake data sets on disk and in torchvision's attribute layouts: MNIST IDX files and a
CIFAR stand-in."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np


def write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    """Write a uint8 IDX file (magic 0x0000 08 ndim, big-endian int32 dims)."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def write_mnist_folder(folder: Path, compress: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    splits = {"train": (40, "train"), "test": (12, "t10k")}
    written = {}
    for split, (count, prefix) in splits.items():
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = np.arange(count, dtype=np.uint8) % 10
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images, compress)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, compress)
        written[split] = (images, labels)
    return written


def channel_images(rng: np.random.Generator, count: int, channels: int) -> np.ndarray:
    """uint8 [N, C, 32, 32] with visibly different per-channel statistics."""
    images = np.empty((count, channels, 32, 32), dtype=np.uint8)
    for c in range(channels):
        images[:, c] = rng.integers(20 * c, 256 - 60 * c, size=(count, 32, 32), dtype=np.uint8)
    return images


class FakeCIFAR:
    """CIFAR10/100 layout: ``.data`` uint8 [N, 32, 32, 3], ``.targets`` list of int."""

    num_classes = 10
    calls: list[dict[str, Any]] = []

    def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
        type(self).calls.append({"root": root, "train": train, "download": download})
        rng = np.random.default_rng(0 if train else 1)
        count = 3 * self.num_classes if train else self.num_classes
        self.data = channel_images(rng, count, 3).transpose(0, 2, 3, 1).copy()
        self.targets = [int(v) for v in rng.permutation(np.arange(count) % self.num_classes)]
