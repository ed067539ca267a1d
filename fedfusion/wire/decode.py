"""Decoding a client's train reply into a checked :class:`~fedfusion.wire.format.ClientUpload`
(:func:`decode_upload`).

Every input is untrusted, and checking it must not cost more than the honest upload would: the
metadata, the declared model, then every array's name, dtype, shape and byte size are checked
from the flwr ``Array``'s own fields, the total against the limits' ``upload_bytes``, then each
``.npy`` header against the declared fields (:mod:`fedfusion.wire.npy`), and only then are the
bytes decoded and the upload validated (:func:`fedfusion.wire.validation.validate_upload`'s
checks).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.constant import SType

from fedfusion.reasons import brief, clip, describe, name_list
from fedfusion.sections import SECTIONS, WEIGHTS, SectionTable
from fedfusion.sections.weights import check_weight_shapes
from fedfusion.wire.format import (
    MAX_MEMBERS,
    META_KEY,
    METRICS_KEY,
    SCHEMA,
    SCHEMA_VERSION,
    ClientUpload,
    ParamShapes,
    member_key,
)
from fedfusion.wire.limits import DEFAULT_LIMITS, UploadLimits
from fedfusion.wire.npy import UPLOAD_DTYPES, NpyLayout, checked_shape, from_buffer, wire_layout
from fedfusion.wire.validation import (
    UploadError,
    check_header,
    check_kwargs_text,
    check_members,
    check_required,
    check_section_names,
    expected_shapes,
    too_large,
)

#: the dtype strings a wire Array may declare (``str(ndarray.dtype)`` and ``dtype.str``, in
#: either byte order) -> the dtype; anything else is refused without being parsed
_WIRE_DTYPES: dict[str, np.dtype] = {
    spelling: dtype
    for t in UPLOAD_DTYPES
    for dtype in (np.dtype(t).newbyteorder("<"), np.dtype(t).newbyteorder(">"))
    for spelling in (str(dtype), dtype.str)
}
#: what :func:`decode_upload` tells a client that sent a plain Flower reply
_REPLY_HELPER = "fedfusion.client.reply(msg, models, x, y)"


def decode_upload(
    content: RecordDict,
    client: str | int,
    param_shapes: Callable[[str, dict[str, object]], ParamShapes],
    required_sections: Iterable[str] = (WEIGHTS,),
    *,
    limits: UploadLimits = DEFAULT_LIMITS,
    table: SectionTable = SECTIONS,
) -> ClientUpload:
    """Decode and validate a train reply. ``param_shapes(model, kwargs)`` gives the
    expected parameter shapes of the client's declared model (it may raise anything for an
    unknown or absurd one).

    Everything declared is checked before any array is decoded (see the module docstring);
    ``limits`` caps what one client may send (its arrays declare at most
    ``limits.upload_bytes`` bytes in all) and ``table`` names the sections it may hold. Any
    problem raises :class:`UploadError` naming ``client``; no other exception escapes."""
    try:
        return _decode(content, client, param_shapes, tuple(required_sections), limits, table)
    except UploadError:
        raise
    except Exception as exc:  # the last net: one client's upload never crashes the server
        raise UploadError(client, f"malformed upload: {describe(exc)}") from exc


def _decode(content: RecordDict, client: str | int,
            param_shapes: Callable[[str, dict[str, object]], ParamShapes],
            required_sections: tuple[str, ...], limits: UploadLimits, table: SectionTable
            ) -> ClientUpload:
    if not isinstance(content, RecordDict):
        raise UploadError(client, f"reply content is a {type(content).__name__}, "
                                  f"not a RecordDict; build the reply with {_REPLY_HELPER}")
    meta = _get_record(content, META_KEY, ConfigRecord, client)
    metrics = _get_record(content, METRICS_KEY, MetricRecord, client)
    _check_schema(meta, client)
    num_members = _meta_value(meta, "num-members", int, client)
    if not 1 <= num_members <= MAX_MEMBERS:
        raise UploadError(client, f"num-members is {num_members}, expected 1..{MAX_MEMBERS}")
    sections = _meta_value(meta, "sections", list, client)
    check_section_names(sections, client, table)
    check_required(sections, required_sections, "the upload", client)
    upload = ClientUpload(
        client_id=_meta_value(meta, "client-id", int, client),
        model=_meta_value(meta, "model", str, client),
        model_kwargs=_parse_model_kwargs(_meta_value(meta, "model-kwargs", str, client), client,
                                          limits),
        num_examples=metrics.get("num-examples"),  # type: ignore[arg-type]  # checked below
        members=[],
        metrics={k: v for k, v in metrics.items() if k != "num-examples"},
    )
    check_header(upload, client, limits)
    shapes = expected_shapes(upload, param_shapes, client)
    # 1. declared fields only: names, dtypes, shapes, byte sizes (nothing decoded yet)
    records: list[dict[str, ArrayRecord]] = []
    declared: dict[tuple[int, str, str], tuple[np.dtype, tuple[int, ...]]] = {}
    total = 0
    for m in range(num_members):
        member: dict[str, ArrayRecord] = {}
        for section in sections:
            record = _get_record(content, member_key(m, section), ArrayRecord, client)
            where = f"member {m} section {section!r}"
            if len(record) > limits.arrays_per_section:
                raise UploadError(client, f"{where}: {len(record)} arrays, the cap is "
                                          f"{limits.arrays_per_section}")
            declared_shapes = {}
            for name, array in record.items():
                try:
                    dtype, shape = declared[m, section, name] = _declared(name, array, limits)
                except ValueError as exc:
                    raise UploadError(client, f"{where}: {exc}") from exc
                declared_shapes[name] = shape
                total += math.prod(shape) * dtype.itemsize
                if total > limits.upload_bytes:
                    raise UploadError(client, too_large(total, limits.upload_bytes))
            if section == WEIGHTS:
                try:
                    check_weight_shapes(declared_shapes, shapes, {
                        name: declared[m, section, name][0] for name in declared_shapes})
                except ValueError as exc:
                    raise UploadError(client, f"{where}: {exc}") from exc
            member[section] = record
        records.append(member)
    # 2. every .npy header against its declared fields and its byte count (still no data)
    layouts: list[dict[str, dict[str, NpyLayout]]] = []
    for m, member in enumerate(records):
        layouts.append({})
        for section, record in member.items():
            layouts[m][section] = {}
            for name, array in record.items():
                try:
                    layouts[m][section][name] = wire_layout(name, array,
                                                             *declared[m, section, name])
                except Exception as exc:  # malformed headers: numpy raises many kinds
                    raise UploadError(client, f"member {m} section {section!r}: "
                                              f"{describe(exc)}") from exc
    # 3. decode
    for m, member in enumerate(records):
        upload.members.append({
            section: {name: from_buffer(array.data, layouts[m][section][name])
                      for name, array in record.items()}
            for section, record in member.items()})
    check_members(upload, shapes, required_sections, client, limits, table)
    return upload



def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _parse_model_kwargs(text: str, client: str | int, limits: UploadLimits) -> dict[str, Any]:
    """``model-kwargs`` JSON, length and depth capped BEFORE parsing; NaN/Infinity refused."""
    check_kwargs_text(text, client, limits)
    try:
        kwargs = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise UploadError(client, f"model-kwargs is not JSON: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise UploadError(client, "model-kwargs must be a JSON object")
    return kwargs



def decode_array(name: str, array: object, shape: tuple[int, ...],
                 limits: UploadLimits = DEFAULT_LIMITS) -> np.ndarray:
    """One float array a client sent outside an upload (e.g. FENS' aggregator), checked as an
    upload's arrays are before any byte is decoded: a flwr numpy ``Array`` of a float dtype
    declaring exactly ``shape``, whose ``.npy`` header agrees with its declared fields.
    Raises ValueError naming ``name``."""
    dtype, declared = _declared(name, array, limits)
    if dtype.kind != "f" or declared != tuple(shape):
        raise ValueError(f"array {name!r} is {dtype} {declared}, expected a float array of "
                         f"shape {tuple(shape)}")
    assert isinstance(array, Array)
    return from_buffer(array.data, wire_layout(name, array, dtype, declared))


def _declared(name: object, array: object, limits: UploadLimits
              ) -> tuple[np.dtype, tuple[int, ...]]:
    """Dtype and shape of a wire array from its declared fields only (nothing decoded)."""
    if not isinstance(name, str) or len(name) > limits.name_chars:
        raise ValueError(f"array name {brief(name)} is not a string of at most "
                         f"{limits.name_chars} characters")
    if not isinstance(array, Array):
        raise ValueError(f"array {name!r} is a {type(array).__name__}, not a flwr Array")
    if array.stype != SType.NUMPY:
        raise ValueError(f"array {name!r} has serialisation {brief(array.stype)}, expected "
                         f"{SType.NUMPY!r}")
    dtype = _WIRE_DTYPES.get(array.dtype) if isinstance(array.dtype, str) else None
    if dtype is None:
        raise ValueError(f"array {name!r} has dtype {clip(str(array.dtype), 40)}; uploads "
                         "hold float16/32/64 arrays (and integer or bool state entries)")
    return dtype, checked_shape(name, array.shape)



def _get_record(content: RecordDict, key: str, kind: type, client: str | int):  # noqa: ANN202
    if key not in content:
        if key == META_KEY:  # the usual mistake: a plain Flower reply
            raise UploadError(
                client, f"record {META_KEY!r} is missing: this reply is not a fedfusion upload "
                f"(it holds records {name_list(sorted(content.keys()))}); build the reply with "
                f"{_REPLY_HELPER}")
        raise UploadError(client, f"record {key!r} is missing")
    record = content[key]
    if not isinstance(record, kind):
        raise UploadError(
            client, f"record {key!r} is a {type(record).__name__}, not {kind.__name__}"
        )
    return record


def _check_schema(meta: ConfigRecord, client: str | int) -> None:
    if meta.get("schema") != SCHEMA:
        raise UploadError(client, f"schema is {brief(meta.get('schema'))}, expected {SCHEMA!r}")
    version = meta.get("schema-version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise UploadError(
            client, f"schema-version {brief(version)} is not supported (this server: "
            f"{SCHEMA_VERSION})"
        )


def _meta_value(meta: ConfigRecord, key: str, kind: type, client: str | int):  # noqa: ANN202
    value = meta.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UploadError(client, f"meta {key!r} must be {kind.__name__}, got {brief(value)}")
    return value
