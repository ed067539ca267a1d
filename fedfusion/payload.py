"""The client upload: one versioned format, in Flower records, shared by every strategy.

Wire format (schema ``fedfusion.upload``, version 1), the ``content`` RecordDict of a
ClientApp's train reply:

=========================  ==============  ============================================
key                        record          holds
=========================  ==============  ============================================
``fedfusion.meta``         ConfigRecord    ``schema``, ``schema-version``, ``client-id``,
                                           ``model``, ``model-kwargs`` (JSON),
                                           ``num-members``, ``sections`` (list of str)
``fedfusion.metrics``      MetricRecord    ``num-examples``, ``train-time-s``,
                                           ``stats-time-s``, ``class-histogram`` (ints)
``fedfusion.m{m}.{sec}``   ArrayRecord     member ``m``'s arrays of section ``sec``
=========================  ==============  ============================================

Section ``weights`` (the member's ``state_dict``) is always present; strategies that need
more (curvature, Gram matrices, statistics) ask the clients for further sections and
register a validator for each with :func:`register_section`. Arrays travel as ``.npy``
bytes (Flower's ``Array``), never pickled.

Decoding (:func:`decode_upload`) and loading from disk (:mod:`fedfusion.upload_store`) both
end in :func:`validate_upload`: schema version, model, array names, dtypes, shapes and
finiteness. A bad upload raises :class:`UploadError` naming the client and the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

SCHEMA = "fedfusion.upload"
SCHEMA_VERSION = 1
META_KEY = "fedfusion.meta"
METRICS_KEY = "fedfusion.metrics"
WEIGHTS = "weights"
MAX_MEMBERS = 64

NumpyDict = dict[str, np.ndarray]
ParamShapes = Mapping[str, tuple[int, ...]]
SectionValidator = Callable[[Mapping[str, np.ndarray], ParamShapes], None]
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


class UploadError(ValueError):
    """A client upload that cannot be used; ``client`` says whose, the message says why."""

    def __init__(self, client: str | int, problem: str):
        self.client = str(client)
        self.problem = problem
        super().__init__(f"client {client}: {problem}")


@dataclass
class ClientUpload:
    """What one client sends in one round: M members, each a dict of named sections."""

    client_id: int
    model: str
    model_kwargs: dict[str, object]
    num_examples: int
    members: list[dict[str, NumpyDict]]
    metrics: dict[str, float | int | list[int] | list[float]] = field(default_factory=dict)
    #: the Flower node it came from (set by the server; None for uploads made without Flower)
    node_id: int | None = field(default=None, compare=False)

    @classmethod
    def from_models(cls, models: Sequence[Any], x: Any, y: Any, **kwargs: Any) -> ClientUpload:
        """Shorthand for :func:`fedfusion.client.make_upload` (trained models -> upload)."""
        from fedfusion.client import make_upload

        return make_upload(models, x, y, **kwargs)

    @property
    def num_members(self) -> int:
        return len(self.members)

    @property
    def sections(self) -> list[str]:
        return sorted(self.members[0]) if self.members else []

    def weights(self, member: int = 0) -> NumpyDict:
        return self.members[member][WEIGHTS]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for m in self.members for sec in m.values() for a in sec.values())


def member_key(member: int, section: str) -> str:
    return f"fedfusion.m{member}.{section}"


def encode_upload(upload: ClientUpload) -> RecordDict:
    """Encode an upload into the RecordDict a ClientApp returns."""
    content = RecordDict()
    content[META_KEY] = ConfigRecord(
        {
            "schema": SCHEMA,
            "schema-version": SCHEMA_VERSION,
            "client-id": int(upload.client_id),
            "model": upload.model,
            "model-kwargs": json.dumps(upload.model_kwargs, sort_keys=True),
            "num-members": upload.num_members,
            "sections": upload.sections,
        }
    )
    content[METRICS_KEY] = MetricRecord(
        {"num-examples": int(upload.num_examples), **upload.metrics}
    )
    for m, member in enumerate(upload.members):
        for section, arrays in member.items():
            content[member_key(m, section)] = ArrayRecord(
                {name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()}
            )
    return content


def decode_upload(
    content: RecordDict,
    client: str | int,
    param_shapes: Callable[[str, dict[str, object]], ParamShapes],
    required_sections: Iterable[str] = (WEIGHTS,),
) -> ClientUpload:
    """Decode and validate a train reply. ``param_shapes(model, kwargs)`` gives the
    expected parameter shapes of the client's declared model (it raises for unknown ones)."""
    meta = _get_record(content, META_KEY, ConfigRecord, client)
    metrics = _get_record(content, METRICS_KEY, MetricRecord, client)
    _check_schema(meta, client)
    num_members = _meta_value(meta, "num-members", int, client)
    if not 1 <= num_members <= MAX_MEMBERS:
        raise UploadError(client, f"num-members is {num_members}, expected 1..{MAX_MEMBERS}")
    sections = _meta_value(meta, "sections", list, client)
    members: list[dict[str, NumpyDict]] = []
    for m in range(num_members):
        member: dict[str, NumpyDict] = {}
        for section in sections:
            record = _get_record(content, member_key(m, section), ArrayRecord, client)
            try:
                member[section] = {name: arr.numpy() for name, arr in record.items()}
            except Exception as exc:  # malformed bytes: np.load raises many kinds
                raise UploadError(client, f"member {m} section {section!r}: {exc}") from exc
        members.append(member)
    try:
        model_kwargs = json.loads(_meta_value(meta, "model-kwargs", str, client))
    except json.JSONDecodeError as exc:
        raise UploadError(client, f"model-kwargs is not JSON: {exc}") from exc
    num_examples = metrics.get("num-examples")
    upload = ClientUpload(
        client_id=_meta_value(meta, "client-id", int, client),
        model=_meta_value(meta, "model", str, client),
        model_kwargs=model_kwargs,
        num_examples=num_examples if isinstance(num_examples, int) else -1,
        members=members,
        metrics={k: v for k, v in metrics.items() if k != "num-examples"},
    )
    validate_upload(upload, param_shapes, required_sections, client=client)
    return upload


def validate_upload(
    upload: ClientUpload,
    param_shapes: Callable[[str, dict[str, object]], ParamShapes],
    required_sections: Iterable[str] = (WEIGHTS,),
    client: str | int | None = None,
) -> None:
    """Check everything a strategy relies on; raise :class:`UploadError` on the first problem."""
    who = upload.client_id if client is None else client
    if upload.num_examples < 1:
        raise UploadError(who, f"num-examples must be a positive int, got {upload.num_examples}")
    if not isinstance(upload.model_kwargs, dict):
        raise UploadError(who, "model-kwargs must be a JSON object")
    try:
        shapes = param_shapes(upload.model, upload.model_kwargs)
    except (ValueError, TypeError) as exc:
        raise UploadError(who, f"model {upload.model!r} cannot be built: {exc}") from exc
    if not upload.members:
        raise UploadError(who, "upload has no members")
    for m, member in enumerate(upload.members):
        missing = [s for s in required_sections if s not in member]
        if missing:
            raise UploadError(who, f"member {m} lacks section(s) {missing} this strategy needs")
        for section, arrays in member.items():
            where = f"member {m} section {section!r}"
            for name, array in arrays.items():
                if array.dtype.type not in _FLOAT_DTYPES:
                    raise UploadError(who, f"{where}: array {name!r} has dtype {array.dtype}")
                if not np.all(np.isfinite(array)):
                    raise UploadError(who, f"{where}: array {name!r} has NaN or Inf values")
            validator = _SECTION_VALIDATORS.get(section)
            if validator is None:
                raise UploadError(who, f"{where}: unknown section (known: {known_sections()})")
            try:
                validator(arrays, shapes)
            except ValueError as exc:
                raise UploadError(who, f"{where}: {exc}") from exc


def check_array_names(arrays: Mapping[str, object], expected: Iterable[str],
                      missing_label: str = "missing array(s)", extra_hint: str = "") -> None:
    """Raise ValueError naming the arrays that are missing from, or not expected in, ``arrays``."""
    expected = set(expected)
    missing = sorted(expected - set(arrays))
    extra = sorted(set(arrays) - expected)
    if missing:
        raise ValueError(f"{missing_label} {missing}")
    if extra:
        raise ValueError(f"unexpected array(s) {extra}{extra_hint}")


def _validate_weights(arrays: Mapping[str, np.ndarray], shapes: ParamShapes) -> None:
    check_array_names(arrays, shapes)
    for name, shape in shapes.items():
        if tuple(arrays[name].shape) != tuple(shape):
            raise ValueError(
                f"array {name!r} has shape {tuple(arrays[name].shape)}, expected {tuple(shape)}"
            )


_SECTION_VALIDATORS: dict[str, SectionValidator] = {WEIGHTS: _validate_weights}


def register_section(name: str, validator: SectionValidator) -> None:
    """Declare an upload section and how to check it (raise ValueError naming the array)."""
    _SECTION_VALIDATORS[name] = validator


def known_sections() -> list[str]:
    return sorted(_SECTION_VALIDATORS)


def encode_models(state_dicts: Sequence[Mapping[str, np.ndarray]]) -> ArrayRecord:
    """Server broadcast: M models in one ArrayRecord, keys ``"{m}/{param}"``."""
    return ArrayRecord(
        {
            f"{m}/{name}": Array(np.ascontiguousarray(a))
            for m, sd in enumerate(state_dicts)
            for name, a in sd.items()
        }
    )


def decode_models(record: ArrayRecord) -> list[NumpyDict]:
    """Inverse of :func:`encode_models`."""
    models: dict[int, NumpyDict] = {}
    for key, array in record.items():
        index, _, name = key.partition("/")
        if not index.isdigit() or not name:
            raise ValueError(f"broadcast array key {key!r} is not of the form '<m>/<param>'")
        models.setdefault(int(index), {})[name] = array.numpy()
    if sorted(models) != list(range(len(models))):
        raise ValueError(f"broadcast members are not numbered 0..M-1: {sorted(models)}")
    return [models[m] for m in range(len(models))]


def _get_record(content: RecordDict, key: str, kind: type, client: str | int):  # noqa: ANN202
    if key not in content:
        raise UploadError(client, f"record {key!r} is missing")
    record = content[key]
    if not isinstance(record, kind):
        raise UploadError(
            client, f"record {key!r} is a {type(record).__name__}, not {kind.__name__}"
        )
    return record


def _check_schema(meta: ConfigRecord, client: str | int) -> None:
    if meta.get("schema") != SCHEMA:
        raise UploadError(client, f"schema is {meta.get('schema')!r}, expected {SCHEMA!r}")
    version = meta.get("schema-version")
    if version != SCHEMA_VERSION:
        raise UploadError(
            client, f"schema-version {version!r} is not supported (this server: {SCHEMA_VERSION})"
        )


def _meta_value(meta: ConfigRecord, key: str, kind: type, client: str | int):  # noqa: ANN202
    value = meta.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UploadError(client, f"meta {key!r} must be {kind.__name__}, got {value!r}")
    return value
