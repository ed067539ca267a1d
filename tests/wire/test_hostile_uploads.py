"""No upload can crash, stall or exhaust the server: one named case per class of hostile input.

Live uploads (:func:`decode_upload`), in-memory and cached ones (:func:`validate_upload`,
:func:`load_uploads`), the replay CLI, saved predictors and Kron curvature arrays; then whole
federations in which one client sends each hostile upload and the others finish the run.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import InProcessGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from helpers.tiny import TINY
from helpers.uploads import (
    CONTEXT,
    KRON,
    SPEC,
    TINY_CONTEXT,
    corrupt,
    kron_upload,
    make_upload,
    npy_header,
    set_array,
)

from fedfusion.app import replay
from fedfusion.core.predictors import Ensemble, ModelSpec, save_predictor
from fedfusion.core.state import state_arrays
from fedfusion.curvature import KronCurvature
from fedfusion.models import build_model
from fedfusion.sections import MAX_ABS_CURVATURE, MAX_ABS_WEIGHT, SECTIONS
from fedfusion.server_app import run_server
from fedfusion.strategies import FedAvg, FedBEns
from fedfusion.strategies.fedbens.objective import mixture_log_posterior
from fedfusion.strategies.predictors import load_predictor
from fedfusion.upload_store import UploadStoreError, load_uploads, save_uploads
from fedfusion.wire import (
    META_KEY,
    METRICS_KEY,
    ClientUpload,
    UploadError,
    UploadLimits,
    decode_upload,
    encode_upload,
    member_key,
    validate_upload,
    validation,
)

REPO = Path(__file__).resolve().parents[2]
def _meta(content: RecordDict, **changes: object) -> None:
    """Edit the upload's ``fedfusion.meta`` record (keys with dashes: pass a dict)."""
    meta = dict(content[META_KEY])
    meta.update(changes)
    content[META_KEY] = ConfigRecord(meta)


def _problem(edit) -> str:  # noqa: ANN001
    """The reason a lenet upload edited by ``edit`` is refused (naming client 'node 7')."""
    return corrupt(edit).value.problem


# ------------------------------------------------------------------ the declared architecture
@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"hidden_layers": 100000}, "hidden_layers must be an int in 0..64, got 100000"),
    ({"hidden": 10**12}, "hidden must be an int in 1..65536, got 1000000000000"),
    ({"hidden_sizes": [8, 10**12]}, "hidden_sizes must be a list of ints >= 1 (at most 64 of "
                                     "them, each <= 65536), got [8, 1000000000000]"),
    ({"hidden_sizes": list(range(1, 200))}, "hidden_sizes must be a list of ints >= 1 (at most "
                                            "64 of them"),
    ({"hidden": "wide"}, "hidden must be an int in 1..65536, got 'wide'"),
    ({"bias": 3}, "bias must be true or false, got 3"),
])
def test_absurd_model_kwargs_are_refused_by_the_models_range_checks(kwargs, expected):
    problem = _problem(lambda c: _meta(c, model="mlp", **{"model-kwargs": json.dumps(kwargs)}))
    assert problem.startswith("model 'mlp' cannot be built with model-kwargs")
    assert expected in problem


def test_zoo_models_check_their_input_and_classes():
    with pytest.raises(ValueError, match="lenet needs inputs of at least 16x16, got"):
        build_model("lenet", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="lenet: num_classes must be an int in 1..100000"):
        build_model("lenet", (1, 28, 28), 10**12)
    with pytest.raises(ValueError, match="cnn: input channels must be an int in 1..1024"):
        build_model("cnn", (0, 32, 32), 10)
    with pytest.raises(ValueError, match="mlp: input features must be an int"):
        build_model("mlp", (4096, 4096, 4096), 10)


@pytest.mark.parametrize("error", [RecursionError("maximum recursion depth exceeded"),
                                   MemoryError("cannot allocate"), RuntimeError("CUDA oom"),
                                   KeyError("hidden")])
def test_any_exception_from_param_shapes_is_an_upload_error(error):
    def shapes(model, kwargs):  # noqa: ANN001, ANN202
        raise error

    pattern = rf"model 'lenet' cannot be built .*{type(error).__name__}"
    with pytest.raises(UploadError, match=pattern):
        decode_upload(encode_upload(make_upload()), "node 7", shapes)
    with pytest.raises(UploadError, match=pattern):
        validate_upload(make_upload(), shapes)


def test_any_exception_from_a_section_validator_is_an_upload_error():
    def broken(arrays, shapes):  # noqa: ANN001, ANN202
        raise IndexError("index 7 is out of bounds")

    table = {**SECTIONS, "weights": dataclasses.replace(SECTIONS["weights"], validator=broken)}
    with pytest.raises(UploadError, match="member 0 section 'weights': IndexError: index 7"):
        decode_upload(encode_upload(make_upload()), "node 7", CONTEXT.param_shapes,
                      table=table)


def test_model_kwargs_json_is_capped_before_it_is_parsed(monkeypatch):
    parsed = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, **kw: parsed.append(text) or loads(text, **kw))

    def reason(text: str) -> str:
        return _problem(lambda c: _meta(c, **{"model-kwargs": text}))

    # 100k nested brackets: json.loads would raise RecursionError
    deep = "[" * 50_000 + "]" * 50_000
    assert "model-kwargs is 100000 characters of JSON, the cap is 4096" in reason(deep)
    nested = '{"a": ' * 20 + "1" + "}" * 20
    assert "model-kwargs nests 20 levels deep, the cap is 16" in reason(nested)
    assert parsed == []  # neither reached the parser
    assert "model-kwargs is not JSON: NaN is not a number JSON allows" in reason('{"a": NaN}')
    assert "model-kwargs must be a JSON object" in reason("[1, 2]")
    assert validation.json_depth('{"s": "[[[{{\\"[", "t": [[1]]}') == 3  # strings don't count


# ------------------------------------------------------------------ bytes and byte order
def test_big_endian_arrays_are_decoded_to_native_byte_order():
    upload = make_upload(members=1)
    name = "classifier.4.weight"
    big = upload.weights(0)[name].astype(">f4")
    content = encode_upload(upload)
    set_array(content, name, big)
    decoded = decode_upload(content, "node 7", CONTEXT.param_shapes)
    array = decoded.weights(0)[name]
    assert array.dtype == np.float32 and array.dtype.isnative and array.flags.writeable
    np.testing.assert_array_equal(array, upload.weights(0)[name])
    SPEC.build(decoded.weights(0))  # torch.from_numpy takes every array
    # an in-memory upload is not repaired behind its author's back
    upload.members[0]["weights"][name] = big
    with pytest.raises(UploadError, match=r"'classifier.4.weight' has non-native byte order "
                                          r"\(>f4\); convert it with"):
        validate_upload(upload, CONTEXT.param_shapes)


def _declare_huge(content: RecordDict) -> None:
    content[member_key(0, "weights")]["classifier.4.weight"].shape = (10**6, 10**6)


def _header_claims_huge(content: RecordDict) -> None:
    array = content[member_key(0, "weights")]["classifier.4.weight"]
    array.data = npy_header((10**6, 10**6))  # declared fields still say (10, 84)


def _truncated(content: RecordDict) -> None:
    array = content[member_key(0, "weights")]["classifier.4.weight"]
    array.data = array.data[:-100]


OVERSIZED = {
    "declared 10**12 elements": (_declare_huge, "the arrays declare more than 2147483648 bytes"),
    "npy header claims 10**12": (_header_claims_huge, "its .npy header says <f4 (1000000, "
                                 "1000000), its declared fields <f4 (10, 84)"),
    "truncated data": (_truncated, "holds 3260 data bytes; its shape (10, 84) and dtype <f4 "
                       "need 3360"),
    "65 members": (lambda c: _meta(c, **{"num-members": 65}), "num-members is 65, expected 1..64"),
}


@pytest.mark.parametrize("case", OVERSIZED)
def test_declared_sizes_are_checked_before_anything_is_decoded(case):
    edit, expected = OVERSIZED[case]
    assert expected in _problem(edit)


def test_oversized_uploads_are_refused_with_bounded_memory():
    """tracemalloc sees numpy's allocations: decoding the honest upload allocates its 350 KB,
    refusing one that declares 4 TB allocates next to nothing."""
    contents = []
    for edit, _ in OVERSIZED.values():
        content = encode_upload(make_upload())
        edit(content)
        contents.append(content)
    honest = encode_upload(make_upload())
    tracemalloc.start()
    try:
        for content in contents:
            with pytest.raises(UploadError):
                decode_upload(content, "node 7", CONTEXT.param_shapes)
        refused_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        decode_upload(honest, "node 7", CONTEXT.param_shapes)
        honest_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert honest_peak > 300_000  # the measurement sees array allocations
    assert refused_peak < 100_000, refused_peak


def test_the_byte_cap_is_configurable_for_live_and_cached_uploads():
    content = encode_upload(make_upload())  # 2 lenet members: 353,520 bytes of arrays
    with pytest.raises(UploadError, match="declare more than 300000 bytes"):
        decode_upload(content, "node 7", CONTEXT.param_shapes,
                      limits=UploadLimits(upload_bytes=300_000))
    decode_upload(content, "node 7", CONTEXT.param_shapes,
                  limits=UploadLimits(upload_bytes=400_000))
    with pytest.raises(UploadError, match="declare more than 300000 bytes"):
        validate_upload(make_upload(), CONTEXT.param_shapes,
                        limits=UploadLimits(upload_bytes=300_000))
    many = make_upload(members=1)
    many.members = many.members * 65
    with pytest.raises(UploadError, match="upload has 65 members, expected 1..64"):
        validate_upload(many, CONTEXT.param_shapes)


# ------------------------------------------------------------------ hostile numbers
def test_finite_but_huge_weights_are_refused_naming_section_array_and_value():
    problem = _problem(lambda c: set_array(
        c, "classifier.0.weight", np.full((120, 256), 1e20, np.float32)))
    assert problem == ("member 0 section 'weights': array 'classifier.0.weight' has values up "
                       "to 1e+20 in magnitude, above the cap 1e+04 on section 'weights'")


def test_a_negative_running_variance_excludes_that_client_alone():
    """BatchNorm takes sqrt(running_var + eps): one client's negative variances made the
    fused network NaN for every input; it is refused and the others are fused."""
    spec = ModelSpec("bn_cnn", (1, 28, 28), 10)

    def upload(client: int) -> ClientUpload:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(client)
            weights = state_arrays(spec.build())
        return ClientUpload(client, "bn_cnn", {}, 100, [{"weights": weights}],
                            {"class-histogram": [100]})

    uploads = [upload(c) for c in range(4)]
    variances = [k for k in uploads[3].weights() if k.endswith("running_var")]
    assert variances
    for name in variances:
        uploads[3].weights()[name][:] = -2.0
    strategy = FedAvg(spec, num_clients=4)
    predictor = strategy.fuse_uploads(uploads)
    assert [e["client"] for e in strategy.exclusions] == ["3"]
    assert strategy.exclusions[0]["reason"] == (
        f"member 0 section 'weights': buffer {variances[0]!r} is a running variance but holds "
        "negative values (min -2)")
    with torch.no_grad():
        assert torch.isfinite(predictor.eval()(torch.randn(8, 1, 28, 28))).all()


@pytest.mark.parametrize(("metrics", "expected"), [
    ({"load-time-s": [1.0, 2.0]}, "metric 'load-time-s' must be a finite number >= 0"),
    ({"client-time-s": float("nan")}, "metric 'client-time-s' must be a finite number >= 0"),
    ({"client-time-s": -3}, "metric 'client-time-s' must be a finite number >= 0"),
    # 40 lists of 65,536 numbers: each within metric_length, together 2.6M numbers
    ({f"extra-{k}": [1e-300] * 65536 for k in range(40)},
     "its metrics are more than 1048576 numbers, above the cap of 1048576 characters"),
    ({f"extra-{k}": [-1.2345678e-300] * 60000 for k in range(2)},
     "its metrics are 2040083 characters of JSON, above the cap of 1048576 characters"),
])
def test_metrics_the_server_reads_or_keeps_are_bounded(metrics, expected):
    """The seconds results.json turns into floats, and the size of what upload folders keep
    (a manifest over load_uploads' cap would lose every client of the folder)."""
    upload = make_upload(members=1)
    upload.metrics.update(metrics)
    with pytest.raises(UploadError, match=expected):
        validate_upload(upload, CONTEXT.param_shapes)
    content = encode_upload(upload)  # the live path: refused as it is decoded
    with pytest.raises(UploadError, match=expected):
        decode_upload(content, "node 7", CONTEXT.param_shapes)


def test_finite_but_huge_curvature_is_refused():
    upload = kron_upload(0, weight=0.5, eigenvalue=1.0)
    upload.members[0]["curvature.kron"]["net.3.weight/eigvals_out"][1] = 1e20
    with pytest.raises(UploadError) as info:
        decode_upload(encode_upload(upload), "node 7", TINY_CONTEXT.param_shapes, KRON)
    assert info.value.problem == (
        "member 0 section 'curvature.kron': array 'net.3.weight/eigvals_out' has values up to "
        "1e+20 in magnitude, above the cap 1e+09 on section 'curvature.kron'")


@pytest.mark.parametrize(("eigenvalue", "finite"), [(MAX_ABS_CURVATURE, True), (1e20, False)])
def test_fedbens_objective_stays_finite_at_the_caps(eigenvalue, finite):
    """Two clients at opposite corners of the weight cap (|w| = 1e4), every Kron eigenvalue
    at the curvature cap, T = 0.01, float32: the objective is finite (about -1e30); at
    1e20, the value the caps refuse, it is NaN."""
    uploads = [kron_upload(0, MAX_ABS_WEIGHT, eigenvalue), kron_upload(1, -MAX_ABS_WEIGHT,
                                                                       eigenvalue, seed=1)]
    strategy = FedBEns(TINY, num_clients=2, temperature=0.01, prior_var=0.1, device="cpu",
                       starts="median")  # the median start: midway between the corners
    stacked, owner = strategy.build_posterior(uploads)
    for point in [uploads[0].weights(0), *strategy.starting_points(uploads)]:
        w = {k: torch.tensor(v)[None] for k, v in point.items()}
        value = mixture_log_posterior(w, stacked, owner, 2, strategy.prior_var)
        assert bool(torch.isfinite(value).all()) is finite, value


@pytest.mark.parametrize(("metrics", "expected"), [
    ({"num-examples": 10**6, "class-histogram": [1000, 200, 34]},
     "num-examples is 1000000 but the class histogram sums to 1234"),
    ({"num-examples": 1234, "class-histogram": [1000, 300, -66]},
     "'class-histogram' must be a list of ints >= 0"),
    ({"num-examples": 1234, "class-histogram": [1000.0, 234.0]},
     "'class-histogram' must be a list of ints >= 0"),
    ({"num-examples": 10**12}, "num-examples must be a positive int <= 1000000000, got "
                               "1000000000000"),
    ({"num-examples": 0}, "num-examples must be a positive int"),
    ({"num-examples": 12.5}, "num-examples must be a positive int"),
    ({"num-examples": 5, "train-time-s": -1.0}, "'train-time-s' must be a finite number >= 0"),
])
def test_num_examples_must_be_bounded_and_match_the_class_histogram(metrics, expected):
    def edit(content: RecordDict) -> None:
        content[METRICS_KEY] = MetricRecord(metrics)
    assert expected in _problem(edit)


# ------------------------------------------------------------------ teaching errors
def test_a_plain_flower_reply_says_what_a_fedfusion_reply_is():
    reply = RecordDict({"arrays": ArrayRecord(SPEC.build().state_dict())})
    with pytest.raises(UploadError) as info:
        decode_upload(reply, "node 3", CONTEXT.param_shapes)
    assert str(info.value) == (
        "client node 3: record 'fedfusion.meta' is missing: this reply is not a fedfusion "
        "upload (it holds records ['arrays']); build the reply with "
        "fedfusion.client.reply(msg, models, x, y)")


def test_torch_tensors_in_a_client_upload_say_what_to_use():
    upload = make_upload(members=1)
    upload.members[0]["weights"]["classifier.4.weight"] = torch.zeros(10, 84)
    with pytest.raises(UploadError) as info:
        validate_upload(upload, CONTEXT.param_shapes)
    assert info.value.problem == (
        "member 0 section 'weights': array 'classifier.4.weight' is a torch.Tensor; uploads "
        "hold numpy arrays (fedfusion.client.make_upload converts trained models)")


def test_reasons_are_clipped_whatever_the_client_sends():
    problem = _problem(lambda c: _meta(c, model="m" * 100_000))
    assert len(problem) < 300 and "model must be a name of 1..256 characters" in problem
    extra = {f"x{i}": np.zeros(1, np.float32) for i in range(1000)}
    upload = make_upload(members=1)
    upload.members[0]["weights"].update(extra)
    with pytest.raises(UploadError, match=r"unexpected array\(s\) .*\.\.\. \(992 more\)\]"):
        validate_upload(upload, CONTEXT.param_shapes)


# ------------------------------------------------------------------ Kron eigenvectors
def _kron_arrays(skew: float = 0.0) -> dict[str, np.ndarray]:
    """Exact float64 Kron arrays of one (5, 6) parameter; ``skew`` mixes column 1 into
    column 0 of the input basis (no longer orthonormal)."""
    rng = np.random.default_rng(3)
    arrays = {}
    for side, n in (("out", 5), ("in", 6)):
        q = np.linalg.qr(rng.standard_normal((n, n)))[0]
        arrays[f"w/eigvecs_{side}"] = q
        arrays[f"w/eigvals_{side}"] = rng.uniform(0.1, 2.0, n)
    arrays["w/eigvecs_in"][:, 0] += skew * arrays["w/eigvecs_in"][:, 1]
    return arrays


def _as(arrays: dict[str, np.ndarray], dtype: type) -> dict[str, np.ndarray]:
    return {k: v.astype(dtype) if "eigvecs" in k else v for k, v in arrays.items()}


def test_kron_eigenvector_checks_follow_the_dtype():
    shapes = {"w": (5, 6)}
    # computed in float32, stored as float64 (probe error ~4e-8): accepted
    f32_as_f64 = _as(_as(_kron_arrays(), np.float32), np.float64)
    KronCurvature.from_arrays(f32_as_f64, shapes, 1.0, 1.0)
    # float64 off by 1e-3: not orthonormal to float32 precision (tolerance 1e-4)
    with pytest.raises(ValueError, match="'w/eigvecs_in' is not orthonormal to float64"):
        KronCurvature.from_arrays(_kron_arrays(skew=1e-3), shapes, 1.0, 1.0)
    # float16 of an orthonormal basis: accepted, then re-orthonormalised
    q = KronCurvature.from_arrays(_as(_kron_arrays(), np.float16), shapes, 1.0,
                                  1.0).factors["w"].eigvecs_in
    torch.testing.assert_close(q.T @ q, torch.eye(6), atol=1e-6, rtol=0)
    # float16 that is not orthonormal to float16 precision: rejected, not repaired
    with pytest.raises(ValueError, match=r"'w/eigvecs_in' is not orthonormal to float16 "
                                         r"precision \(relative .* allowed 1e-02\)"):
        KronCurvature.from_arrays(_as(_kron_arrays(skew=0.1), np.float16), shapes, 1.0, 1.0)
    # a scaled basis: entries beyond 1 cannot belong to unit columns
    scaled = _kron_arrays()
    scaled["w/eigvecs_out"] = scaled["w/eigvecs_out"] * 3
    with pytest.raises(ValueError, match="'w/eigvecs_out' is not orthonormal \\(an entry of"):
        KronCurvature.from_arrays(scaled, shapes, 1.0, 1.0)


# ------------------------------------------------------------------ saved predictors
PREDICTOR_EDITS = {
    "unknown kind": (lambda p: p.update(kind="mystery"),
                     "unknown predictor kind 'mystery'; known: ensemble, max-logit"),
    "spec field type": (lambda p: p["specs"][0].update(num_classes="10"),
                        "specs[0].num_classes must be int, got '10'"),
    "absurd input": (lambda p: p["specs"][0].update(input_shape=[1, 2**40, 28]),
                     "every input_shape entry must be an int in 1..16777216"),
    "absurd classes": (lambda p: p["specs"][0].update(num_classes=10**12),
                       "specs[0]: model 'lenet' cannot be built: ValueError: lenet: num_classes "
                       "must be an int in 1..100000"),
    "unknown model": (lambda p: p["specs"][0].update(name="resnet"),
                      "cannot be built: ValueError: unknown model 'resnet'"),
    "missing tensor": (lambda p: p["states"][0].pop("classifier.4.weight"),
                       "states[0] does not match specs[0]'s model: missing "
                       "['classifier.4.weight']"),
    "wrong shape": (lambda p: p["specs"][0].update(num_classes=20),
                    "states[0]['classifier.4.weight'] is torch.float32 (10, 84), the model "
                    "needs a float tensor (20, 84)"),
    "states count": (lambda p: p.update(states=[]),
                     "'states' must be a list with one state per spec (1)"),
    "top_k": (lambda p: p.update(kind="max-logit", top_k=-1), "top_k must be an int in 0.."),
}


@pytest.mark.parametrize("case", PREDICTOR_EDITS)
def test_load_predictor_checks_spec_and_tensors_before_building(tmp_path, case):
    path = save_predictor(Ensemble([SPEC.build()], [SPEC]), tmp_path / "p.pt")
    edit, expected = PREDICTOR_EDITS[case]
    saved = torch.load(path, weights_only=True)
    edit(saved)
    torch.save(saved, path)
    with pytest.raises(ValueError) as info:
        load_predictor(path)
    assert expected in str(info.value)


def test_load_predictor_refuses_files_that_are_not_predictors(tmp_path):
    path = tmp_path / "p.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a saved fedfusion predictor"):
        load_predictor(path)
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match="holds a list, not a predictor payload"):
        load_predictor(path)
    good = save_predictor(Ensemble([SPEC.build()], [SPEC]), tmp_path / "good.pt")
    path.write_bytes(good.read_bytes()[:2000])  # truncated
    with pytest.raises(ValueError, match="not a saved fedfusion predictor"):
        load_predictor(path)


# ------------------------------------------------------------------ cached uploads on disk
def _folder(tmp_path: Path, run_config: dict | None = None) -> Path:
    uploads = [make_upload(0, members=1), make_upload(1, members=2, seed=1),
               make_upload(2, members=1, seed=2)]
    return save_uploads(tmp_path / "uploads", uploads, run_config or {"alpha": 0.1})


def _edit_entry(folder: Path, index: int, edit) -> None:  # noqa: ANN001
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest["clients"][index])
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _load(folder: Path, **kwargs: object) -> tuple[list[int], dict[str, str]]:
    _, uploads, failures = load_uploads(folder, **kwargs)
    return [u.client_id for u in uploads], dict(failures)


ENTRY_EDITS = {
    "type": ({"num_members": "2"}, "clients[1].num_members must be int, got '2'"),
    "cap": ({"num_members": 65}, "clients[1].num_members is 65, expected 1..64"),
    "fewer members": ({"num_members": 1},
                      "client_1.npz holds member 1 but the manifest says 1 member(s)"),
    "more members": ({"num_members": 3}, "the manifest says 3 member(s) but client_1.npz holds "
                                         "no arrays for member(s) [2]"),
    "kwargs": ({"model_kwargs": []}, "clients[1].model_kwargs must be dict, got []"),
    "unknown field": ({"checksum": 1}, "clients[1] has unknown field(s) ['checksum']"),
    "dotdot": ({"file": "../outside.npz"},
               "clients[1].file '../outside.npz' is not a path inside the upload folder"),
    "absolute": ({"file": "/etc/passwd"},
                 "clients[1].file '/etc/passwd' is not a path inside the upload folder"),
    "absent": ({"file": "missing.npz"},
               "clients[1].file 'missing.npz' is not a file in the upload folder"),
    "file type": ({"file": 7}, "clients[1].file must be str, got 7"),
    "duplicate": ({"client_id": 0}, "clients[1]: client_id 0 appears twice"),
}


@pytest.mark.parametrize("case", ENTRY_EDITS)
def test_a_bad_manifest_entry_excludes_that_client_only(tmp_path, case):
    folder = _folder(tmp_path)
    change, expected = ENTRY_EDITS[case]
    _edit_entry(folder, 1, lambda entry: entry.update(change))
    ids, failures = _load(folder)
    assert ids == [0, 2]
    (reason,) = failures.values()
    assert expected in reason


def test_missing_fields_and_unusable_ids_are_named(tmp_path):
    folder = _folder(tmp_path)
    _edit_entry(folder, 1, lambda entry: entry.pop("model"))
    _edit_entry(folder, 2, lambda entry: entry.update(client_id=True))
    ids, failures = _load(folder)
    assert ids == [0]
    assert failures == {"1": "clients[1].model is missing",
                        "entry 2": "clients[2].client_id must be int, got True"}


def test_a_symlink_leading_out_of_the_folder_is_refused(tmp_path):
    folder = _folder(tmp_path)
    outside = tmp_path / "outside.npz"
    outside.write_bytes((folder / "client_1.npz").read_bytes())
    (folder / "inside.npz").symlink_to(folder / "client_1.npz")
    (folder / "link.npz").symlink_to(outside)
    _edit_entry(folder, 1, lambda entry: entry.update(file="link.npz"))
    _edit_entry(folder, 2, lambda entry: entry.update(file="inside.npz", client_id=5,
                                                      num_members=2))
    ids, failures = _load(folder)
    assert ids == [0, 5]  # a link that stays inside is fine
    assert failures == {"1": "clients[1].file 'link.npz' leads outside the upload folder "
                             "(a symlink?)"}


def test_bad_npz_files_exclude_their_client(tmp_path):
    folder = _folder(tmp_path)
    data = (folder / "client_1.npz").read_bytes()
    (folder / "client_1.npz").write_bytes(data[: len(data) // 2])
    with zipfile.ZipFile(folder / "client_2.npz", "w") as archive:  # header claims 4 TB
        archive.writestr("m0/weights/features.0.weight.npy", npy_header((10**6, 10**6)))
    ids, failures = _load(folder)
    assert ids == [0]
    assert failures["1"].startswith("BadZipFile:")
    assert failures["2"] == ("array 'client_2.npz:m0/weights/features.0.weight.npy' holds 0 "
                             "data bytes; its shape (1000000, 1000000) and dtype <f4 need "
                             "4000000000000")
    with pytest.raises(UploadStoreError, match="client 1: BadZipFile"):
        load_uploads(folder, strict=True)


def test_npz_arrays_in_big_endian_are_loaded_native(tmp_path):
    folder = _folder(tmp_path)
    with np.load(folder / "client_0.npz") as data:
        arrays = {k: v.astype(">f4") for k, v in data.items()}
    np.savez(folder / "client_0.npz", **arrays)
    _, uploads, _ = load_uploads(folder)
    weight = uploads[0].weights(0)["classifier.4.weight"]
    assert weight.dtype.isnative and weight.dtype == np.float32
    validate_upload(uploads[0], CONTEXT.param_shapes)


def test_npz_sizes_are_checked_in_the_zip_headers_before_inflating(tmp_path):
    """32 MB of zeros deflate to 32 KB: refused from the zip header, with bounded memory."""
    folder = _folder(tmp_path)
    np.savez_compressed(folder / "client_1.npz", **{"m0/weights/x": np.zeros(8 * 2**20,
                                                                             np.float32),
                                                   "m1/weights/x": np.zeros(1, np.float32)})
    assert (folder / "client_1.npz").stat().st_size < 100_000
    tracemalloc.start()
    try:
        ids, failures = _load(folder, limits=UploadLimits(upload_bytes=4 * 2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ids == [0, 2]
    assert failures["1"] == ("client_1.npz declares 33554692 uncompressed bytes in its zip "
                             "headers, above the cap on one client's upload (4194304 bytes, "
                             "UploadLimits.upload_bytes); not inflated")
    assert peak < 4 * 2**20, peak


@pytest.mark.parametrize(("manifest", "expected"), [
    ("not json", "is not JSON"),
    ("[" * 100_000 + "]" * 100_000, "is not JSON: RecursionError"),
    ("[]", "must hold a JSON object, got list"),
    ('{"schema": "other", "schema_version": 1}', "schema 'other' version 1 is not"),
    ('{"schema": "fedfusion.upload", "schema_version": true}', "version True is not"),
    ('{"schema": "fedfusion.upload", "schema_version": 1, "run_config": [], "clients": []}',
     "field 'run_config' must be a JSON object, got list"),
    ('{"schema": "fedfusion.upload", "schema_version": 1, "run_config": {}, "clients": {}}',
     "field 'clients' must be a list"),
])
def test_a_bad_manifest_is_a_folder_error(tmp_path, manifest, expected):
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(UploadStoreError, match=expected):
        load_uploads(tmp_path)
    with pytest.raises(UploadStoreError, match="not found: is .* an upload folder"):
        load_uploads(tmp_path / "nowhere")


def test_a_replay_excludes_clients_that_do_not_load_and_finishes(small_settings, tmp_path):
    folder = _folder(tmp_path, small_settings.to_mapping())
    (folder / "client_1.npz").write_bytes(b"PK\x03\x04 truncated")
    _edit_entry(folder, 2, lambda entry: entry.update(file="../../etc/passwd"))
    settings = small_settings.replace(replay=str(folder), strategy="ensemble", run_name="re")
    results = run_server(settings)
    assert results["status"] == "ok" and [c["client_id"] for c in results["clients"]] == [0]
    reasons = {e["client"]: e["reason"] for e in results["excluded"]}
    assert reasons["1"].startswith("BadZipFile")
    assert reasons["2"] == ("clients[2].file '../../etc/passwd' is not a path inside the "
                            "upload folder")


def _replay_cli(folder: Path, tmp_path: Path, capsys) -> tuple[int, list[str]]:  # noqa: ANN001
    code = replay.main([str(folder), "--strategy", "ensemble", "--run-config",
                        f"output-dir='{tmp_path / 'out'}'"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_the_replay_cli_ends_with_one_line_on_any_bad_folder(small_settings, tmp_path, capsys):
    code, err = _replay_cli(tmp_path / "nowhere", tmp_path, capsys)
    assert code == 2 and len(err) == 1 and "manifest.json not found" in err[0]
    folder = _folder(tmp_path, {**small_settings.to_mapping(), "alpha": "high"})
    code, err = _replay_cli(folder, tmp_path, capsys)
    assert code == 2 and err == ["fedfusion.app.replay: run-config 'alpha' must be float, got "
                                 "str 'high'"]
    folder = _folder(tmp_path, small_settings.to_mapping())
    for index in range(3):  # every client bad: no valid upload
        _edit_entry(folder, index, lambda entry: entry.update(num_members=0))
    code, err = _replay_cli(folder, tmp_path, capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("fedfusion.app.replay: RuntimeError: round 1: 0 valid upload(s)")
    assert "num_members is 0, expected 1..64" in err[0]


def test_the_replay_cli_never_prints_a_traceback(tmp_path):
    (tmp_path / "manifest.json").write_text('{"schema": "fedfusion.upload"')
    out = subprocess.run([sys.executable, "-m", "fedfusion.app.replay", str(tmp_path),
                          "--strategy", "ensemble"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"fedfusion.app.replay: {tmp_path / 'manifest.json'} is not JSON: JSONDecodeError: "
        "Expecting ',' "
        "delimiter: line 1 column 30 (char 29)"]


# ------------------------------------------------------------------ whole federations
def _plain_flower_reply(content: RecordDict) -> None:
    for key in list(content.keys()):
        del content[key]
    content["arrays"] = ArrayRecord(SPEC.build().state_dict())


def _huge_weights(content: RecordDict) -> None:
    record = content[member_key(0, "weights")]
    array = record["classifier.0.weight"].numpy()
    record["classifier.0.weight"] = Array(np.full_like(array, 1e20))


def _inflated_examples(content: RecordDict) -> None:
    metrics = dict(content[METRICS_KEY])
    metrics["num-examples"] = 10**6
    content[METRICS_KEY] = MetricRecord(metrics)


def _big_endian(content: RecordDict) -> None:
    record = content[member_key(0, "weights")]
    for name in list(record.keys()):
        record[name] = Array(record[name].numpy().astype(">f4"))


#: client index -> (how its reply is corrupted, the exclusion reason; None: still valid)
HOSTILE = {
    1: (_plain_flower_reply, "record 'fedfusion.meta' is missing: this reply is not a fedfusion "
                             "upload (it holds records ['arrays'])"),
    2: (_declare_huge, "the arrays declare more than 2147483648 bytes"),
    3: (_huge_weights, "array 'classifier.0.weight' has values up to 1e+20 in magnitude"),
    4: (_inflated_examples, "num-examples is 1000000 but the class histogram sums to"),
    5: (lambda c: _meta(c, **{"model-kwargs": "[" * 5000 + "]" * 5000}),
        "model-kwargs is 10000 characters of JSON, the cap is 4096"),
    6: (_big_endian, None),
}


def test_a_federation_finishes_with_the_honest_clients_whatever_the_others_send(
        small_settings):
    settings = small_settings.replace(num_clients=7, strategy="ensemble", run_name="hostile",
                                      train_subset=7000, alpha=100.0)

    def tamper(client: int, reply: Message) -> Message:
        if client in HOSTILE:
            HOSTILE[client][0](reply.content)
        return reply

    results = run_server(settings, InProcessGrid(settings, tamper=tamper))
    assert results["status"] == "ok"
    assert [c["client_id"] for c in results["clients"]] == [0, 6]
    reasons = {e["client"]: e["reason"] for e in results["excluded"]}
    expected = {f"node {100 + c}": r for c, (_, r) in HOSTILE.items() if r is not None}
    assert reasons.keys() == expected.keys()
    for node, reason in expected.items():
        assert reason in reasons[node], (node, reasons[node])
    # two iid clients of ~1000 samples, 3 epochs (about 47 SGD steps each): 36% measured
    assert results["test"]["accuracy"] > 0.25


def test_fedbens_excludes_a_client_with_huge_curvature_and_stays_finite(small_settings):
    settings = small_settings.replace(strategy="fedbens", run_name="fedbens-hostile",
                                      server_steps=20, server_eval_every=10)

    def tamper(client: int, reply: Message) -> Message:
        if client == 1:
            record = reply.content[member_key(0, "curvature.kron")]
            values = record["classifier.4.weight/eigvals_out"].numpy().copy()
            values[-1] = 1e25
            record["classifier.4.weight/eigvals_out"] = Array(values)
        return reply

    results = run_server(settings, InProcessGrid(settings, tamper=tamper))
    assert [c["client_id"] for c in results["clients"]] == [0, 2]
    (excluded,) = results["excluded"]
    assert excluded["client"] == "node 101" and excluded["reason"] == (
        "member 0 section 'curvature.kron': array 'classifier.4.weight/eigvals_out' has values "
        "up to 1e+25 in magnitude, above the cap 1e+09 on section 'curvature.kron'")
    assert np.isfinite(results["test"]["nll"]) and results["test"]["accuracy"] > 0.2
