"""Image-classification datasets as normalised in-memory tensors.

:func:`load_dataset` returns a :class:`DatasetBundle`: the training pool (minus a
server-side validation holdout), the holdout itself and the test set, all as
float32 ``[N, C, H, W]`` tensors normalised with per-channel statistics of the
*full* training set. Everything fits in memory for the supported datasets, so
clients slice tensors instead of running DataLoader workers.

Where the data comes from, first match wins:

1. ``data_dir`` (the ``data-dir`` run-config key) or the ``FEDFUSION_DATA_DIR``
   environment variable: for ``fmnist``/``mnist`` a folder holding the four IDX
   files (``.gz`` or not); for every dataset also a torchvision root (step 3).
2. ``fmnist`` only: ``/usr/share/datasets/fashion-mnist`` (Debian package
   ``dataset-fashion-mnist``).
3. torchvision's downloader into ``data_dir`` or ``~/.cache/fedfusion/data``.
   torchvision skips the download when the files are already there.

``digits`` is the token data set of a text model's shape: scikit-learn's 8x8 digits (shipped
with scikit-learn, which must be installed) as 64 int64 tokens 0..16 per row, not
normalised (``input_shape = (64,)``, ``mean = std = ()``); its fixed test split is 397 rows
drawn with seed 0, the other 1,400 rows are the training set.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import math
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfusion.constraints import NON_NEGATIVE
from fedfusion.core.evaluation import Labelled

DATASETS = ("fmnist", "mnist", "cifar10", "cifar100", "svhn", "digits")
DATA_DIR_ENV = "FEDFUSION_DATA_DIR"
DEBIAN_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DEFAULT_DOWNLOAD_ROOT = Path("~/.cache/fedfusion/data")

# (images, labels) file stems of the IDX format shared by MNIST and Fashion-MNIST.
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

RawSplit = tuple[np.ndarray, np.ndarray]
"""uint8 images ``[N, C, H, W]`` and int64 labels ``[N]``."""


class DatasetNotFoundError(FileNotFoundError):
    """No source could provide the dataset; the message lists every way to provide it."""


@dataclass(frozen=True)
class ImageData(Labelled):
    """Images and labels of one split (a :class:`fedfusion.core.evaluation.Labelled`).

    ``x`` is float32, normalised, ``[N, C, H, W]`` and contiguous; ``y`` is int64 ``[N]``.
    The tensors are shared by every caller of the (cached) loader: treat them as read-only.
    """


@dataclass(frozen=True)
class DatasetBundle:
    """A dataset split into training pool, server validation holdout and test set.

    ``mean``/``std`` are per channel over the full training set (holdout included),
    on pixels scaled to [0, 1]. ``train_indices`` and ``val_indices`` are sorted,
    disjoint row indices into the original training set whose union is all of it.
    """

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train: ImageData
    val: ImageData
    test: ImageData
    val_indices: np.ndarray
    train_indices: np.ndarray


# --- converters: one per attribute layout of the torchvision dataset classes -----------


def _from_hwc_targets(dataset: Any) -> RawSplit:
    """CIFAR-10/100 layout: ``.data`` uint8 ndarray ``[N, H, W, C]``, ``.targets`` list."""
    images = np.ascontiguousarray(np.asarray(dataset.data, dtype=np.uint8).transpose(0, 3, 1, 2))
    return images, np.asarray(dataset.targets, dtype=np.int64)


def _from_chw_labels(dataset: Any) -> RawSplit:
    """SVHN layout: ``.data`` uint8 ndarray ``[N, C, H, W]``, ``.labels`` ndarray."""
    images = np.ascontiguousarray(np.asarray(dataset.data, dtype=np.uint8))
    return images, np.asarray(dataset.labels, dtype=np.int64)


def _from_gray_tensor_targets(dataset: Any) -> RawSplit:
    """MNIST/FashionMNIST layout: ``.data`` uint8 tensor ``[N, H, W]``, ``.targets`` tensor."""
    images = np.ascontiguousarray(np.asarray(dataset.data, dtype=np.uint8)[:, None, :, :])
    return images, np.asarray(dataset.targets, dtype=np.int64)


@dataclass(frozen=True)
class _Spec:
    """How to obtain one dataset through torchvision."""

    num_classes: int
    torchvision_class: str  # attribute of torchvision.datasets, looked up at call time
    convert: Callable[[Any], RawSplit]
    split_kwargs: Mapping[str, Mapping[str, Any]]  # "train"/"test" -> constructor kwargs
    has_idx_files: bool = False


_TRAIN_FLAG = {"train": {"train": True}, "test": {"train": False}}
_SPECS: dict[str, _Spec] = {
    "fmnist": _Spec(10, "FashionMNIST", _from_gray_tensor_targets, _TRAIN_FLAG, True),
    "mnist": _Spec(10, "MNIST", _from_gray_tensor_targets, _TRAIN_FLAG, True),
    "cifar10": _Spec(10, "CIFAR10", _from_hwc_targets, _TRAIN_FLAG),
    "cifar100": _Spec(100, "CIFAR100", _from_hwc_targets, _TRAIN_FLAG),
    "svhn": _Spec(
        10, "SVHN", _from_chw_labels, {"train": {"split": "train"}, "test": {"split": "test"}}
    ),
}


# --- IDX files ---------------------------------------------------------------------


def _find_idx_file(folder: Path, stem: str) -> Path | None:
    """Return ``folder/stem.gz`` or ``folder/stem``, whichever exists (gz preferred)."""
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """Read an unsigned-byte IDX file (optionally gzip-compressed) into a uint8 array.

    The header is two zero bytes, a type code (0x08 = uint8), the number of
    dimensions and one big-endian int32 per dimension.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = bytearray(handle.read())  # writable, so torch.from_numpy accepts views of it
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    header_end = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    data = np.frombuffer(raw, dtype=np.uint8, offset=header_end)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header announces shape {shape} but holds {data.size} bytes")
    return data.reshape(shape)


def _read_idx_folder(folder: Path) -> dict[str, RawSplit] | None:
    """Read the four (Fashion-)MNIST IDX files from ``folder``; None if any is missing."""
    paths = {
        split: (_find_idx_file(folder, images), _find_idx_file(folder, labels))
        for split, (images, labels) in IDX_FILES.items()
    }
    if any(path is None for pair in paths.values() for path in pair):
        return None
    splits: dict[str, RawSplit] = {}
    for split, (images_path, labels_path) in paths.items():
        assert images_path is not None and labels_path is not None
        images = read_idx(images_path)
        labels = read_idx(labels_path).astype(np.int64)
        if images.ndim != 3 or labels.shape != (images.shape[0],):
            raise ValueError(
                f"{folder}: {split} images {images.shape} do not match labels {labels.shape}"
            )
        splits[split] = (images[:, None, :, :], labels)
    return splits


# --- sources -------------------------------------------------------------------------


def _download_with_torchvision(name: str, root: Path) -> dict[str, RawSplit]:
    """Load (downloading if needed) both splits of ``name`` with torchvision."""
    import torchvision.datasets

    spec = _SPECS[name]
    dataset_class = getattr(torchvision.datasets, spec.torchvision_class)
    return {
        split: spec.convert(dataset_class(root=str(root), download=True, **kwargs))
        for split, kwargs in spec.split_kwargs.items()
    }


def load_raw(name: str, data_dir: Path | None) -> dict[str, RawSplit]:
    """The raw uint8 images and labels of dataset ``name``'s splits (``"train"``,
    ``"test"``), before any holdout or normalisation: every source is tried in order;
    raises DatasetNotFoundError explaining all of them."""
    spec = _SPECS[name]
    if data_dir is None:
        dir_note = f"not set (neither the `data-dir` run-config key nor {DATA_DIR_ENV})"
    elif spec.has_idx_files:
        found = _read_idx_folder(data_dir)
        if found is not None:
            return found
        dir_note = f"{str(data_dir)!r} holds no IDX files; tried as torchvision root below"
    else:
        dir_note = f"{str(data_dir)!r} used as the torchvision root below"

    if name == "fmnist":
        found = _read_idx_folder(DEBIAN_FMNIST_DIR)
        if found is not None:
            return found
        debian_note = f"{DEBIAN_FMNIST_DIR} missing or incomplete"
    else:
        debian_note = f"only for fmnist, not {name!r}"

    root = data_dir if data_dir is not None else DEFAULT_DOWNLOAD_ROOT.expanduser()
    try:
        return _download_with_torchvision(name, root)
    except Exception as err:  # offline failures come in many types (URLError, RuntimeError...)
        raise DatasetNotFoundError(
            f"Dataset {name!r} is not available. Ways to provide it:\n"
            f"  1. set the `data-dir` run-config key or the {DATA_DIR_ENV} env var to a "
            "folder with the IDX files (fmnist/mnist) or a torchvision root: "
            f"{dir_note}\n"
            "  2. fmnist: `apt-get install dataset-fashion-mnist` (installs "
            f"{DEBIAN_FMNIST_DIR}): {debian_note}\n"
            f"  3. torchvision download (needs network) into {str(root)!r} failed: "
            f"{type(err).__name__}: {err}"
        ) from err


# --- normalisation and holdout -------------------------------------------------------


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 ``[N, C, H, W]`` pixels scaled to [0, 1].

    Uses a 256-bin histogram per channel: exact, and no float copy of the data.
    """
    values = np.arange(256, dtype=np.float64) / 255.0
    means: list[float] = []
    stds: list[float] = []
    for channel in range(images.shape[1]):
        counts = np.bincount(images[:, channel].ravel(), minlength=256).astype(np.float64)
        total = counts.sum()
        mean = float(counts @ values / total)
        var = float(counts @ (values - mean) ** 2 / total)
        means.append(mean)
        stds.append(float(np.sqrt(var)))
    return tuple(means), tuple(stds)


def normalise(
    images: np.ndarray, labels: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]
) -> ImageData:
    """``(pixels / 255 - mean_c) / std_c`` as contiguous float32, labels as int64."""
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0)
    x.sub_(torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
    x.div_(torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
    return ImageData(x=x.contiguous(), y=torch.from_numpy(np.asarray(labels, dtype=np.int64)))


def holdout_indices(num_train: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(num_train)`` into sorted (train, val) indices; val has ``val_size`` rows.

    ``np.random.default_rng(seed)`` picks the holdout, so it is identical in every process.
    """
    if not 0 <= val_size < num_train:
        raise ValueError(
            f"val_size must be in [0, {num_train}) for a training set of {num_train} "
            f"images, got {val_size}"
        )
    rng = np.random.default_rng(seed)
    val = np.sort(rng.choice(num_train, size=val_size, replace=False)).astype(np.int64)
    train = np.setdiff1d(np.arange(num_train, dtype=np.int64), val, assume_unique=True)
    return train, val


@functools.lru_cache(maxsize=4)
def load_dataset(
    name: str, data_dir: str | os.PathLike[str] | None = None, val_size: int = 500, seed: int = 0,
    stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
) -> DatasetBundle:
    """Load ``name`` normalised, with ``val_size`` training images held out for the server.

    ``stats`` = ``(mean, std)`` per channel replaces the training set's own statistics (e.g.
    the MNIST constants ``((0.1307,), (0.3081,))`` that many FMNIST codes use).

    Cached per process on the arguments, because Flower's simulation actors build a
    client per call and the dataset must not be re-read each time. The environment
    variable FEDFUSION_DATA_DIR is read when an argument tuple is first loaded; call
    ``load_dataset.cache_clear()`` after changing it. An empty ``data_dir`` counts as unset.

    Datasets read from IDX files (fmnist, mnist) are also cached across processes: the
    first process to load one writes the normalised arrays to ``FEDFUSION_DATA_CACHE``
    (default ``~/.cache/fedfusion/datasets``; ``off`` disables it), keyed by the source files
    (path, size, modification time), ``val_size`` and ``seed``; later processes map them
    copy-on-write instead of decompressing and normalising again. Every process of a
    simulation (the server, each client actor) then shares one copy of the pages: ~0.2 GB of
    private memory less per process for Fashion-MNIST, and ~0.05 s instead of ~1 s.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    NON_NEGATIVE.check("val_size", val_size)
    if name == "digits":
        return _digits_bundle(val_size, seed)
    chosen_dir = data_dir or os.environ.get(DATA_DIR_ENV) or None
    folder = Path(chosen_dir).expanduser() if chosen_dir else None
    if stats is not None:
        stats = (tuple(float(v) for v in stats[0]), tuple(float(v) for v in stats[1]))
        if len(stats[0]) != len(stats[1]) or not all(s > 0 for s in stats[1]) or not all(
                math.isfinite(v) for v in stats[0] + stats[1]):
            raise ValueError(f"stats must be (mean, std) per channel with finite values and "
                             f"std > 0, got {stats}")
    cached = _cache_folder(name, folder, val_size, seed, stats)
    if cached is not None:
        bundle = _read_cache(cached)
        if bundle is not None:
            return bundle
    bundle = _build_bundle(name, folder, val_size, seed, stats)
    if cached is not None and _write_cache(cached, bundle):
        # this process, too, drops its private copy for the shared pages
        return _read_cache(cached) or bundle
    return bundle


def _build_bundle(name: str, folder: Path | None, val_size: int, seed: int,
                  stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None
                  ) -> DatasetBundle:
    raw = load_raw(name, folder)
    spec = _SPECS[name]
    train_images, train_labels = raw["train"]
    test_images, test_labels = raw["test"]
    for split, labels in (("train", train_labels), ("test", test_labels)):
        if labels.size and not 0 <= labels.min() <= labels.max() < spec.num_classes:
            raise ValueError(f"{name} {split} labels fall outside [0, {spec.num_classes})")
    train_indices, val_indices = holdout_indices(len(train_labels), val_size, seed)
    mean, std = stats or channel_stats(train_images)
    if len(mean) != train_images.shape[1]:
        raise ValueError(f"{name} has {train_images.shape[1]} channel(s) but the normalisation "
                         f"statistics have {len(mean)}")
    return DatasetBundle(
        name=name,
        num_classes=spec.num_classes,
        input_shape=(train_images.shape[1], train_images.shape[2], train_images.shape[3]),
        mean=mean,
        std=std,
        train=normalise(train_images[train_indices], train_labels[train_indices], mean, std),
        val=normalise(train_images[val_indices], train_labels[val_indices], mean, std),
        test=normalise(test_images, test_labels, mean, std),
        val_indices=val_indices,
        train_indices=train_indices,
    )


DIGITS_TEST_ROWS = 397


def _digits_bundle(val_size: int, seed: int) -> DatasetBundle:
    """scikit-learn's digits as int64 tokens; the test split is fixed (seed 0) whatever
    ``seed`` picks as the validation holdout."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DatasetNotFoundError("dataset 'digits' needs scikit-learn (pip install "
                                   "scikit-learn), which ships its rows") from exc
    bunch = load_digits()
    x = np.asarray(bunch.data, dtype=np.int64)
    y = np.asarray(bunch.target, dtype=np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    test, train = order[:DIGITS_TEST_ROWS], np.sort(order[DIGITS_TEST_ROWS:])
    x_train, y_train = x[train], y[train]
    train_indices, val_indices = holdout_indices(len(y_train), val_size, seed)

    def split(rows: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> ImageData:
        return ImageData(x=torch.from_numpy(np.ascontiguousarray(xs[rows])),
                         y=torch.from_numpy(np.ascontiguousarray(ys[rows])))

    return DatasetBundle(
        name="digits", num_classes=10, input_shape=(x.shape[1],), mean=(), std=(),
        train=split(train_indices, x_train, y_train), val=split(val_indices, x_train, y_train),
        test=split(np.sort(test), x, y), val_indices=val_indices, train_indices=train_indices)


# --- cross-process cache of normalised IDX datasets ----------------------------------

CACHE_ENV = "FEDFUSION_DATA_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/fedfusion/datasets")
_CACHE_VERSION = 1
_CACHE_ARRAYS = ("train_x", "train_y", "val_x", "val_y", "test_x", "test_y", "val_indices",
                 "train_indices")


def _idx_sources(name: str, folder: Path | None) -> list[Path] | None:
    """The IDX files :func:`load_raw` reads for ``name`` (same order of sources), or None
    when it would go to torchvision."""
    if not _SPECS[name].has_idx_files:
        return None
    candidates = ([folder] if folder is not None else []) + (
        [DEBIAN_FMNIST_DIR] if name == "fmnist" else [])
    for candidate in candidates:
        files = [_find_idx_file(candidate, stem) for pair in IDX_FILES.values() for stem in pair]
        if all(f is not None for f in files):
            return [f for f in files if f is not None]
    return None


def _cache_folder(name: str, folder: Path | None, val_size: int, seed: int,
                  stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None
                  ) -> Path | None:
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    sources = _idx_sources(name, folder)
    if sources is None:
        return None
    try:
        identity = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in sources]
    except OSError:
        return None
    key_fields = [_CACHE_VERSION, name, val_size, seed, identity] + ([stats] if stats else [])
    key = hashlib.sha256(json.dumps(key_fields).encode()).hexdigest()[:24]
    root = Path(setting).expanduser() if setting else DEFAULT_CACHE_DIR.expanduser()
    return root / f"{name}-{key}"


def _read_cache(folder: Path) -> DatasetBundle | None:
    """The cached bundle, its images mapped copy-on-write (writes stay private), or None."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        arrays = {k: np.load(folder / f"{k}.npy", mmap_mode="c" if k.endswith("_x") else None)
                  for k in _CACHE_ARRAYS}
    except (OSError, ValueError):
        return None

    for key in ("train_x", "val_x", "test_x"):
        # a client reads its own rows only: without this, read-ahead and fault-around map
        # (and count in its resident set) nearly the whole file
        handle = getattr(arrays[key], "_mmap", None)
        if handle is not None and hasattr(mmap, "MADV_RANDOM"):
            with contextlib.suppress(OSError, ValueError):
                handle.madvise(mmap.MADV_RANDOM)

    def split(prefix: str) -> ImageData:
        return ImageData(x=torch.from_numpy(arrays[f"{prefix}_x"]),
                         y=torch.from_numpy(np.asarray(arrays[f"{prefix}_y"], dtype=np.int64)))

    return DatasetBundle(
        name=meta["name"], num_classes=meta["num_classes"],
        input_shape=tuple(meta["input_shape"]), mean=tuple(meta["mean"]),
        std=tuple(meta["std"]), train=split("train"), val=split("val"), test=split("test"),
        val_indices=np.asarray(arrays["val_indices"]),
        train_indices=np.asarray(arrays["train_indices"]))


def _write_cache(folder: Path, bundle: DatasetBundle) -> bool:
    """Write ``bundle`` under ``folder`` atomically (a complete folder or none); False if
    that failed (the caller keeps its in-memory bundle)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError:
        return False
    try:
        arrays = {"train_x": bundle.train.x, "train_y": bundle.train.y, "val_x": bundle.val.x,
                  "val_y": bundle.val.y, "test_x": bundle.test.x, "test_y": bundle.test.y,
                  "val_indices": bundle.val_indices, "train_indices": bundle.train_indices}
        for key, value in arrays.items():
            np.save(tmp / f"{key}.npy", np.asarray(value))
        (tmp / "meta.json").write_text(json.dumps({
            "name": bundle.name, "num_classes": bundle.num_classes,
            "input_shape": list(bundle.input_shape), "mean": list(bundle.mean),
            "std": list(bundle.std)}))
        os.rename(tmp, folder)  # fails if another process got there first: keep theirs
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return folder.is_dir()
