"""Property-based fuzzing of everything that reads a client's upload (hypothesis).

Attackers do not send one bad field; they send whatever they like. Here hypothesis mutates
valid uploads (meta values, metrics, records, array dtypes, shapes, serialisations and
bytes), builds RecordDicts and ClientUploads from scratch, and mutates cached upload folders
(manifest values at any path, npz bytes, files). The properties:

* :func:`decode_upload` / :func:`validate_upload` raise :class:`UploadError` naming the client,
  or return an upload that passes validation again and builds the model (nothing else);
* :func:`load_uploads` raises :class:`UploadStoreError`, or returns uploads and
  ``(client, reason)`` failures, and every returned upload validates or is refused with an
  :class:`UploadError`.
* :func:`~fedfusion.flower.identity.read_client_registry` (the operator's node id ->
  client id file) returns a registry that keeps its promises or raises ``RegistryError``.

Deterministic (``derandomize``) and modest (the whole file runs in well under a minute on
two cores).
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from helpers.fuzz import FUZZ
from helpers.tiny import TINY
from helpers.uploads import KRON, TINY_CONTEXT, kron_upload, npy_header
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfusion import upload_store
from fedfusion.app.config import Settings
from fedfusion.app.output import output_folder
from fedfusion.core.predictors import Ensemble, save_predictor
from fedfusion.flower.identity import RegistryError, check_client_registry, read_client_registry
from fedfusion.strategies.predictors import load_predictor
from fedfusion.upload_store import UploadStoreError, load_uploads, open_no_follow, save_uploads
from fedfusion.wire import (
    META_KEY,
    METRICS_KEY,
    ClientUpload,
    UploadError,
    decode_upload,
    encode_upload,
    member_key,
    validate_upload,
)

CLIENT = "node 9"
META_FIELDS = ["schema", "schema-version", "client-id", "model", "model-kwargs",
               "num-members", "sections"]
METRIC_FIELDS = ["num-examples", "class-histogram", "train-time-s", "time-s/weights",
                 "contrastive-members"]
RECORD_KEYS = [META_KEY, METRICS_KEY, member_key(0, "weights"),
               member_key(0, "curvature.kron"), member_key(1, "weights"), "arrays"]
PARAMS = ["net.1.weight", "net.3.weight", "net.1.weight/eigvals_out",
          "net.3.weight/eigvecs_in"]


def honest() -> ClientUpload:
    upload = kron_upload(0, weight=0.5, eigenvalue=1.0)
    upload.metrics = {"class-histogram": [5, 3, 2], "train-time-s": 1.0}
    return upload


# ------------------------------------------------------------------ value strategies
ints = st.one_of(st.integers(-3, 70), st.integers(-2**63, 2**63 - 1),
                 st.sampled_from([10**9, 10**12, 2**31]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([1e20, -1e30, 1e-300, 0.5]))
short_text = st.text(max_size=12)
kwargs_text = st.one_of(
    short_text,
    st.sampled_from(['{}', '{"hidden_layers": 1, "hidden": 6}', '{"hidden_layers": 100000}',
                     '{"hidden": 1e400}', '{"hidden": NaN}', '[' * 3000, '{"a": ' * 30,
                     '{"hidden_sizes": [1000000000000]}', '"str"', 'null']))
#: what a ConfigRecord may hold (homogeneous lists)
config_values = st.one_of(
    ints, floats, short_text, st.binary(max_size=16), st.booleans(), kwargs_text,
    st.lists(st.integers(-5, 5), max_size=4), st.lists(short_text, max_size=4),
    st.lists(st.sampled_from(["weights", "curvature.kron", "gram", "curvature.diag", "x"]),
             max_size=5))
#: what a MetricRecord may hold
metric_values = st.one_of(
    ints, floats, st.lists(st.integers(-10, 10**6), max_size=12),
    st.lists(st.floats(allow_nan=True), max_size=4))
dtypes = st.one_of(st.sampled_from(
    ["float32", "<f4", ">f4", "float16", ">f2", "float64", ">f8", "int64", "object", "|O",
     "<U3", "V8", "(2,)f4", "complex64", "bool"]), short_text)
shapes = st.one_of(st.lists(st.integers(-3, 10**13), max_size=5).map(tuple),
                   st.sampled_from([(6, 16), (3, 6), (16, 6), (), (0,), (6, 16, 1)]))


@st.composite
def ndarrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(["<f4", ">f4", "<f2", "<f8", ">f8", "<i8", "|b1"]))
    shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
    values = draw(st.sampled_from([0.0, 1.0, -2.5, np.nan, np.inf, 1e20]))
    return np.full(shape, values).astype(dtype)


@st.composite
def new_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """A mutation of one Array's ``.npy`` bytes."""
    kind = draw(st.sampled_from(["truncate", "flip", "random", "header", "append"]))
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data)))]
    if kind == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "header":
        shape = tuple(draw(st.lists(st.integers(0, 10**12), max_size=3)))
        descr = draw(st.sampled_from(["<f4", ">f4", "<i8", "|O", "<U2", "<f2"]))
        return npy_header(shape, descr) + data[128:]
    return data + draw(st.binary(min_size=1, max_size=64))


def records(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from(["config", "metric", "array", "empty-array"]))
    if kind == "config":
        return ConfigRecord(draw(st.dictionaries(
            st.one_of(st.sampled_from(META_FIELDS), short_text), config_values, max_size=8)))
    if kind == "metric":
        return MetricRecord(draw(st.dictionaries(
            st.one_of(st.sampled_from(METRIC_FIELDS), short_text), metric_values, max_size=5)))
    if kind == "array":
        return ArrayRecord({name: Array(array) for name, array in draw(st.dictionaries(
            st.one_of(st.sampled_from(PARAMS), short_text), ndarrays(), max_size=4)).items()})
    return ArrayRecord()


# ------------------------------------------------------------------ mutations of a live upload
def mutate(draw: st.DrawFn, content: RecordDict) -> None:
    """One hostile edit of ``content``, chosen by hypothesis."""
    kind = draw(st.sampled_from(["meta", "metric", "drop", "record", "array-field",
                                 "array-bytes", "new-array", "values"]))
    keys = sorted(content.keys())
    if kind == "meta" and META_KEY in content and isinstance(content[META_KEY], ConfigRecord):
        meta = dict(content[META_KEY])
        meta[draw(st.one_of(st.sampled_from(META_FIELDS), short_text))] = draw(config_values)
        content[META_KEY] = ConfigRecord(meta)
    elif kind == "metric" and isinstance(content.get(METRICS_KEY), MetricRecord):
        metrics = dict(content[METRICS_KEY])
        metrics[draw(st.one_of(st.sampled_from(METRIC_FIELDS), short_text))] = draw(
            metric_values)
        content[METRICS_KEY] = MetricRecord(metrics)
    elif kind == "drop" and keys:
        del content[draw(st.sampled_from(keys))]
    elif kind == "record":
        content[draw(st.one_of(st.sampled_from(RECORD_KEYS), short_text))] = records(draw)
    else:
        arrays = [k for k in keys if isinstance(content[k], ArrayRecord)]
        if not arrays:
            return
        record = content[draw(st.sampled_from(arrays))]
        names = sorted(record.keys())
        if kind == "new-array" or not names:
            record[draw(st.one_of(st.sampled_from(PARAMS), short_text))] = Array(draw(ndarrays()))
            return
        name = draw(st.sampled_from(names))
        array = record[name]
        if kind == "array-field":
            field = draw(st.sampled_from(["dtype", "shape", "stype"]))
            value = {"dtype": dtypes, "shape": shapes,
                     "stype": st.one_of(st.just("numpy.ndarray"), short_text)}[field]
            setattr(array, field, draw(value))
        elif kind == "array-bytes":
            array.data = draw(new_bytes(array.data))
        else:  # values: not finite, finite but huge, or breaking a curvature's structure
            try:
                values = array.numpy().copy()
                if values.size:
                    values.flat[draw(st.integers(0, values.size - 1))] = draw(
                        st.sampled_from([np.nan, np.inf, 1e20, -1e30, 6e4, -3.0, 0.9]))
            except Exception:  # an earlier edit broke these bytes, or they are not floats
                return
            record[name] = Array(values)


def check_decode(content: RecordDict) -> None:
    try:
        upload = decode_upload(content, CLIENT, TINY_CONTEXT.param_shapes, KRON)
    except UploadError as exc:
        assert exc.client == CLIENT and exc.problem
        return
    # accepted: usable downstream, exactly as validated
    validate_upload(upload, TINY_CONTEXT.param_shapes, KRON)
    for member in upload.members:
        TINY.build(member["weights"])


@FUZZ
@given(st.data())
def test_mutated_uploads_decode_or_raise_upload_error(data):
    content = encode_upload(honest())
    for _ in range(data.draw(st.integers(1, 4))):
        mutate(data.draw, content)
    check_decode(content)


@FUZZ
@given(st.data())
def test_random_record_dicts_decode_or_raise_upload_error(data):
    content = RecordDict()
    for key in data.draw(st.lists(st.one_of(st.sampled_from(RECORD_KEYS), short_text),
                                  max_size=5, unique=True)):
        content[key] = records(data.draw)
    check_decode(content)


python_values = st.one_of(
    st.none(), ints, floats, short_text, st.binary(max_size=8), st.lists(ints, max_size=3),
    st.dictionaries(short_text, ints, max_size=3), st.builds(torch.zeros, st.integers(0, 3)),
    ndarrays())


@FUZZ
@given(st.data())
def test_mutated_client_uploads_validate_or_raise_upload_error(data):
    upload = honest()
    for _ in range(data.draw(st.integers(1, 3))):
        target = data.draw(st.sampled_from(["client_id", "model", "model_kwargs",
                                            "num_examples", "metrics", "members", "member",
                                            "array"]))
        members = upload.members
        member = members[0] if isinstance(members, list) and members else None
        if target == "member" and isinstance(member, dict):
            member[data.draw(short_text)] = data.draw(python_values)
        elif target == "array" and isinstance(member, dict):
            section = member.get("weights")
            if isinstance(section, dict):
                section[data.draw(st.sampled_from(PARAMS))] = data.draw(python_values)
        elif target not in ("member", "array"):
            setattr(upload, target, data.draw(python_values))
    try:
        validate_upload(upload, TINY_CONTEXT.param_shapes, KRON, client=CLIENT)
    except UploadError as exc:
        assert exc.client == CLIENT
        return
    TINY.build(upload.weights(0))


# ------------------------------------------------------------------ cached upload folders
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), short_text,
              st.sampled_from(["../client_0.npz", "/etc/passwd", "client_1.npz", "", 65])),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(short_text, children, max_size=3)),
    max_leaves=6)


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (of keys / indices) into a JSON value."""
    out = [prefix]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
        value, list) else ()
    for key, child in items:
        out += _paths(child, (*prefix, key))
    return out


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` as a new regular file at ``path``: never through a symlink or into a
    directory the fuzzer put there (a symlink may point outside the folder)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.write_bytes(data)


def mutate_folder(draw: st.DrawFn, folder: Path) -> None:
    """One hostile edit of an upload folder. Whatever it creates (symlinks included) stays
    inside the temporary directory holding ``folder``; nothing outside it is written."""
    kind = draw(st.sampled_from(["manifest-value", "manifest-delete", "manifest-text",
                                 "npz-bytes", "npz-entry", "file"]))
    manifest_path = folder / "manifest.json"
    if kind.startswith("manifest") and kind != "manifest-text":
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError:  # an earlier edit broke it already
            return
        if len(_paths(manifest)) < 2:
            return
        path = draw(st.sampled_from(_paths(manifest)[1:]))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if kind == "manifest-value":
            parent[path[-1]] = draw(json_values)
        else:
            del parent[path[-1]]
        _replace(manifest_path, json.dumps(manifest).encode())
    elif kind == "manifest-text":
        text = manifest_path.read_text()
        _replace(manifest_path, draw(st.one_of(
            st.just(text[: draw(st.integers(0, len(text)))]), short_text)).encode())
    elif kind == "npz-bytes":
        npz = folder / draw(st.sampled_from(["client_0.npz", "client_1.npz"]))
        data = npz.read_bytes() if npz.is_file() and not npz.is_symlink() else b""
        _replace(npz, draw(new_bytes(data)))
    elif kind == "npz-entry":
        npz = folder / "client_1.npz"
        if npz.is_symlink() or not npz.is_file():
            return
        name = draw(st.one_of(st.sampled_from(
            ["m0/weights/net.1.weight.npy", "m1/weights/net.1.weight.npy", "m0/weights.npy",
             "m00/weights/x.npy", "m0/weights/net.1.weight", "../m0/x/y.npy"]),
            st.text(min_size=1, max_size=12)))
        buffer = io.BytesIO()
        np.save(buffer, draw(ndarrays()))
        entry = draw(st.one_of(st.just(buffer.getvalue()), new_bytes(buffer.getvalue())))
        try:
            with zipfile.ZipFile(npz, "a") as archive, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Duplicate name": wanted here
                archive.writestr(name, entry)
        except zipfile.BadZipFile:  # an earlier edit broke it already
            return
    else:
        npz = folder / "client_0.npz"
        _replace(npz, b"")
        npz.unlink()
        if draw(st.booleans()):
            npz.mkdir()
        else:  # targets: outside the folder (in the temporary directory), inside, nowhere
            npz.symlink_to(draw(st.sampled_from(["../outside.npz", "client_1.npz", "nowhere"])))


@settings(FUZZ, max_examples=100)
@given(st.data())
def test_mutated_upload_folders_load_or_raise_the_documented_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_uploads(Path(tmp) / "uploads", [honest(), kron_upload(1, 0.5, 2.0, seed=1)],
                              {"alpha": 0.1})
        (Path(tmp) / "outside.npz").write_bytes((folder / "client_1.npz").read_bytes())
        for _ in range(data.draw(st.integers(1, 3))):
            mutate_folder(data.draw, folder)
        cap = data.draw(st.sampled_from([upload_store.MAX_REPLAY_BYTES, 20_000, 0]))
        try:
            run_config, uploads, failures = load_uploads(folder, max_total_bytes=cap)
        except UploadStoreError:
            return
        assert isinstance(run_config, dict)
        assert sum(a.nbytes for u in uploads for m in u.members for arrays in m.values()
                   for a in arrays.values()) <= cap  # the total cap holds
        assert all(isinstance(c, str) and isinstance(r, str) and r for c, r in failures)
        for upload in uploads:
            try:
                validate_upload(upload, TINY_CONTEXT.param_shapes, KRON)
            except UploadError:
                continue
            TINY.build(upload.weights(0))


def test_the_fuzzed_honest_upload_is_valid():
    """The seed of every mutation is accepted: refusals come from the mutations."""
    check_decode(encode_upload(honest()))
    upload = decode_upload(encode_upload(honest()), CLIENT, TINY_CONTEXT.param_shapes, KRON)
    assert upload.num_examples == 10 and upload.sections == ["curvature.kron", "weights"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_uploads(Path(tmp), [honest()], {})
        assert len(load_uploads(folder)[1]) == 1


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


# ------------------------------------------------------------------ predictor files

@st.composite
def strided_views(draw: st.DrawFn, shape: torch.Size) -> torch.Tensor:
    """A tensor of ``shape`` over a storage of any size, with any strides."""
    kind = draw(st.sampled_from(["honest", "expand", "strided", "short"]))
    if kind == "honest":
        return torch.zeros(shape)
    if kind == "expand":
        return torch.zeros(1).expand(shape)
    numel = int(np.prod(shape))
    if kind == "short" and numel > 1:
        return torch.zeros(numel - draw(st.integers(1, numel - 1))).view(-1)[:1].expand(shape)
    strides = tuple(draw(st.lists(st.integers(0, 20), min_size=len(shape),
                                  max_size=len(shape))))
    reach = 1 + sum((s - 1) * t for s, t in zip(shape, strides, strict=True))
    storage = torch.zeros(max(reach, 1) + draw(st.integers(0, 50)))
    return torch.as_strided(storage, shape, strides)


@settings(FUZZ, max_examples=60)
@given(st.data())
def test_predictor_files_with_any_strides_load_or_raise_value_error(data):
    spec = TINY
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in spec.build().state_dict().items()}
    members = data.draw(st.integers(1, 3))
    shared = {k: data.draw(strided_views(s)) for k, s in shapes.items()}
    states = [shared if data.draw(st.booleans()) else
              {k: data.draw(strided_views(s)) for k, s in shapes.items()}
              for _ in range(members)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.pt"
        torch.save({"kind": "ensemble", "specs": [spec.to_dict()] * members,
                    "states": states}, path)
        try:
            predictor = load_predictor(path)
        except ValueError:
            return
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for state in states for t in state.values()}.values())
    built = sum(p.numel() * p.element_size() for p in predictor.state_dict().values())
    assert built <= held  # what loading materialised, the file held
    predictor(torch.zeros(2, *spec.input_shape))


# ------------------------------------------------------------------ output folders

OUTPUT_ENTRIES = ["out/run", "out/run/uploads", "out/run/results.json", "out/run/predictor.pt",
                  "out/run/uploads/manifest.json", "out/run/uploads/client_0.npz"]


@settings(FUZZ, max_examples=60)
@given(st.data())
def test_output_folders_with_links_anywhere_are_written_or_refused(data):
    """Any of a run's outputs pre-existing as a real file, a real folder, a link to a file or
    folder outside, or a dangling link: the run writes its outputs or raises OSError, and
    nothing outside the run folder changes."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        outside = root / "outside"
        outside.mkdir()
        (outside / "f").write_text("keep")
        for entry in OUTPUT_ENTRIES:
            kind = data.draw(st.sampled_from(["absent", "file", "folder", "link to file",
                                              "link to folder", "dangling link"]), label=entry)
            path = root / entry
            if kind == "absent" or not path.parent.is_dir() or path.parent.is_symlink():
                continue
            if kind == "file":
                path.write_text("old")
            elif kind == "folder":
                path.mkdir()
            else:
                path.symlink_to({"link to file": outside / "f", "link to folder": outside,
                                 "dangling link": outside / "new"}[kind])
        try:
            folder = output_folder(Settings(output_dir=str(root / "out"), run_name="run"))
            save_uploads(folder / "uploads", [honest()], {})
            save_predictor(Ensemble([TINY.build()], [TINY]), folder / "predictor.pt")
            with open_no_follow(folder / "results.json") as handle:
                handle.write(b"{}")
        except OSError:
            pass
        else:
            assert load_uploads(folder / "uploads")[1][0].client_id == 0
            assert (folder / "results.json").read_text() == "{}"
        assert sorted(p.name for p in outside.iterdir()) == ["f"]
        assert (outside / "f").read_text() == "keep"


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                           | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=22), inner, max_size=4),
                           max_leaves=12)
NODE_KEYS = st.integers(-3, 2**64 + 3).map(str) | st.text(max_size=22)


@settings(FUZZ, max_examples=200)
@given(st.data())
def test_client_registry_files_load_checked_or_raise_registry_error(data):
    """A client registry file of any bytes, any JSON, or an almost-right
    registry: the reader returns a registry that keeps every promise (uint64 node ids,
    client ids in 0..2**31-1, no client id twice) or raises RegistryError naming the file;
    nothing else."""
    kind = data.draw(st.sampled_from(["bytes", "json", "registry"]))
    if kind == "bytes":
        content = data.draw(st.binary(max_size=64))
    elif kind == "json":
        content = json.dumps(data.draw(JSON_VALUES)).encode()
    else:
        content = json.dumps(data.draw(st.dictionaries(
            NODE_KEYS, st.integers(-2, 2**31 + 2) | JSON_VALUES, max_size=6))).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fleet.json"
        path.write_bytes(content)
        try:
            registry = read_client_registry(path)
        except RegistryError as exc:
            assert str(path) in str(exc)
            return
    assert all(type(n) is int and 0 <= n < 2**64 for n in registry)
    assert all(type(c) is int and 0 <= c < 2**31 for c in registry.values())
    assert len(set(registry.values())) == len(registry)
    assert check_client_registry(registry) == registry  # what it returns is a registry
