"""Devices with their own data (``client-data='local'``): each node trains on the ``.npz`` its
node config names (``data-path``), the server holds no partition, devices join and leave.

* the file reader (:mod:`fedfusion.datasets.local_file`): the layouts it accepts, a clear
  error naming the file for each defect, bounded memory (declared sizes capped before
  anything is inflated), and a fuzz: any bytes give LocalData or LocalDataError;
* the federation, in process (the App's own ClientApp on :class:`InProcessGrid`): 3 devices,
  then a 4th joins, then one leaves. Each run fuses exactly the devices present; each
  device's upload has its own file's sample count and class histogram; the uploads of the
  devices that stay are bit-identical when another joins or leaves.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import InProcessGrid
from helpers.zip_bytes import needs_zip_version
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedfusion.app.client_data import training_data
from fedfusion.app.config import ConfigError, Settings
from fedfusion.client_app import node_client_id
from fedfusion.datasets import LocalDataError, read_local_data, write_local_data
from fedfusion.datasets.loading import load_raw

SHAPE = (1, 28, 28)


def _images(n: int, shape: tuple[int, ...] = (28, 28), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


# ------------------------------------------------------------------------------ the reader


@pytest.mark.parametrize("layout", [(28, 28), (1, 28, 28), (28, 28, 1)])
def test_the_reader_accepts_the_documented_layouts(tmp_path, layout):
    x = _images(5, layout)
    path = write_local_data(tmp_path / "d.npz", x, [0, 1, 2, 9, 9], compress=True)
    data = read_local_data(path, SHAPE, 10)
    assert data.x.shape == (5, 1, 28, 28) and data.x.dtype == np.uint8
    assert np.array_equal(data.x.reshape(5, -1), x.reshape(5, -1))
    assert data.y.tolist() == [0, 1, 2, 9, 9] and data.y.dtype == np.int64


def test_channels_last_images_are_transposed(tmp_path):
    x = _images(2, (32, 32, 3))
    data = read_local_data(write_local_data(tmp_path / "c.npz", x, [0, 1]), (3, 32, 32), 10)
    assert np.array_equal(data.x, x.transpose(0, 3, 1, 2))


def _npz(path: Path, **arrays: object) -> Path:
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)
    return path


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p, "cannot be read"),
    (lambda p: (p.write_bytes(b"hello"), p)[1], "is not an .npz archive"),
    (lambda p: _npz(p, x=_images(3)), r"has no array\(s\) y"),
    (lambda p: _npz(p, x=_images(3).astype(np.float32), y=np.zeros(3, int)), "has dtype float32"),
    (lambda p: _npz(p, x=_images(3, (27, 28)), y=np.zeros(3, int)), r"x has shape \[3, 27, 28\]"),
    (lambda p: _npz(p, x=_images(3), y=np.zeros(2, int)), "y has shape"),
    (lambda p: _npz(p, x=_images(3), y=np.array([0, 10, 1])), "label 10 at row 1 is outside"),
    (lambda p: _npz(p, x=_images(2), y=np.array([0, -1])), "label -1 at row 1"),
    (lambda p: _npz(p, x=_images(0), y=np.zeros(0, int)), "holds no samples"),
    (lambda p: _npz(p, x=_images(2), y=np.array([{"a": 1}, 2], dtype=object)), "has dtype object"),
])
def test_a_bad_file_is_refused_naming_it(tmp_path, make, message):
    path = tmp_path / "device.npz"
    make(path)
    with pytest.raises(LocalDataError, match=message) as info:
        read_local_data(path, SHAPE, 10)
    assert str(path) in str(info.value)


def test_other_formats_are_refused_by_suffix(tmp_path):
    path = tmp_path / "device.csv"
    path.write_text("1,2,3")
    with pytest.raises(LocalDataError, match=r"unknown format '.csv'.*np.savez"):
        read_local_data(path, SHAPE, 10)


def test_declared_sizes_are_capped_before_anything_is_inflated(tmp_path):
    """A zip bomb: 200 MB of zeros compress to ~200 KB; refused from the zip headers."""
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": "|u1", "fortran_order": False, "shape": (255_000, 28, 28)})
        with archive.open("x.npy", "w", force_zip64=True) as member:
            member.write(header.getvalue())
            for _ in range(200):
                member.write(bytes(1_000_000))
        archive.writestr("y.npy", b"")
    with pytest.raises(LocalDataError, match="over the 1000000 byte limit; not inflated"):
        read_local_data(path, SHAPE, 10, max_bytes=1_000_000)


def test_a_truncated_array_is_refused(tmp_path):
    path = tmp_path / "cut.npz"
    good = io.BytesIO()
    np.save(good, _images(4))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", good.getvalue()[:-100])
        labels = io.BytesIO()
        np.save(labels, np.zeros(4, np.int64))
        archive.writestr("y.npy", labels.getvalue())
    with pytest.raises(LocalDataError, match="x.*data bytes"):
        read_local_data(path, SHAPE, 10)


_VALID = io.BytesIO()
np.savez(_VALID, x=_images(3), y=np.array([1, 2, 3]))


def test_a_zip_version_python_cannot_read_is_refused_naming_the_file(tmp_path):
    """zipfile raises NotImplementedError, not BadZipFile, for it (found by the fuzz test)."""
    path = tmp_path / "v64.npz"
    path.write_bytes(needs_zip_version(_VALID.getvalue(), 64))
    with pytest.raises(LocalDataError, match="not a readable .npz file: "
                       "NotImplementedError: zip file version 6.4") as info:
        read_local_data(path, SHAPE, 10)
    assert str(path) in str(info.value)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=2000),
    st.tuples(st.integers(0, len(_VALID.getvalue()) - 1), st.binary(min_size=1, max_size=8)
              ).map(lambda cut: _VALID.getvalue()[:cut[0]] + cut[1]
                    + _VALID.getvalue()[cut[0] + len(cut[1]):]),
))
def test_fuzz_any_bytes_give_data_or_a_clear_error(tmp_path, blob):
    path = tmp_path / "fuzz.npz"
    path.write_bytes(blob)
    try:
        data = read_local_data(path, SHAPE, 10)
    except LocalDataError as exc:
        assert str(path) in str(exc)
    else:
        assert data.x.shape[1:] == SHAPE and len(data.y) == len(data.x)
        assert data.y.min() >= 0 and data.y.max() < 10


# ------------------------------------------------------------------------------ the node


def test_a_node_needs_a_valid_client_id_and_a_data_path():
    local = Settings(client_data="local")
    assert node_client_id(local, {"client-id": 7, "partition-id": 0}) == 7
    assert node_client_id(local, {"partition-id": 2}) == 2
    assert node_client_id(Settings(), {"client-id": 7, "partition-id": 1}) == 1
    for bad in (-1, True, "x", 2**40):
        with pytest.raises(ConfigError, match=r"client-id=.* must be an integer"):
            node_client_id(local, {"client-id": bad})
    with pytest.raises(ConfigError, match="no 'client-id' or 'partition-id'"):
        node_client_id(local, {})
    with pytest.raises(ConfigError, match="client 3: .*this node has no data-path"):
        training_data(local, 3, {})
    with pytest.raises(ConfigError, match="must run fedfusion with client-data='local'"):
        training_data(local.replace(data_path="/nonexistent.npz"), 3, {})
    with pytest.raises(ConfigError, match="excludes 'partition-file'"):
        Settings.from_mapping({"client-data": "local", "partition-file": "p.npz"})
    with pytest.raises(ConfigError, match="client-data"):
        Settings.from_mapping({"client-data": "mine"})


# ------------------------------------------------------------------------------ join, leave


@pytest.fixture(scope="module")
def device_files(tmp_path_factory) -> dict[int, Path]:
    """Five devices' own files: disjoint, label-skewed slices of real Fashion-MNIST pixels
    (as a device would hold them), of different sizes."""
    folder = tmp_path_factory.mktemp("devices")
    images, labels = load_raw("fmnist", None)["train"]
    rng = np.random.default_rng(7)
    files = {}
    start = 0
    for device, (size, favourite) in enumerate([(900, 0), (1100, 3), (800, 5), (1000, 7),
                                               (700, 9)]):
        # half from the device's favourite class, half from anywhere: its own histogram
        rows = np.concatenate([np.flatnonzero(labels == favourite)[start:start + size // 2],
                               rng.choice(len(labels), size - size // 2, replace=False)])
        start += size
        files[device] = write_local_data(folder / f"device-{device}.npz", images[rows],
                                         labels[rows], compress=device % 2 == 1)
    return files


def _fleet_run(devices: list[int], files: dict[int, Path], out: Path, name: str,
               **settings_: object) -> dict:
    """One run of the App over the devices present, each with its own client-id and file."""
    from fedfusion.server_app import run_server

    settings = Settings(**{"strategy": "fedavg", "client_data": "local",
                           "num_clients": len(devices), "local_epochs": 5, "val_size": 200,
                           "output_dir": str(out), "run_name": name, "node_wait_timeout": 30,
                           **settings_})
    grid = InProcessGrid(settings, node_configs={
        index: {"client-id": device, "data-path": str(files[device])}
        for index, device in enumerate(devices)})
    return run_server(settings, grid)


def _uploads(out: Path, name: str) -> dict[int, dict[str, np.ndarray]]:
    uploads = {}
    for file in (out / name / "uploads").glob("client_*.npz"):
        with np.load(file, allow_pickle=False) as npz:
            uploads[int(file.stem.split("_")[1])] = {k: npz[k] for k in npz.files}
    return uploads


def test_devices_join_and_leave_with_their_own_data(device_files, tmp_path):
    own = {}
    for device, path in device_files.items():
        with np.load(path) as npz:
            own[device] = (len(npz["y"]), np.bincount(npz["y"], minlength=10).tolist())
    runs = {"three": [0, 1, 2], "four-joins": [0, 1, 2, 4], "one-leaves": [0, 2, 4]}
    results, uploads = {}, {}
    for name, devices in runs.items():
        results[name] = result = _fleet_run(devices, device_files, tmp_path, name)
        assert result["status"] == "ok" and not result["excluded"], result.get("error")
        # the devices present were fused, each with its own file's data
        table = {c["client_id"]: c for c in result["clients"]}
        assert sorted(table) == devices
        for device in devices:
            assert (table[device]["num_examples"], table[device]["class_histogram"]) == \
                own[device], (name, device)
        # the server holds no partition: what it reports is what the devices reported
        assert result["partition"]["client_data"] == "local"
        assert (result["partitioner"], result["alpha"]) == ("local", None)  # no split ran
        assert result["partition"]["clients"] == devices
        assert result["partition"]["sizes"] == [own[d][0] for d in devices]
        # above chance (0.1): FedAvg of label-skewed devices, 5 epochs on ~1,000 images each
        assert result["test"]["accuracy"] > 0.2
        uploads[name] = _uploads(tmp_path, name)
        assert sorted(uploads[name]) == devices
    # the devices that stayed uploaded exactly the same when one joined, and when one left
    for before, after in (("three", "four-joins"), ("four-joins", "one-leaves")):
        for device in set(runs[before]) & set(runs[after]):
            a, b = uploads[before][device], uploads[after][device]
            assert a.keys() == b.keys()
            assert all(np.array_equal(a[k], b[k]) for k in a), (before, after, device)
    # and the fused model changed with the fleet
    assert results["three"]["test"] != results["four-joins"]["test"]


def test_fens_trains_its_aggregator_on_the_devices_own_rows(device_files, tmp_path):
    """The aggregator rounds carry the data description too: every device answers each one
    (it used to refuse them all, and FENS kept its untrained aggregator)."""
    result = _fleet_run([0, 1, 2], device_files, tmp_path, "fens", strategy="fens",
                        local_epochs=1, fens_rounds=2, fens_patience=0)
    assert result["status"] == "ok" and result["excluded"] == [], result["excluded"]
    trace = result["strategy_report"]["trace"]
    assert [(t["round"], t["clients"]) for t in trace[1:]] == [(1, 3), (2, 3)]


def test_a_device_with_a_bad_file_is_excluded_naming_its_file(device_files, tmp_path):
    bad = tmp_path / "broken.npz"
    bad.write_bytes(b"not a zip")
    files = {0: device_files[0], 1: bad}
    result = _fleet_run([0, 1], files, tmp_path, "bad")
    assert result["status"] == "ok"
    assert [c["client_id"] for c in result["clients"]] == [0]
    (excluded,) = result["excluded"]
    assert str(bad) in excluded["reason"] and "not an .npz archive" in excluded["reason"]



def test_the_cli_checks_files_and_writes_demo_files(tmp_path, capsys):
    from fedfusion.datasets.__main__ import main

    assert main(["demo", str(tmp_path / "two"), "--devices", "2", "--samples", "40"]) == 0
    assert main(["demo", str(tmp_path / "three"), "--devices", "3", "--samples", "40"]) == 0
    # device i's demo file does not depend on how many devices there are; files are disjoint
    two = [read_local_data(tmp_path / "two" / f"device-{i}.npz", SHAPE, 10) for i in range(2)]
    three = [read_local_data(tmp_path / "three" / f"device-{i}.npz", SHAPE, 10)
             for i in range(3)]
    for a, b in zip(two, three, strict=False):
        assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(three[0].x, three[1].x)
    capsys.readouterr()
    assert main(["check", str(tmp_path / "three" / "device-2.npz")]) == 0
    assert "device-2.npz: 40 images [1, 28, 28], classes [" in capsys.readouterr().out
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 not really")
    assert main(["check", str(bad)]) == 1
    assert f"error: local data file '{bad}'" in capsys.readouterr().err


def test_demo_files_with_a_class_mix_per_device(tmp_path):
    """--alpha: each device its own Dirichlet class mix; disjoint rows; device i's file the
    same whatever the device count; a bad alpha refused."""
    from fedfusion.datasets.__main__ import main
    from fedfusion.datasets.loading import load_raw

    assert main(["demo", str(tmp_path / "a"), "--devices", "3", "--samples", "300",
                 "--alpha", "0.1"]) == 0
    assert main(["demo", str(tmp_path / "b"), "--devices", "2", "--samples", "300",
                 "--alpha", "0.1"]) == 0
    files = [read_local_data(tmp_path / "a" / f"device-{i}.npz", SHAPE, 10) for i in range(3)]
    for i in range(2):
        again = read_local_data(tmp_path / "b" / f"device-{i}.npz", SHAPE, 10)
        assert np.array_equal(files[i].x, again.x) and np.array_equal(files[i].y, again.y)
    shares = np.stack([np.bincount(f.y, minlength=10) / 300 for f in files])
    assert all(len(f.y) == 300 for f in files)
    # alpha 0.1: a device's largest class holds most of its rows, and the mixes differ
    assert (shares.max(axis=1) > 0.5).all() and len({int(s.argmax()) for s in shares}) > 1
    # the rows are the training set's, disjoint across devices
    images, _ = load_raw("fmnist", None)["train"]
    seen = {image.tobytes() for image in images}
    flat = [row.tobytes() for f in files for row in f.x]
    assert len(set(flat)) == len(flat) and set(flat) <= seen
    assert main(["demo", str(tmp_path / "c"), "--devices", "2", "--samples", "10",
                 "--alpha", "-1"]) == 1


@pytest.mark.parametrize(("val_size", "seed"), [(500, 0), (2000, 3)])
def test_demo_files_leave_out_the_servers_validation_rows(tmp_path, val_size, seed):
    """The deploy guide's demo (4 devices x 1,000 images) held 3-14 of the server's 500
    validation rows per device (rows its model selection and validation screen score on):
    now none, for the run's val-size and seed."""
    from fedfusion.datasets.__main__ import main
    from fedfusion.datasets.loading import holdout_indices, load_raw

    assert main(["demo", str(tmp_path), "--devices", "4", "--samples", "1000",
                 "--val-size", str(val_size), "--seed", str(seed)]) == 0
    images, _ = load_raw("fmnist", None)["train"]
    _, val = holdout_indices(len(images), val_size, seed)
    held = {images[i].tobytes() for i in val}
    for i in range(4):
        rows = read_local_data(tmp_path / f"device-{i}.npz", SHAPE, 10).x
        assert len(rows) == 1000 and not any(row.tobytes() in held for row in rows)
