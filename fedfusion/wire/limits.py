"""The caps on what one client may upload, as one frozen value (:class:`UploadLimits`).

A strategy holds one (``upload_limits=`` of every strategy's constructor) and passes it to
:func:`fedfusion.wire.decode_upload` and :func:`fedfusion.wire.validate_upload`; a deployment
that wants other caps passes its own, e.g. ``UploadLimits(upload_bytes=8 * 1024**3)``. The
caps on values per section belong to the section table (:mod:`fedfusion.sections`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UploadLimits:
    """Caps on one client's upload, checked before anything they bound is allocated or
    parsed.

    ``upload_bytes``: the bytes of one client's arrays, as declared (checked before
    decoding). ``num_examples``: ``num-examples`` above it is refused (a weight in
    FedAvg-style averages). ``kwargs_chars`` / ``kwargs_depth``: ``model-kwargs`` is JSON of
    at most this many characters and nesting levels, checked before it is parsed (deep
    nesting makes the parser recurse until RecursionError). ``name_chars``: model, section,
    array and metric names. ``arrays_per_section``: arrays in one member's section (a Kron
    section holds 4 per parameter). ``metrics`` / ``metric_length``: entries of
    ``fedfusion.metrics`` and the length of a list-valued one; ``metrics_chars``: all of
    them as JSON (an honest client's are about 1 KB; a 65,536-class histogram about 0.4 MB):
    it bounds each client's entry in an upload folder's manifest."""

    upload_bytes: int = 2 * 1024**3
    num_examples: int = 10**9
    kwargs_chars: int = 4096
    kwargs_depth: int = 16
    name_chars: int = 256
    arrays_per_section: int = 65536
    metrics: int = 1024
    metric_length: int = 65536
    metrics_chars: int = 1024**2

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"UploadLimits.{name} must be an int >= 1, got {value!r}")


#: the documented defaults
DEFAULT_LIMITS = UploadLimits()
