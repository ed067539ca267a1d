"""Bring-your-own partition: the file reader, its errors, the split it gives on real
Fashion-MNIST, input normalisation constants, and a whole run + replay pinned by the file's hash."""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import InProcessGrid
from helpers.fuzz import FUZZ
from helpers.zip_bytes import needs_zip_version
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfusion.app.config import ConfigError, Settings
from fedfusion.app.federation import federated_split
from fedfusion.datasets import PartitionError, load_dataset
from fedfusion.datasets.partition_file import read_partition_file, write_partition_file
from fedfusion.server_app import run_server

AUTHORS_SPLITS = Path(__file__).resolve().parents[3] / "shared" / "data" / \
    "fedbens-authors-splits.npz"
FMNIST_ROWS = 60_000


@pytest.mark.parametrize("suffix", [".npz", ".json"])
@pytest.mark.parametrize("key", ["", "C3_a0.5"])
def test_round_trip_keeps_rows_order_and_hash(tmp_path, suffix, key):
    clients = [np.array([5, 1, 9]), np.array([0, 7]), np.array([3])]
    val = np.array([1, 1, 4])  # repeats and overlaps client 0: allowed for validation rows
    path = tmp_path / f"p{suffix}"
    digest = write_partition_file(path, clients, val, key=key)
    part = read_partition_file(path, num_rows=10, num_clients=3, key=key)
    assert [c.tolist() for c in part.clients] == [[5, 1, 9], [0, 7], [3]]  # the file's order
    assert part.val.tolist() == [1, 1, 4]
    assert part.val_overlap() == 1  # distinct row 1 is client 0's; row 4 is nobody's
    assert part.sha256 == digest == hashlib.sha256(path.read_bytes()).hexdigest()


def _write_json(path: Path, content: object) -> Path:
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("content, num_clients, message", [
    ({"clients": [[0, 1], [2, 10]]}, 2, "client 1: row 10 is outside the training set's 0..9"),
    ({"clients": [[0, -1], [2]]}, 2, "client 0: row -1 is outside"),
    ({"clients": [[0, 1], [1, 2]]}, 2, "row 1 is held by client 0 and client 1"),
    ({"clients": [[0, 1], []]}, 2, "client 1 holds no rows"),
    ({"clients": [[0, 0], [1]]}, 2, "client 0 lists a row more than once"),
    ({"clients": [[0], [1]]}, 3, "holds 2 client(s) but num-clients is 3"),
    ({"clients": [[0], [1], [2]]}, 2, "holds 3 client(s) but num-clients is 2"),
    ({"clients": [[0.5], [1]]}, 2, "client 0 must be a list of integer rows"),
    ({"clients": [[True], [1]]}, 2, "client 0 must be a list of integer rows"),
    ({"clients": [["3"], [1]]}, 2, "client 0 must be a list of integer rows"),
    ({"clients": [[0], [1]], "val": [12]}, 2, "val: row 12 is outside"),
    ({"clients": [[0], [1]], "val": []}, 2, "'val' is empty"),
    ({"clients": [[0], [1]], "vals": [1]}, 2, "unknown field(s) ['vals']"),
    ({"client": [[0], [1]]}, 2, "must hold an object with a list 'clients'"),
    ([[0], [1]], 2, "must hold an object with a list 'clients'"),
])
def test_json_defects_are_named(tmp_path, content, num_clients, message):
    path = _write_json(tmp_path / "bad.json", content)
    with pytest.raises(PartitionError, match="partition file") as err:
        read_partition_file(path, num_rows=10, num_clients=num_clients)
    assert message in str(err.value)


def test_npz_defects_are_named(tmp_path):
    path = tmp_path / "p.npz"
    np.savez(path, **{"A/client0": np.array([0, 1]), "A/client2": np.array([2])})
    with pytest.raises(PartitionError, match=r"numbered 0..1, found \[0, 2\]"):
        read_partition_file(path, 10, 2, key="A")
    with pytest.raises(PartitionError, match="its groups are A .set partition-key"):
        read_partition_file(path, 10, 2)
    np.savez(path, client0=np.array([0, 1]), client1=np.array([2, 3]), client01=np.array([4]))
    with pytest.raises(PartitionError, match="two arrays for client 1: 'client1' and 'client01'"):
        read_partition_file(path, 10, 2)
    np.savez(path, client0=np.array([[0, 1]]), client1=np.array([2]))
    with pytest.raises(PartitionError, match="client 0 must be a 1-D integer array"):
        read_partition_file(path, 10, 2)
    np.savez(path, client0=np.array([0.0, 1.0]), client1=np.array([2]))
    with pytest.raises(PartitionError, match="client 0 must be a 1-D integer array"):
        read_partition_file(path, 10, 2)
    np.savez(path, client0=np.array([0, 2**40], dtype=np.uint64), client1=np.array([2]))
    with pytest.raises(PartitionError, match="row 1099511627776 is outside"):
        read_partition_file(path, 10, 2)
    np.save(tmp_path / "obj.npy", np.array([0]))
    (tmp_path / "obj.npy").rename(tmp_path / "x.npz")
    with pytest.raises(PartitionError, match="is not an .npz archive"):
        read_partition_file(tmp_path / "x.npz", 10, 1)
    with pytest.raises(PartitionError, match="cannot be read"):
        read_partition_file(tmp_path / "missing.npz", 10, 1)
    os.mkfifo(tmp_path / "fifo.json")  # reading it would wait for a writer forever
    with pytest.raises(PartitionError, match="fifo.json' is a FIFO, not a regular file"):
        read_partition_file(tmp_path / "fifo.json", 10, 1)
    (tmp_path / "zero.npz").symlink_to("/dev/zero")  # would never end
    with pytest.raises(PartitionError, match="zero.npz' is a character device, not a regular"):
        read_partition_file(tmp_path / "zero.npz", 10, 1)
    (tmp_path / "p.csv").write_text("0,1")
    with pytest.raises(PartitionError, match="unknown format '.csv'"):
        read_partition_file(tmp_path / "p.csv", 10, 1)
    # arrays of Python objects would need pickle: refused, not unpickled
    np.savez(path, client0=np.array([0, "x"], dtype=object))
    with pytest.raises(PartitionError, match="not a readable .npz file"):
        read_partition_file(path, 10, 1)
    # a zip version Python's zipfile cannot read raises NotImplementedError there
    np.savez(path, client0=np.array([0]))
    path.write_bytes(needs_zip_version(path.read_bytes(), 64))
    with pytest.raises(PartitionError, match="not a readable .npz file: NotImplementedError"):
        read_partition_file(path, 10, 1)


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".npz", ".json"]))
def test_fuzz_arbitrary_bytes_are_read_or_refused(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("fuzz") / f"p{suffix}"
    path.write_bytes(data)
    try:
        read_partition_file(path, num_rows=50, num_clients=2)
    except PartitionError:
        pass


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 60) | st.floats(allow_nan=False) | st.text(
        max_size=3),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(["clients", "val", "x"]), inner, max_size=3),
    max_leaves=25)


@settings(FUZZ, max_examples=300)
@given(content=_json_values)
def test_fuzz_json_structures_give_a_valid_partition_or_a_partition_error(tmp_path_factory,
                                                                         content):
    path = _write_json(tmp_path_factory.mktemp("fuzz") / "p.json", content)
    try:
        part = read_partition_file(path, num_rows=50, num_clients=2)
    except PartitionError:
        return
    rows = np.concatenate(part.clients)  # accepted: the promised invariants hold
    assert len(part.clients) == 2 and all(len(c) for c in part.clients)
    assert len(np.unique(rows)) == len(rows) and rows.min() >= 0 and rows.max() < 50


@pytest.mark.skipif(not AUTHORS_SPLITS.is_file(), reason="shared/data is not beside the repo")
def test_the_authors_splits_read_as_documented():
    part = read_partition_file(AUTHORS_SPLITS, FMNIST_ROWS, 5, key="C5_a0.05")
    assert [len(c) for c in part.clients] == [15722, 14865, 18007, 3383, 8023]
    assert sum(len(c) for c in part.clients) == FMNIST_ROWS  # every row in one client
    assert len(part.val) == 500 and 496 <= part.val_overlap() <= 500  # drawn from client data
    with pytest.raises(PartitionError, match="holds 5 client.s. but num-clients is 10"):
        read_partition_file(AUTHORS_SPLITS, FMNIST_ROWS, 10, key="C5_a0.05")


# --- the split, on real Fashion-MNIST ---------------------------------------------------


def _small_partition(tmp_path: Path, with_val: bool = True) -> tuple[Path, list, np.ndarray]:
    """3 clients of 300 label-skewed rows each, 40 validation rows (10 shared with client 0)."""
    labels = load_dataset("fmnist", val_size=0).train.y.numpy()
    rng = np.random.default_rng(0)
    clients = [rng.permutation(np.flatnonzero(np.isin(labels, group)))[:300]
               for group in ([0, 1, 2, 3], [4, 5, 6], [7, 8, 9])]
    free = np.setdiff1d(np.arange(FMNIST_ROWS), np.concatenate(clients))
    val = np.concatenate([clients[0][:10], rng.choice(free, 30, replace=False)])
    path = tmp_path / "mine.json"
    write_partition_file(path, clients, val if with_val else None)
    return path, clients, val


def _file_settings(tmp_path: Path, path: Path, **changes) -> Settings:
    values = {"num_clients": 3, "partition_file": str(path), "output_dir": str(tmp_path),
              "local_epochs": 2, "val_size": 50, **changes}
    return Settings(**values)


def test_clients_get_exactly_the_files_rows(tmp_path):
    path, clients, val = _small_partition(tmp_path)
    full = load_dataset("fmnist", val_size=0).train
    split = federated_split(_file_settings(tmp_path, path, val_source="file"))
    for client, rows in enumerate(clients):
        x, y = split.client_data(client)
        assert torch.equal(x, full.x[torch.from_numpy(rows)])
        assert torch.equal(y, full.y[torch.from_numpy(rows)])
    assert torch.equal(split.bundle.val.x, full.x[torch.from_numpy(val)])
    assert split.val_overlap == 10
    assert split.describe()["val_overlap_with_clients"] == 10
    assert split.histogram[0, 4:].sum() == 0 and split.histogram[0].sum() == 300


def test_holdout_validation_is_drawn_from_rows_no_client_holds(tmp_path):
    path, clients, _ = _small_partition(tmp_path)
    split = federated_split(_file_settings(tmp_path, path))  # val-source defaults to holdout
    held = split.bundle.val_indices
    assert len(held) == 50 and len(np.unique(held)) == 50
    assert not np.isin(held, np.concatenate(clients)).any()
    assert split.val_overlap == 0
    again = federated_split(_file_settings(tmp_path, path, local_epochs=3))
    assert np.array_equal(again.bundle.val_indices, held)  # a function of the data seed
    other = federated_split(_file_settings(tmp_path, path, split_seed=5))
    assert not np.array_equal(other.bundle.val_indices, held)


def test_split_errors_name_the_problem(tmp_path):
    path, _, _ = _small_partition(tmp_path, with_val=False)
    with pytest.raises(ConfigError, match="holds no validation rows"):
        federated_split(_file_settings(tmp_path, path, val_source="file"))
    with pytest.raises(ConfigError, match="leaves 59100 training rows to no client, fewer than "
                                          "the val-size=60000"):
        federated_split(_file_settings(tmp_path, path, val_size=60_000))
    with pytest.raises(ConfigError, match="file changed since"):
        federated_split(_file_settings(tmp_path, path, partition_sha256="0" * 64))
    with pytest.raises(ConfigError, match="val-source='file' needs a 'partition-file'"):
        Settings.from_mapping({"val-source": "file"})
    with pytest.raises(ConfigError, match="'train-subset' does not apply"):
        Settings.from_mapping({"partition-file": str(path), "train-subset": 100})
    with pytest.raises(ConfigError, match="val-source"):
        Settings.from_mapping({"val-source": "clients"})
    with pytest.raises(PartitionError, match="holds 3 client.s. but num-clients is 4"):
        federated_split(_file_settings(tmp_path, path).replace(num_clients=4))


def test_input_normalisation_constants(tmp_path):
    own = load_dataset("fmnist", val_size=0)
    path = _small_partition(tmp_path)[0]
    mnist = federated_split(_file_settings(tmp_path, path, input_mean="0.1307",
                                           input_std="0.3081")).bundle
    assert mnist.mean == (0.1307,) and mnist.std == (0.3081,)
    pixels = own.train.x * own.std[0] + own.mean[0]  # back to [0, 1]
    assert torch.allclose(mnist.train.x, (pixels - 0.1307) / 0.3081, atol=1e-5)
    # the cross-process cache keeps the two normalisations apart
    assert not torch.allclose(load_dataset("fmnist", val_size=0).train.x[:5], mnist.train.x[:5])
    assert Settings.from_mapping({"input-mean": 0.1307, "input-std": 0.3081}).input_mean == \
        "0.1307"  # flwr's --run-config types the number as a float
    for mean, std in (("0.1", ""), ("0.1,0.2", "0.3"), ("a", "1"), ("0.1", "0")):
        with pytest.raises(ConfigError, match="input-mean"):
            Settings.from_mapping({"input-mean": mean, "input-std": std})


def test_run_and_replay_are_pinned_to_the_file(tmp_path):
    """A live run records the file's hash in its results and manifest; a client whose copy
    differs is excluded with the reason; a replay after the file changed is refused."""
    path, _, _ = _small_partition(tmp_path)
    other = tmp_path / "other.json"
    other.write_text(path.read_text() + " ")  # the same rows, other bytes: another hash
    settings_ = _file_settings(tmp_path, path, strategy="ensemble", val_source="file",
                               run_name="live", local_epochs=10)
    results = run_server(settings_, InProcessGrid(settings_, node_configs={
        2: {"partition-file": str(other)}}))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert results["partition"]["file_sha256"] == digest
    assert results["settings"]["partition-sha256"] == digest
    (excluded,) = results["excluded"]
    assert "copy differs from the server" in excluded["reason"]
    assert results["num_members"] == [1, 1]  # clients 0 and 1 went on
    # two label-disjoint clients (classes 0-3, 4-6), 300 rows each: measured 22.6%
    assert results["test"]["accuracy"] > 0.15
    manifest = json.loads((tmp_path / "live" / "uploads" / "manifest.json").read_text())
    assert manifest["run_config"]["partition-sha256"] == digest
    replayed = run_server(Settings(strategy="fedavg", output_dir=str(tmp_path),
                                   run_name="replay", replay=str(tmp_path / "live" / "uploads")))
    assert replayed["status"] == "ok" and replayed["partition"]["file_sha256"] == digest
    write_partition_file(path, [[0, 1], [2], [3]], [4])
    with pytest.raises(ConfigError, match="file changed since"):
        run_server(Settings(strategy="ensemble", output_dir=str(tmp_path), run_name="stale",
                            replay=str(tmp_path / "live" / "uploads")))


@settings(FUZZ, max_examples=150)
@given(shape=st.lists(st.integers(0, 2**62), max_size=3).map(tuple),
       descr=st.sampled_from(["<i8", ">i4", "|u1", "<f8", "|O", "<U2", "|b1", "V4"]),
       data=st.binary(max_size=64), claimed=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
       deflate=st.booleans())
def test_fuzz_npz_headers_give_a_valid_partition_or_a_partition_error(
        tmp_path_factory, shape, descr, data, claimed, deflate):
    """Any .npy header (shape up to 2**62 per axis, any dtype) over any bytes, and any
    uncompressed size claimed in the zip's central directory: refused before inflating."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": descr, "fortran_order": False, "shape": shape})
    path = tmp_path_factory.mktemp("fuzz") / "p.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
                         ) as archive:
        archive.writestr("client0.npy", header.getvalue() + data)
        buffer = io.BytesIO()
        np.save(buffer, np.array([40, 41]))
        archive.writestr("client1.npy", buffer.getvalue())
    if claimed is not None:
        raw = bytearray(path.read_bytes())
        at = raw.find(b"PK\x01\x02")
        raw[at + 24:at + 28] = claimed.to_bytes(4, "little")
        path.write_bytes(bytes(raw))
    try:
        part = read_partition_file(path, num_rows=50, num_clients=2)
    except PartitionError:
        return
    assert part.clients[1].tolist() == [40, 41] and part.clients[0].size
