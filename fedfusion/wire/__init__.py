"""The wire format: the client upload, one versioned format in Flower records shared by every
strategy, and the server's broadcast of M models.

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
more (curvature, Gram matrices, statistics) ask the clients for further sections, each an
entry of the section table (:data:`fedfusion.sections.SECTIONS`: builder, validator, value
cap) that decoding and validation are given. Arrays travel as ``.npy`` bytes (Flower's
``Array``), never pickled.

Decoding (:func:`decode_upload`) and loading from disk (:mod:`fedfusion.upload_store`) both
end in :func:`validate_upload`: schema version, model, array names, dtypes, shapes,
finiteness and magnitude. A bad upload raises :class:`UploadError` naming the client and the
problem, and nothing else: whatever goes wrong while decoding or validating ONE client's
upload (a malformed record, an absurd architecture, a library error) becomes an
:class:`UploadError`, so the strategy excludes that client and the round goes on.

Every input is untrusted, and checking it must not cost more than the honest upload would:

* cost before validation: :func:`decode_upload` checks the metadata, the declared model
  (``model-kwargs`` is capped in length and nesting depth before it is parsed), then every
  array's name, dtype, shape and byte size from the flwr ``Array``'s own fields, the total
  against :attr:`UploadLimits.upload_bytes`, and only then decodes the bytes,
  after checking that each ``.npy`` header agrees with the declared fields. An upload that
  declares 10**12 elements is refused without allocating them.
* numbers: ``num-examples`` is capped (:attr:`UploadLimits.num_examples`) and must equal the
  sum of ``class-histogram`` when the client sends one; every array value is finite and
  within the magnitude cap of its section (``Section.value_cap``), so finite but absurd values
  (weights or curvature of 1e20) cannot drive a strategy's objective to inf or NaN.
* arrays in a non-native byte order (``'>f4'``) are converted to native when decoded;
  :func:`validate_upload` refuses them in a :class:`ClientUpload` built in memory.

The caps on one client's upload are one frozen value, :class:`UploadLimits` (the documented
defaults unless given another), passed to :func:`decode_upload` and :func:`validate_upload`
by the strategy that holds it (``upload_limits=`` of every strategy).

The modules, each importing only those listed before it:

* :mod:`fedfusion.wire.format`: :class:`ClientUpload`, the schema and record keys,
  :func:`encode_upload`, :func:`encode_models` / :func:`decode_models`;
* :mod:`fedfusion.wire.limits`: :class:`UploadLimits`;
* :mod:`fedfusion.wire.npy`: ``.npy`` headers checked before any data is read;
* :mod:`fedfusion.wire.validation`: :class:`UploadError`, :func:`validate_upload` and the
  checks it shares with decoding;
* :mod:`fedfusion.wire.decode`: :func:`decode_upload`, :func:`decode_array`.
"""

from fedfusion.wire.decode import decode_array, decode_upload
from fedfusion.wire.format import (
    MAX_MEMBERS,
    META_KEY,
    METRICS_KEY,
    SCHEMA,
    SCHEMA_VERSION,
    WEIGHTS,
    ClientUpload,
    NumpyDict,
    ParamShapes,
    decode_models,
    encode_models,
    encode_upload,
    member_key,
)
from fedfusion.wire.limits import DEFAULT_LIMITS, UploadLimits
from fedfusion.wire.npy import MAX_NDIM, MAX_NPY_HEADER_CHARS, read_npy
from fedfusion.wire.validation import MAX_REASON_CHARS, UploadError, validate_upload

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_MEMBERS",
    "MAX_NDIM",
    "MAX_NPY_HEADER_CHARS",
    "MAX_REASON_CHARS",
    "META_KEY",
    "METRICS_KEY",
    "SCHEMA",
    "SCHEMA_VERSION",
    "WEIGHTS",
    "ClientUpload",
    "NumpyDict",
    "ParamShapes",
    "UploadError",
    "UploadLimits",
    "decode_array",
    "decode_models",
    "decode_upload",
    "encode_models",
    "encode_upload",
    "member_key",
    "read_npy",
    "validate_upload",
]
