"""Validation of a client upload: the caps on what one client may send, the checks of a
:class:`~fedfusion.wire.format.ClientUpload` (:func:`validate_upload`) and the registry of
upload sections and their validators (:func:`register_section`).

A bad upload raises :class:`UploadError` naming the client and the problem, and nothing else.
The caps are module-level so that a deployment can change them (here, in this module).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from fedfusion.core.state import WIRE_DTYPES, StateLayout
from fedfusion.device import DEVICE_METRIC, device_label
from fedfusion.wire.format import MAX_MEMBERS, WEIGHTS, ClientUpload, ParamShapes

# ---- caps on what one client may send (module-level so that a deployment can change them)
#: default cap on the bytes of one client's arrays (as declared, checked before decoding);
#: ``decode_upload(max_upload_bytes=...)`` / ``validate_upload(max_upload_bytes=...)``
MAX_UPLOAD_BYTES = 2 * 1024**3
#: ``num-examples`` above this is refused (a weight in FedAvg-style averages)
MAX_NUM_EXAMPLES = 10**9
#: ``model-kwargs`` is JSON of at most this many characters and nesting levels, checked
#: before ``json.loads`` (deep nesting makes the parser recurse until RecursionError)
MAX_KWARGS_CHARS = 4096
MAX_KWARGS_DEPTH = 16
#: model, section, array and metric names
MAX_NAME_CHARS = 256
#: arrays in one member's section (a Kron section holds 4 per parameter)
MAX_ARRAYS_PER_SECTION = 65536
MAX_NDIM = 32
#: metrics in ``fedfusion.metrics`` and the length of a list-valued one
MAX_METRICS = 1024
MAX_METRIC_LENGTH = 65536
#: an exclusion reason is clipped to this many characters (it lands in logs and results.json)
MAX_REASON_CHARS = 2000

# ---- magnitude caps per section: every value of every array must satisfy |v| <= cap.
# Measured on honest uploads (bias-free LeNet trained 20 epochs on all 59,800 FMNIST training
# samples in ONE client, the largest a client here gets; MLP 2x100 likewise, 5 epochs):
# weights <= 1.5; curvature <= 1.7e4 (diag GGN; Kron factor eigenvalues <= 5.2e3, diag_full
# block <= 1.6e4), i.e. about 0.3 per sample, as the GGN is a sum over samples; Gram matrices
# <= 3.8e7 (conv1 of LeNet, summed over samples and 576 positions).
#: weights: 7000x the largest honest value; bias-free nets far from it diverged anyway
MAX_ABS_WEIGHT = 1e4
#: curvature entries (Kron eigenvalues, GGN diagonals and blocks): 0.3 per sample for
#: MAX_NUM_EXAMPLES samples stays below it. It keeps FedBEns' float32 objective finite: a
#: Kron eigenvalue is a product of two entries, so the quadratic form is at most
#: ||w - m||^2 * cap^2 / T <= (2 * MAX_ABS_WEIGHT)^2 * d * 1e18 / T, 4e35 for d = 1e6
#: parameters and T = 0.01, below float32's 3.4e38.
MAX_ABS_CURVATURE = 1e9
#: RegMean Gram matrices: 2.6e7x the largest honest value (they grow with samples x positions)
MAX_ABS_GRAM = 1e15
#: any other registered section
MAX_ABS_DEFAULT = 1e15
#: section name (or prefix ending in ".") -> cap; :func:`value_cap` looks a section up here
MAX_ABS_VALUES: dict[str, float] = {
    "weights": MAX_ABS_WEIGHT,
    "curvature.": MAX_ABS_CURVATURE,
    "gram": MAX_ABS_GRAM,
}

SectionValidator = Callable[[Mapping[str, np.ndarray], ParamShapes], None]
_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
#: dtypes of the ``weights`` section beyond floats: a ``state_dict``'s integer counters and
#: bool / uint8 buffers (:mod:`fedfusion.core.state`); every other section holds floats only
_STATE_DTYPES = tuple(dict.fromkeys(d.type for d in WIRE_DTYPES.values()))
#: metrics the server turns into numbers (results.json): finite and >= 0
_TIMING_METRICS = ("train-time-s", "stats-time-s")
_TIMING_PREFIX = "time-s/"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` clipped: client-controlled values appear in reasons, never in full."""
    return _clip(repr(value), limit)


def _names(names: Sequence[str], limit: int = 8) -> str:
    """``['a', 'b']``, or the first ``limit`` names and how many more."""
    names = [_clip(str(n), 60) for n in names]
    if len(names) <= limit:
        return str(names)
    return f"{str(names[:limit])[:-1]}, ... ({len(names) - limit} more)]"


class UploadError(ValueError):
    """A client upload that cannot be used; ``client`` says whose, the message says why
    (clipped to :data:`MAX_REASON_CHARS`)."""

    def __init__(self, client: str | int, problem: str):
        self.client = _clip(str(client), 100)
        self.problem = _clip(str(problem), MAX_REASON_CHARS)
        super().__init__(f"client {self.client}: {self.problem}")


def value_cap(section: str) -> float:
    """The magnitude cap on ``section``'s values: its entry in :data:`MAX_ABS_VALUES`, else
    the longest prefix entry (``"curvature."``) it starts with, else :data:`MAX_ABS_DEFAULT`."""
    if section in MAX_ABS_VALUES:
        return MAX_ABS_VALUES[section]
    prefixes = [p for p in MAX_ABS_VALUES if p.endswith(".") and section.startswith(p)]
    return MAX_ABS_VALUES[max(prefixes, key=len)] if prefixes else MAX_ABS_DEFAULT



def validate_upload(
    upload: ClientUpload,
    param_shapes: Callable[[str, dict[str, object]], ParamShapes],
    required_sections: Iterable[str] = (WEIGHTS,),
    client: str | int | None = None,
    *,
    max_upload_bytes: int = MAX_UPLOAD_BYTES,
) -> None:
    """Check everything a strategy relies on; raise :class:`UploadError` on the first problem
    (and no other exception): field types, counts, ``num-examples`` against the class
    histogram, the model, every array's type, dtype, byte order, finiteness and magnitude
    (:func:`value_cap`), the total bytes, and each section's registered validator."""
    who = getattr(upload, "client_id", "?") if client is None else client
    try:
        if not isinstance(upload, ClientUpload):
            raise UploadError(who, f"expected a ClientUpload, got {type(upload).__name__}")
        _check_header(upload, who)
        shapes = _expected_shapes(upload, param_shapes, who)
        _check_members(upload, shapes, tuple(required_sections), who, max_upload_bytes)
    except UploadError:
        raise
    except Exception as exc:  # the last net, as in decode_upload
        raise UploadError(who, f"malformed upload: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    """An exception as a reason: ValueError/TypeError messages as they are, others typed."""
    if type(exc) in (ValueError, TypeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _too_large(total: int, cap: int) -> str:
    return (f"the arrays declare more than {cap} bytes (at least {total}), above the cap "
            "on one client's upload (max_upload_bytes); refused before decoding")


def _check_header(upload: ClientUpload, who: str | int) -> None:
    """Everything but the arrays: ids, model name and kwargs, counts, metrics."""
    client_id = upload.client_id
    if isinstance(client_id, bool) or not isinstance(client_id, int) or not (
            0 <= client_id < 2**31):
        raise UploadError(who, f"client-id must be an int in 0..2**31-1, got {_brief(client_id)}")
    if not isinstance(upload.model, str) or not 0 < len(upload.model) <= MAX_NAME_CHARS:
        raise UploadError(who, f"model must be a name of 1..{MAX_NAME_CHARS} characters, got "
                               f"{_brief(upload.model)}")
    if not isinstance(upload.model_kwargs, dict):
        raise UploadError(who, "model-kwargs must be a JSON object")
    try:
        text = json.dumps(upload.model_kwargs, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UploadError(who, f"model-kwargs is not plain JSON: {_describe(exc)}") from exc
    _check_kwargs_text(text, who)
    num_examples = upload.num_examples
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or not (
            1 <= num_examples <= MAX_NUM_EXAMPLES):
        raise UploadError(who, f"num-examples must be a positive int <= {MAX_NUM_EXAMPLES}, "
                               f"got {_brief(num_examples)}")
    _check_metrics(upload.metrics, num_examples, who)


def _check_metrics(metrics: object, num_examples: int, who: str | int) -> None:
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        raise UploadError(who, f"metrics must be a mapping of at most {MAX_METRICS} entries")
    for key, value in metrics.items():
        if not isinstance(key, str) or len(key) > MAX_NAME_CHARS:
            raise UploadError(who, f"metric name {_brief(key)} is not a short string")
        items = value if isinstance(value, list) else [value]
        if len(items) > MAX_METRIC_LENGTH or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in items):
            raise UploadError(who, f"metric {key!r} must be a number or a list of at most "
                                   f"{MAX_METRIC_LENGTH} numbers, got {_brief(value)}")
        if key in _TIMING_METRICS or key.startswith(_TIMING_PREFIX) or (
                key == "contrastive-members"):
            if isinstance(value, list) or value < 0 or (
                    isinstance(value, float) and not math.isfinite(value)):
                raise UploadError(who, f"metric {key!r} must be a finite number >= 0, got "
                                       f"{_brief(value)}")
    device = metrics.get(DEVICE_METRIC)
    if device is not None and device_label(device) is None:
        raise UploadError(who, f"metric {DEVICE_METRIC!r} must be an integer >= -2 (-1: CPU, "
                               f"i: cuda:i, -2: another device), got {_brief(device)}")
    histogram = metrics.get("class-histogram")
    if histogram is not None:
        if not isinstance(histogram, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in histogram):
            raise UploadError(who, "metric 'class-histogram' must be a list of ints >= 0, got "
                                   f"{_brief(histogram)}")
        if sum(histogram) != num_examples:
            raise UploadError(who, f"num-examples is {num_examples} but the class histogram "
                                   f"sums to {sum(histogram)}")


def _check_kwargs_text(text: str, who: str | int) -> None:
    if len(text) > MAX_KWARGS_CHARS:
        raise UploadError(who, f"model-kwargs is {len(text)} characters of JSON, the cap is "
                               f"{MAX_KWARGS_CHARS}")
    depth = _json_depth(text)
    if depth > MAX_KWARGS_DEPTH:
        raise UploadError(who, f"model-kwargs nests {depth} levels deep, the cap is "
                               f"{MAX_KWARGS_DEPTH}")


def _json_depth(text: str) -> int:
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



def _expected_shapes(upload: ClientUpload,
                     param_shapes: Callable[[str, dict[str, object]], ParamShapes],
                     who: str | int) -> ParamShapes:
    """``param_shapes`` of the declared model; ANY exception it raises (an unknown model, a
    kwarg out of range, a RecursionError or MemoryError of an absurd one) is the client's."""
    try:
        return param_shapes(upload.model, upload.model_kwargs)
    except Exception as exc:
        raise UploadError(who, f"model {_brief(upload.model)} cannot be built with model-kwargs "
                               f"{_brief(upload.model_kwargs)}: {_describe(exc)}") from exc


def _check_section_names(sections: Sequence[object], who: str | int) -> None:
    if len(sections) > len(_SECTION_VALIDATORS) or len(set(map(str, sections))) != len(
            sections):
        raise UploadError(who, f"sections must be distinct known sections, got "
                               f"{_brief(sections)}")
    for section in sections:
        if not isinstance(section, str) or section not in _SECTION_VALIDATORS:
            raise UploadError(who, f"unknown section {_brief(section)} "
                                   f"(known: {known_sections()})")


def _check_required(sections: Iterable[str], required: Iterable[str], whose: str,
                    who: str | int) -> None:
    missing = [s for s in required if s not in sections]
    if missing:
        raise UploadError(who, f"{whose} lacks section(s) {missing} this strategy needs")



def _checked_shape(name: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, tuple | list) or len(shape) > MAX_NDIM or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**62 for s in shape):
        raise ValueError(f"array {name!r} has shape {_brief(shape)}, not a tuple of at most "
                         f"{MAX_NDIM} sizes >= 0")
    return tuple(shape)



def _check_members(upload: ClientUpload, shapes: ParamShapes, required: tuple[str, ...],
                   who: str | int, max_upload_bytes: int) -> None:
    """Members, sections and arrays: cheap structural checks of everything first, then the
    values (finite, within :func:`value_cap`) and each section's validator."""
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
            raise UploadError(who, f"member {m} has sections {_names(sorted(map(str, member)))}"
                                   f", member 0 has {_names(sorted(map(str, members[0])))}")
        _check_section_names(list(member), who)
        _check_required(member, required, f"member {m}", who)
        for section, arrays in member.items():
            where = f"member {m} section {section!r}"
            if not isinstance(arrays, dict) or len(arrays) > MAX_ARRAYS_PER_SECTION:
                raise UploadError(who, f"{where}: must be a dict of at most "
                                       f"{MAX_ARRAYS_PER_SECTION} named arrays")
            for name, array in arrays.items():
                try:
                    total += _check_array(name, array, section)
                except ValueError as exc:
                    raise UploadError(who, f"{where}: {exc}") from exc
                if total > max_upload_bytes:
                    raise UploadError(who, _too_large(total, max_upload_bytes))
    for m, member in enumerate(members):
        for section, arrays in member.items():
            where = f"member {m} section {section!r}"
            cap = value_cap(section)
            try:
                for name, array in arrays.items():
                    _check_values(name, array, section, cap)
                _SECTION_VALIDATORS[section](arrays, shapes)
            except Exception as exc:  # validators may raise anything on hostile arrays
                raise UploadError(who, f"{where}: {_describe(exc)}") from exc


def _check_array(name: object, array: object, section: str = WEIGHTS) -> int:
    """Type, dtype (floats; integer and bool state entries in ``weights`` too) and byte
    order of an in-memory array; returns its byte size."""
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"array name {_brief(name)} is not a string of at most "
                         f"{MAX_NAME_CHARS} characters")
    if not isinstance(array, np.ndarray):
        kind = type(array)
        label = f"{kind.__module__}.{kind.__name__}" if kind.__module__.startswith("torch") else (
            kind.__name__)
        raise ValueError(f"array {name!r} is a {label}; uploads hold numpy arrays "
                         "(fedfusion.client.make_upload converts trained models)")
    allowed = _STATE_DTYPES if section == WEIGHTS else _FLOAT_DTYPES
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


def check_array_names(arrays: Mapping[str, object], expected: Iterable[str],
                      missing_label: str = "missing array(s)", extra_hint: str = "") -> None:
    """Raise ValueError naming the arrays that are missing from, or not expected in, ``arrays``."""
    expected = set(expected)
    missing = sorted(expected - set(arrays))
    extra = sorted(map(str, set(arrays) - expected))
    if missing:
        raise ValueError(f"{missing_label} {_names(missing)}")
    if extra:
        raise ValueError(f"unexpected array(s) {_names(extra)}{extra_hint}")


def _check_weight_shapes(actual: Mapping[str, tuple[int, ...]], shapes: ParamShapes,
                         dtypes: Mapping[str, np.dtype] | None = None) -> None:
    """The weights' names and shapes are exactly the model's ``state_dict``'s (``actual``:
    name -> shape), and, where ``shapes`` is a :class:`~fedfusion.core.state.StateLayout` and
    ``dtypes`` (name -> dtype) is given, so are their wire dtypes (a float where the model
    keeps an integer counter is refused, as is an integer parameter)."""
    check_array_names(actual, shapes, extra_hint=" (not in the server model's state_dict)")
    for name, shape in shapes.items():
        kind = "buffer" if isinstance(shapes, StateLayout) and name in shapes.buffers else (
            "array")
        if tuple(actual[name]) != tuple(shape):
            raise ValueError(
                f"{kind} {name!r} has shape {tuple(actual[name])}, expected {tuple(shape)}")
        if dtypes is not None and isinstance(shapes, StateLayout) and (
                dtypes[name].newbyteorder("=") != shapes.wire_dtype(name)):
            raise ValueError(f"{kind} {name!r} has dtype {dtypes[name]}, the server model's "
                             f"entry is {shapes.dtypes[name]} (sent as "
                             f"{shapes.wire_dtype(name)})")


def _validate_weights(arrays: Mapping[str, np.ndarray], shapes: ParamShapes) -> None:
    _check_weight_shapes({name: array.shape for name, array in arrays.items()}, shapes,
                         {name: array.dtype for name, array in arrays.items()})


_SECTION_VALIDATORS: dict[str, SectionValidator] = {WEIGHTS: _validate_weights}


def register_section(name: str, validator: SectionValidator) -> None:
    """Declare an upload section and how to check it (raise ValueError naming the array)."""
    _SECTION_VALIDATORS[name] = validator


def known_sections() -> list[str]:
    return sorted(_SECTION_VALIDATORS)
