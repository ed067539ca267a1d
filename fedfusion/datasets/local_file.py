"""A device's own training data: an ``.npz`` file with the arrays ``x`` and ``y``.

On a real device the data is the device's, not a partition of a shared dataset: the
SuperNode's node config names a file (``data-path``) and the ClientApp trains on it alone.

Format (``np.savez(path, x=images, y=labels)``, compressed or not):

* ``x``: ``uint8`` pixels as the dataset's own files store them (0..255), ``[N, H, W]`` for
  one channel, ``[N, C, H, W]`` or channels-last ``[N, H, W, C]``; ``H``, ``W`` and ``C``
  must be those of the run's dataset (the server evaluates on its test set);
* ``y``: integer labels ``[N]`` in ``0 .. num_classes - 1``.

The file comes from outside: it is read with ``allow_pickle`` never involved (the ``.npy``
headers are parsed by :mod:`fedfusion.wire.npy`), every zip entry's compression and declared
size and every ``.npy`` header are checked before any array is inflated, and the arrays may
declare at most ``max_bytes`` together (:data:`MAX_LOCAL_DATA_BYTES` by default), so a
hostile or corrupt file costs bounded memory and fails with :class:`LocalDataError` naming
the file and the problem.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedfusion.constraints import FINITE_POSITIVE
from fedfusion.datasets.loading import ImageData
from fedfusion.datasets.loading import normalise as normalise_pixels
from fedfusion.wire.npy import NPZ_READ_ERRORS, ZIP_COMPRESSIONS, npy_layout, read_npy

#: the arrays of a local data file may declare at most this many uncompressed bytes: the
#: pixels become float32 for training, so a device holds about 4x this (Fashion-MNIST's whole
#: training set is 47 MB of uint8 pixels, CIFAR-10's 154 MB); raise it with ``max_bytes``
MAX_LOCAL_DATA_BYTES = 512 << 20
#: a file larger than this on disk is refused unread
MAX_LOCAL_FILE_BYTES = 4 << 30
_PIXEL_DTYPES = (np.uint8,)
_LABEL_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                 np.uint64)


class LocalDataError(ValueError):
    """A local data file is missing, malformed, or does not fit the run's dataset."""


@dataclass(frozen=True)
class LocalData:
    """The validated content of a local data file."""

    x: np.ndarray  # uint8 [N, C, H, W], C-contiguous
    y: np.ndarray  # int64 [N]
    path: Path


def read_local_data(path: str | Path, input_shape: Sequence[int], num_classes: int,
                    max_bytes: int = MAX_LOCAL_DATA_BYTES) -> LocalData:
    """Read and validate the local data file ``path`` for images of ``input_shape``
    ``(C, H, W)`` and labels ``0 .. num_classes - 1``.

    Raises :class:`LocalDataError` naming the file for every defect."""
    path = Path(path).expanduser()
    where = f"local data file {str(path)!r}"
    channels, height, width = (int(v) for v in input_shape)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise LocalDataError(f"{where} cannot be read: {exc.strerror or exc}") from exc
    if not path.is_file():
        raise LocalDataError(f"{where} is not a regular file")
    if size > MAX_LOCAL_FILE_BYTES:
        raise LocalDataError(f"{where} is {size} bytes, over the {MAX_LOCAL_FILE_BYTES} byte "
                             "limit")
    if path.suffix.lower() != ".npz":
        raise LocalDataError(f"{where}: unknown format {path.suffix!r}; write an .npz with "
                             "arrays x and y (np.savez(path, x=images, y=labels))")
    try:
        x, y = _read_xy(path, where, max_bytes)
    except LocalDataError:
        raise
    except (*NPZ_READ_ERRORS, MemoryError) as exc:
        raise LocalDataError(f"{where} is not a readable .npz file: "
                             f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    if x.ndim == 3 and channels == 1 and x.shape[1:] == (height, width):
        x = x[:, None]
    elif x.ndim == 4 and x.shape[1:] == (channels, height, width):
        pass
    elif x.ndim == 4 and x.shape[1:] == (height, width, channels):
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    else:
        expected = [f"[N, {channels}, {height}, {width}]", f"[N, {height}, {width}, {channels}]"]
        if channels == 1:
            expected.insert(0, f"[N, {height}, {width}]")
        raise LocalDataError(f"{where}: x has shape {list(x.shape)}; the run's dataset needs "
                             f"images of {' or '.join(expected)}")
    if len(x) == 0:
        raise LocalDataError(f"{where} holds no samples")
    if y.ndim != 1 or len(y) != len(x):
        raise LocalDataError(f"{where}: y has shape {list(y.shape)}; expected [{len(x)}], one "
                             "label per image of x")
    bad = (y < 0) | (y >= num_classes)  # on the file's dtype: a huge uint64 cannot wrap
    if bad.any():
        raise LocalDataError(f"{where}: label {int(y[np.argmax(bad)])} at row "
                             f"{int(np.argmax(bad))} is outside 0..{num_classes - 1}")
    return LocalData(x, y.astype(np.int64), path)


def write_local_data(path: str | Path, x: np.ndarray, y: np.ndarray, compress: bool = False
                     ) -> Path:
    """Write ``x`` (uint8 images) and ``y`` (integer labels) as a local data file."""
    path = Path(path)
    with open(path, "wb") as handle:  # np.savez would append .npz to another suffix
        (np.savez_compressed if compress else np.savez)(
            handle, x=np.asarray(x, dtype=np.uint8), y=np.asarray(y, dtype=np.int64))
    return path


def _read_xy(path: Path, where: str, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` of the archive: both entries' compression, declared sizes and
    ``.npy`` headers are checked before either is inflated."""
    with open(path, "rb") as handle:
        if not zipfile.is_zipfile(handle):  # e.g. a bare .npy under an .npz name
            raise LocalDataError(f"{where} is not an .npz archive (np.savez writes one)")
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
        missing = [name for name in ("x", "y") if name not in infos]
        if missing:
            found = sorted(infos)[:20]
            raise LocalDataError(f"{where} has no array(s) {', '.join(missing)}; it holds "
                                 f"{found or 'nothing'} (write np.savez(path, x=..., y=...))")
        declared = infos["x"].file_size + infos["y"].file_size
        if declared > max_bytes:
            raise LocalDataError(f"{where}: x and y declare {declared} uncompressed bytes in the "
                                 f"zip headers, over the {max_bytes} byte limit; not inflated")
        dtypes = {"x": _PIXEL_DTYPES, "y": _LABEL_DTYPES}
        for name in ("x", "y"):
            info = infos[name]
            if info.compress_type not in ZIP_COMPRESSIONS:
                raise LocalDataError(f"{where}: array {name!r} uses zip compression "
                                     f"{info.compress_type}; np.savez writes stored or deflated")
            with archive.open(info) as stream:
                npy_layout(stream, info.file_size, name, dtypes=dtypes[name])
        arrays = []
        for name in ("x", "y"):
            with archive.open(infos[name]) as stream:
                arrays.append(read_npy(stream, infos[name].file_size, name,
                                       dtypes=dtypes[name]))
    return arrays[0], arrays[1]


def normalise(data: LocalData, mean: Sequence[float], std: Sequence[float]) -> ImageData:
    """The file's pixels as float32 tensors, ``(pixels / 255 - mean_c) / std_c`` with the
    server's ``mean`` and ``std`` per channel, exactly as the built-in datasets are
    normalised (:mod:`fedfusion.datasets.loading`), so that a device's inputs match the
    server's test set."""
    channels = data.x.shape[1]
    if len(mean) != channels or len(std) != channels:
        raise LocalDataError(f"{data.path}: the server's normalisation has {len(mean)} mean(s) "
                             f"and {len(std)} std(s) for {channels} channel(s)")
    return normalise_pixels(data.x, data.y, tuple(map(float, mean)), tuple(map(float, std)))


def write_demo_files(folder: str | Path, devices: int, samples: int, dataset: str = "fmnist",
                     data_dir: str | None = None, seed: int = 0,
                     alpha: float | None = None, val_size: int = 500) -> list[Path]:
    """Demo data for trying ``client-data='local'``: ``device-<i>.npz`` for each of
    ``devices`` devices, ``samples`` disjoint training images each (raw pixels, as a device
    would hold them), drawn from ``dataset``'s training set with a seeded shuffle, device
    ``i``'s file the same whatever ``devices`` is, and never one of the ``val_size`` rows a
    server run with that ``val-size`` and ``seed`` holds out for validation. ``alpha``: each
    device's own class mix, proportions ~ Dirichlet(alpha) seeded per device (small alpha:
    few classes per device), rows taken from each class's shuffled pool at the device's own
    offset; None: uniform draws (every device about the same mix). On real devices each
    device writes its own file instead."""
    from fedfusion.datasets.loading import holdout_indices, load_raw

    if devices < 1 or samples < 1:
        raise ValueError(f"need devices >= 1 and samples >= 1, got {devices} and {samples}")
    if alpha is not None:
        FINITE_POSITIVE.check("alpha", alpha)
    images, labels = load_raw(dataset, Path(data_dir).expanduser() if data_dir else None)["train"]
    free, _ = holdout_indices(len(labels), val_size, seed)  # not the server's validation rows
    if devices * samples > len(free):
        raise ValueError(f"{devices} devices x {samples} samples exceed the {len(free)} "
                         f"training images of {dataset} outside its {val_size} validation rows")
    order = free[np.random.default_rng([seed, 3]).permutation(len(free))]
    pools = [order[labels[order] == k] for k in range(int(labels.max()) + 1)]
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for device in range(devices):
        if alpha is None:
            rows = order[device * samples:(device + 1) * samples]
        else:
            mix = np.random.default_rng([seed, 5, device]).dirichlet([alpha] * len(pools))
            counts = np.random.default_rng([seed, 6, device]).multinomial(samples, mix)
            # device i takes rows [i * samples, i * samples + count) of each class's pool:
            # disjoint across devices, and the same file whatever `devices` is
            short = [k for k, n in enumerate(counts) if (device + 1) * samples > len(pools[k])
                     and n]
            if short:
                raise ValueError(f"device {device}: classes {short} have too few images for "
                                 f"{samples} samples at its offset; use fewer --samples")
            rows = np.concatenate([pools[k][device * samples:device * samples + n]
                                   for k, n in enumerate(counts)])
        rows = np.sort(rows)
        paths.append(write_local_data(folder / f"device-{device}.npz", images[rows],
                                      labels[rows]))
    return paths

