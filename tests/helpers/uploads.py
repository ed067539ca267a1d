"""Hand-built uploads: a LeNet upload of random weights, edits of its wire record that
must be refused, and a tiny MLP upload with a Kron curvature of chosen eigenvalues."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import ArrayRecord

from fedfusion.core.fusion import FusionContext
from fedfusion.core.predictors import ModelSpec
from fedfusion.wire import ClientUpload, UploadError, decode_upload, encode_upload, member_key
from helpers.tiny import TINY

SPEC = ModelSpec("lenet", (1, 28, 28), 10)
CONTEXT = FusionContext(SPEC)


def make_upload(client_id: int = 3, members: int = 2, seed: int = 0) -> ClientUpload:
    rng = np.random.default_rng(seed)
    shapes = CONTEXT.param_shapes("lenet", {})
    return ClientUpload(
        client_id=client_id, model="lenet", model_kwargs={}, num_examples=1234,
        members=[{"weights": {k: rng.standard_normal(s).astype(np.float32)
                              for k, s in shapes.items()}} for _ in range(members)],
        metrics={"train-time-s": 1.5, "class-histogram": [1000, 200, 34]},  # sums to 1234
    )


def corrupt(edit) -> pytest.ExceptionInfo:
    content = encode_upload(make_upload())
    edit(content)
    with pytest.raises(UploadError) as info:
        decode_upload(content, "node 7", CONTEXT.param_shapes)
    assert str(info.value).startswith("client node 7:")
    return info


def set_array(content, name, array, member=0):
    record = content[member_key(member, "weights")]
    arrays = {k: v.numpy() for k, v in record.items()}
    if array is None:
        del arrays[name]
    else:
        arrays[name] = array
    content[member_key(member, "weights")] = ArrayRecord(
        {k: __import__("flwr").app.Array(v) for k, v in arrays.items()})
TINY_CONTEXT = FusionContext(TINY)
KRON = ("weights", "curvature.kron")


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    """A bare ``.npy`` header declaring ``shape`` (and no data at all)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def kron_upload(client_id: int, weight: float, eigenvalue: float, seed: int = 0
                ) -> ClientUpload:
    """A tiny-MLP upload with weights ``+-weight`` and a Kron curvature whose every factor
    eigenvalue is ``eigenvalue`` (random orthonormal eigenvectors)."""
    rng = np.random.default_rng(seed)
    shapes = TINY_CONTEXT.param_shapes(TINY.name, TINY.kwargs)
    weights, kron = {}, {}
    for name, shape in shapes.items():
        weights[name] = (weight * np.sign(rng.standard_normal(shape))).astype(np.float32)
        for side, n in (("out", shape[0]), ("in", int(np.prod(shape[1:])))):
            kron[f"{name}/eigvecs_{side}"] = np.linalg.qr(rng.standard_normal((n, n)))[0]
            kron[f"{name}/eigvals_{side}"] = np.full(n, eigenvalue)
    return ClientUpload(client_id, TINY.name, TINY.kwargs, 10,
                        [{"weights": weights, "curvature.kron": kron}])
