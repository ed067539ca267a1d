"""The cross-process cache of normalised IDX datasets (fedfusion.datasets.loading)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.fake_datasets import write_mnist_folder

from fedfusion.datasets import load_dataset, loading


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    cache = tmp_path / "cache"
    monkeypatch.setenv(loading.CACHE_ENV, str(cache))
    load_dataset.cache_clear()
    yield cache
    load_dataset.cache_clear()


def _bundles_equal(a: loading.DatasetBundle, b: loading.DatasetBundle) -> bool:
    return (a.name, a.num_classes, a.input_shape, a.mean, a.std) == (
        b.name, b.num_classes, b.input_shape, b.mean, b.std) and all(
        torch.equal(getattr(a, s).x, getattr(b, s).x) and torch.equal(getattr(a, s).y,
                                                                      getattr(b, s).y)
        for s in ("train", "val", "test")) and np.array_equal(
        a.val_indices, b.val_indices) and np.array_equal(a.train_indices, b.train_indices)


def test_a_second_load_maps_the_cache_and_equals_a_fresh_load(
        tmp_path: Path, _private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_folder(data, compress=True)
    first = load_dataset("mnist", data_dir=str(data), val_size=5, seed=3)
    entries = list(_private_cache.iterdir())
    assert len(entries) == 1 and (entries[0] / "train_x.npy").is_file()
    load_dataset.cache_clear()

    def no_raw_reads(*_args: object) -> None:
        raise AssertionError("the cached dataset was read from its IDX files again")

    monkeypatch.setattr(loading, "load_raw", no_raw_reads)
    second = load_dataset("mnist", data_dir=str(data), val_size=5, seed=3)
    monkeypatch.undo()
    monkeypatch.setenv(loading.CACHE_ENV, "off")
    load_dataset.cache_clear()
    fresh = load_dataset("mnist", data_dir=str(data), val_size=5, seed=3)
    assert _bundles_equal(first, fresh) and _bundles_equal(second, fresh)
    assert second.train.x.is_contiguous() and second.train.x.dtype == torch.float32


def test_the_key_follows_the_holdout_and_the_source_files(
        tmp_path: Path, _private_cache: Path) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_folder(data, compress=False)
    load_dataset("mnist", data_dir=str(data), val_size=5, seed=3)
    load_dataset("mnist", data_dir=str(data), val_size=6, seed=3)
    load_dataset("mnist", data_dir=str(data), val_size=5, seed=4)
    assert len(list(_private_cache.iterdir())) == 3
    # new source contents (another size or time): another entry, not the stale arrays
    labels = data / "train-labels-idx1-ubyte"
    raw = bytearray(labels.read_bytes())
    raw[-1] = (raw[-1] + 1) % 10
    labels.write_bytes(bytes(raw))
    load_dataset.cache_clear()
    bundle = load_dataset("mnist", data_dir=str(data), val_size=5, seed=3)
    assert len(list(_private_cache.iterdir())) == 4
    last_row = int(np.flatnonzero(bundle.train_indices == 39)[0])
    assert int(bundle.train.y[last_row]) == raw[-1]


def test_writes_to_a_loaded_tensor_stay_in_the_process(tmp_path: Path) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_folder(data, compress=True)
    load_dataset("mnist", data_dir=str(data), val_size=5)
    load_dataset.cache_clear()
    mapped = load_dataset("mnist", data_dir=str(data), val_size=5)
    before = mapped.test.x.clone()
    mapped.test.x.add_(1.0)  # copy-on-write: no crash, and the file keeps its values
    load_dataset.cache_clear()
    assert torch.equal(load_dataset("mnist", data_dir=str(data), val_size=5).test.x, before)


def test_processes_building_the_cache_at_once_all_get_it(tmp_path: Path) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_folder(data, compress=True)
    script = ("import sys, torch\n"
              "from fedfusion.datasets import load_dataset\n"
              f"b = load_dataset('mnist', data_dir={str(data)!r}, val_size=5)\n"
              "print(float(b.train.x.double().sum()))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
             for _ in range(3)]
    sums = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(sums) == 1
    cache = Path(loading.os.environ[loading.CACHE_ENV])
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] != []
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no leftovers
