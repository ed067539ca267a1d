"""Validation of a client upload (:func:`validate_upload`): the checks of a
:class:`~fedfusion.wire.format.ClientUpload` against the caps of an
:class:`~fedfusion.wire.limits.UploadLimits` and the validators and value caps of a section
table (:data:`fedfusion.sections.SECTIONS` unless given another).

A bad upload raises :class:`UploadError` naming the client and the problem, and nothing else.
The check functions here are shared with :func:`fedfusion.wire.decode.decode_upload`, which
runs them on the declared fields before decoding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from fedfusion.device import DEVICE_METRIC, device_label
from fedfusion.reasons import brief, clip, describe, name_list
from fedfusion.sections import SECTIONS, WEIGHTS, SectionTable
from fedfusion.wire.format import MAX_MEMBERS, ClientUpload, ParamShapes
from fedfusion.wire.limits import DEFAULT_LIMITS, UploadLimits
from fedfusion.wire.npy import UPLOAD_DTYPES

#: an exclusion reason is clipped to this many characters (it lands in logs and results.json)
MAX_REASON_CHARS = 2000
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
#: metrics the server turns into numbers (results.json): finite and >= 0
_TIMING_METRICS = ("train-time-s", "stats-time-s", "load-time-s", "client-time-s")
_TIMING_PREFIX = "time-s/"


class UploadError(ValueError):
    """A client upload that cannot be used; ``client`` says whose, the message says why
    (clipped to :data:`MAX_REASON_CHARS`)."""

    def __init__(self, client: str | int, problem: str):
        self.client = clip(str(client), 100)
        self.problem = clip(str(problem), MAX_REASON_CHARS)
        super().__init__(f"client {self.client}: {self.problem}")


def validate_upload(
    upload: ClientUpload,
    param_shapes: Callable[[str, dict[str, object]], ParamShapes],
    required_sections: Iterable[str] = (WEIGHTS,),
    client: str | int | None = None,
    *,
    limits: UploadLimits = DEFAULT_LIMITS,
    table: SectionTable = SECTIONS,
) -> None:
    """Check everything a strategy relies on; raise :class:`UploadError` on the first problem
    (and no other exception): field types, counts against ``limits``, ``num-examples``
    against the class histogram, the model, every array's type, dtype, byte order,
    finiteness and magnitude (the section's ``value_cap`` in ``table``), the total bytes, and
    each section's validator in ``table``."""
    who = getattr(upload, "client_id", "?") if client is None else client
    try:
        if not isinstance(upload, ClientUpload):
            raise UploadError(who, f"expected a ClientUpload, got {type(upload).__name__}")
        check_header(upload, who, limits)
        shapes = expected_shapes(upload, param_shapes, who)
        check_members(upload, shapes, tuple(required_sections), who, limits, table)
    except UploadError:
        raise
    except Exception as exc:  # the last net, as in decode_upload
        raise UploadError(who, f"malformed upload: {describe(exc)}") from exc


def too_large(total: int, cap: int) -> str:
    """The reason for an upload whose arrays declare ``total`` bytes, above ``cap``."""
    return (f"the arrays declare more than {cap} bytes (at least {total}), above the cap "
            "on one client's upload (UploadLimits.upload_bytes); refused before decoding")


def check_header(upload: ClientUpload, who: str | int, limits: UploadLimits) -> None:
    """Everything but the arrays: ids, model name and kwargs, counts, metrics."""
    client_id = upload.client_id
    if isinstance(client_id, bool) or not isinstance(client_id, int) or not (
            0 <= client_id < 2**31):
        raise UploadError(who, f"client-id must be an int in 0..2**31-1, got {brief(client_id)}")
    if not isinstance(upload.model, str) or not 0 < len(upload.model) <= limits.name_chars:
        raise UploadError(who, f"model must be a name of 1..{limits.name_chars} characters, "
                               f"got {brief(upload.model)}")
    if not isinstance(upload.model_kwargs, dict):
        raise UploadError(who, "model-kwargs must be a JSON object")
    try:
        text = json.dumps(upload.model_kwargs, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UploadError(who, f"model-kwargs is not plain JSON: {describe(exc)}") from exc
    check_kwargs_text(text, who, limits)
    num_examples = upload.num_examples
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or not (
            1 <= num_examples <= limits.num_examples):
        raise UploadError(who, f"num-examples must be a positive int <= {limits.num_examples}"
                               f", got {brief(num_examples)}")
    _check_metrics(upload.metrics, num_examples, who, limits)


def _check_metrics(metrics: object, num_examples: int, who: str | int,
                   limits: UploadLimits) -> None:
    if not isinstance(metrics, dict) or len(metrics) > limits.metrics:
        raise UploadError(who, f"metrics must be a mapping of at most {limits.metrics} entries")
    numbers = 0
    for key, value in metrics.items():
        if not isinstance(key, str) or len(key) > limits.name_chars:
            raise UploadError(who, f"metric name {brief(key)} is not a short string")
        items = value if isinstance(value, list) else [value]
        numbers += len(items)
        if numbers > limits.metrics_chars:  # each number is at least one character of JSON
            raise UploadError(who, _metrics_too_large(f"more than {limits.metrics_chars} "
                                                      "numbers", limits))
        if len(items) > limits.metric_length or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in items):
            raise UploadError(who, f"metric {key!r} must be a number or a list of at most "
                                   f"{limits.metric_length} numbers, got {brief(value)}")
        if key in _TIMING_METRICS or key.startswith(_TIMING_PREFIX) or (
                key == "contrastive-members"):
            if isinstance(value, list) or value < 0 or (
                    isinstance(value, float) and not math.isfinite(value)):
                raise UploadError(who, f"metric {key!r} must be a finite number >= 0, got "
                                       f"{brief(value)}")
    chars = len(json.dumps(metrics))
    if chars > limits.metrics_chars:
        raise UploadError(who, _metrics_too_large(f"{chars} characters of JSON", limits))
    device = metrics.get(DEVICE_METRIC)
    if device is not None and device_label(device) is None:
        raise UploadError(who, f"metric {DEVICE_METRIC!r} must be an integer >= -2 (-1: CPU, "
                               f"i: cuda:i, -2: another device), got {brief(device)}")
    histogram = metrics.get("class-histogram")
    if histogram is not None:
        if not isinstance(histogram, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in histogram):
            raise UploadError(who, "metric 'class-histogram' must be a list of ints >= 0, got "
                                   f"{brief(histogram)}")
        if sum(histogram) != num_examples:
            raise UploadError(who, f"num-examples is {num_examples} but the class histogram "
                                   f"sums to {sum(histogram)}")


def _metrics_too_large(what: str, limits: UploadLimits) -> str:
    return (f"its metrics are {what}, above the cap of {limits.metrics_chars} characters "
            "(UploadLimits.metrics_chars; they are kept beside the upload in results and "
            "upload folders)")


def check_kwargs_text(text: str, who: str | int, limits: UploadLimits) -> None:
    """``model-kwargs`` JSON text within ``limits``' length and nesting depth, checked
    before it is parsed."""
    if len(text) > limits.kwargs_chars:
        raise UploadError(who, f"model-kwargs is {len(text)} characters of JSON, the cap is "
                               f"{limits.kwargs_chars}")
    depth = json_depth(text)
    if depth > limits.kwargs_depth:
        raise UploadError(who, f"model-kwargs nests {depth} levels deep, the cap is "
                               f"{limits.kwargs_depth}")


def json_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of a JSON text, brackets inside strings not counted: a
    linear scan, so that no parser recursion runs on hostile input."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def expected_shapes(upload: ClientUpload,
                    param_shapes: Callable[[str, dict[str, object]], ParamShapes],
                    who: str | int) -> ParamShapes:
    """``param_shapes`` of the declared model; ANY exception it raises (an unknown model, a
    kwarg out of range, a RecursionError or MemoryError of an absurd one) is the client's."""
    try:
        return param_shapes(upload.model, upload.model_kwargs)
    except Exception as exc:
        raise UploadError(who, f"model {brief(upload.model)} cannot be built with model-kwargs "
                               f"{brief(upload.model_kwargs)}: {describe(exc)}") from exc


def check_section_names(sections: Sequence[object], who: str | int,
                        table: SectionTable) -> None:
    """Distinct names, each a section of ``table``."""
    if len(sections) > len(table) or len(set(map(str, sections))) != len(sections):
        raise UploadError(who, f"sections must be distinct known sections, got "
                               f"{brief(sections)}")
    for section in sections:
        if not isinstance(section, str) or section not in table:
            raise UploadError(who, f"unknown section {brief(section)} "
                                   f"(known: {sorted(table)})")


def check_required(sections: Iterable[str], required: Iterable[str], whose: str,
                   who: str | int) -> None:
    """Every section of ``required`` is among ``sections`` (``whose``: which upload part)."""
    missing = [s for s in required if s not in sections]
    if missing:
        raise UploadError(who, f"{whose} lacks section(s) {missing} this strategy needs")


def check_members(upload: ClientUpload, shapes: ParamShapes, required: tuple[str, ...],
                  who: str | int, limits: UploadLimits, table: SectionTable) -> None:
    """Members, sections and arrays: cheap structural checks of everything first, then the
    values (finite, within the section's ``value_cap``) and each section's validator."""
    members = upload.members
    if not isinstance(members, list) or not members:
        raise UploadError(who, "upload has no members" if isinstance(members, list) else
                          f"members must be a list, got {type(members).__name__}")
    if len(members) > MAX_MEMBERS:
        raise UploadError(who, f"upload has {len(members)} members, expected 1..{MAX_MEMBERS}")
    total = 0
    for m, member in enumerate(members):
        if not isinstance(member, dict):
            raise UploadError(who, f"member {m} is a {type(member).__name__}, not a dict of "
                                   "sections")
        if m > 0 and sorted(map(str, member)) != sorted(map(str, members[0])):
            raise UploadError(who, f"member {m} has sections "
                                   f"{name_list(sorted(map(str, member)))}, member 0 has "
                                   f"{name_list(sorted(map(str, members[0])))}")
        check_section_names(list(member), who, table)
        check_required(member, required, f"member {m}", who)
        for section, arrays in member.items():
            where = f"member {m} section {section!r}"
            if not isinstance(arrays, dict) or len(arrays) > limits.arrays_per_section:
                raise UploadError(who, f"{where}: must be a dict of at most "
                                       f"{limits.arrays_per_section} named arrays")
            for name, array in arrays.items():
                try:
                    total += _check_array(name, array, section, limits)
                except ValueError as exc:
                    raise UploadError(who, f"{where}: {exc}") from exc
                if total > limits.upload_bytes:
                    raise UploadError(who, too_large(total, limits.upload_bytes))
    for m, member in enumerate(members):
        for section, arrays in member.items():
            where = f"member {m} section {section!r}"
            entry = table[section]
            try:
                for name, array in arrays.items():
                    _check_values(name, array, section, entry.value_cap)
                entry.validator(arrays, shapes)
            except Exception as exc:  # validators may raise anything on hostile arrays
                raise UploadError(who, f"{where}: {describe(exc)}") from exc


def _check_array(name: object, array: object, section: str, limits: UploadLimits) -> int:
    """Type, dtype (floats; integer and bool state entries in ``weights`` too) and byte
    order of an in-memory array; returns its byte size."""
    if not isinstance(name, str) or len(name) > limits.name_chars:
        raise ValueError(f"array name {brief(name)} is not a string of at most "
                         f"{limits.name_chars} characters")
    if not isinstance(array, np.ndarray):
        kind = type(array)
        label = f"{kind.__module__}.{kind.__name__}" if kind.__module__.startswith("torch") else (
            kind.__name__)
        raise ValueError(f"array {name!r} is a {label}; uploads hold numpy arrays "
                         "(fedfusion.client.make_upload converts trained models)")
    allowed = UPLOAD_DTYPES if section == WEIGHTS else _FLOAT_DTYPES
    if array.dtype.type not in allowed:
        raise ValueError(f"array {name!r} has dtype {array.dtype}; section {section!r} holds "
                         + ("float16/32/64 arrays and integer or bool state entries"
                            if section == WEIGHTS else "float16, float32 or float64 arrays"))
    if not array.dtype.isnative:
        raise ValueError(f"array {name!r} has non-native byte order ({array.dtype.str}); "
                         "convert it with array.astype(array.dtype.newbyteorder('='))")
    return array.nbytes


def _check_values(name: str, array: np.ndarray, section: str, cap: float) -> None:
    """Finite and ``|v| <= cap``, from the min and max (no temporary of the array's size).
    Integer and bool state entries (counters, masks) are finite by type and not capped."""
    if array.size == 0 or array.dtype.kind in "biu":
        return
    low, high = float(array.min()), float(array.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"array {name!r} has NaN or Inf values")
    peak = max(-low, high)
    if peak > cap:
        raise ValueError(f"array {name!r} has values up to {peak:.3g} in magnitude, above "
                         f"the cap {cap:.3g} on section {section!r}")
