"""The upload format: bit-exact round trips and clear rejections of bad uploads."""

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from helpers.uploads import CONTEXT, corrupt, make_upload, set_array

from fedfusion.upload_store import load_uploads, save_uploads
from fedfusion.wire import (
    META_KEY,
    ClientUpload,
    UploadError,
    decode_models,
    decode_upload,
    encode_models,
    encode_upload,
    member_key,
)


def assert_same(a: ClientUpload, b: ClientUpload) -> None:
    assert (a.client_id, a.model, a.model_kwargs, a.num_examples, a.metrics) == (
        b.client_id, b.model, b.model_kwargs, b.num_examples, b.metrics)
    for ma, mb in zip(a.members, b.members, strict=True):
        for section in ma:
            for name, array in ma[section].items():
                assert array.dtype == mb[section][name].dtype
                assert array.tobytes() == mb[section][name].tobytes(), name


def test_round_trip_through_flower_wire_format_is_bit_exact():
    upload = make_upload()
    wire = recorddict_from_proto(recorddict_to_proto(encode_upload(upload)))
    assert_same(decode_upload(wire, "n", CONTEXT.param_shapes), upload)


def test_round_trip_through_disk_is_bit_exact(tmp_path):
    uploads = [make_upload(0, seed=0), make_upload(1, members=1, seed=1)]
    run_config, loaded, failures = load_uploads(save_uploads(tmp_path, uploads, {"alpha": 0.1}))
    assert failures == []
    assert run_config == {"alpha": 0.1}
    for a, b in zip(uploads, loaded, strict=True):
        assert_same(a, b)


def test_broadcast_round_trip():
    models = [make_upload(members=1, seed=s).weights(0) for s in range(3)]
    decoded = decode_models(encode_models(models))
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(models, decoded, strict=True) for k in a)


def test_nan_is_rejected_naming_the_array():
    def edit(content):
        bad = np.zeros((6, 1, 5, 5), np.float32)
        bad[0, 0, 0, 0] = np.nan
        set_array(content, "features.0.weight", bad, member=1)
    info = corrupt(edit)
    assert "member 1" in str(info.value) and "'features.0.weight'" in str(info.value)
    assert "NaN" in str(info.value)


def test_wrong_shape_is_rejected_naming_the_array():
    info = corrupt(lambda c: set_array(c, "classifier.4.weight", np.zeros((10, 80), np.float32)))
    assert "'classifier.4.weight' has shape (10, 80), expected (10, 84)" in str(info.value)


def test_missing_array_is_rejected_naming_it():
    info = corrupt(lambda c: set_array(c, "classifier.2.weight", None))
    assert "missing array(s) ['classifier.2.weight']" in str(info.value)


def test_integer_dtype_is_rejected():
    info = corrupt(lambda c: set_array(c, "classifier.4.weight", np.zeros((10, 84), np.int64)))
    assert "dtype int64" in str(info.value)


def test_missing_member_record_and_schema_version():
    assert "record 'fedfusion.m1.weights' is missing" in str(
        corrupt(lambda c: c.__delitem__(member_key(1, "weights"))).value)

    def bump(content):
        meta = dict(content[META_KEY])
        meta["schema-version"] = 99
        content[META_KEY] = ConfigRecord(meta)
    assert "schema-version 99 is not supported" in str(corrupt(bump).value)


def test_unknown_model_and_missing_required_section():
    def other_model(content):
        meta = dict(content[META_KEY])
        meta["model"] = "resnet"
        content[META_KEY] = ConfigRecord(meta)
    assert "model 'resnet' cannot be built" in str(corrupt(other_model).value)
    with pytest.raises(UploadError, match="lacks section\\(s\\) \\['curvature.kron'\\]"):
        decode_upload(encode_upload(make_upload()), "n", CONTEXT.param_shapes,
                      required_sections=("weights", "curvature.kron"))
