"""The upload format: what a client sends (:class:`ClientUpload`), the record keys it travels
under, and the broadcast of M models.

:func:`encode_upload` writes an upload into a train reply's ``content`` RecordDict (the layout
is in :mod:`fedfusion.wire`); :func:`fedfusion.wire.decode.decode_upload` reads one back,
checking it. :func:`encode_models` / :func:`decode_models` carry the server's M models to the
clients. Nothing here checks anything: see :mod:`fedfusion.wire.validation`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedfusion.sections.base import WEIGHTS

SCHEMA = "fedfusion.upload"
SCHEMA_VERSION = 1
META_KEY = "fedfusion.meta"
METRICS_KEY = "fedfusion.metrics"
MAX_MEMBERS = 64

NumpyDict = dict[str, np.ndarray]
ParamShapes = Mapping[str, tuple[int, ...]]


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
    #: the client id the upload claimed, kept as a label where the server decided
    #: ``client_id`` from the node (:mod:`fedfusion.flower.identity`); None without Flower
    claimed_client_id: int | None = field(default=None, compare=False)
    #: how the server decided ``client_id``: "claimed" (the claim, honoured), "registered"
    #: (the node's id from an earlier round), "registry" (the operator's registry), "server"
    #: (a fresh id: the claim collided); "" without Flower
    client_id_source: str = field(default="", compare=False)

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


def _c_order(array: np.ndarray) -> np.ndarray:
    """``array`` in C order, its shape kept (``np.ascontiguousarray`` turns a 0-d array, e.g.
    BatchNorm's ``num_batches_tracked``, into shape ``(1,)``)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


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
                {name: Array(_c_order(a)) for name, a in arrays.items()})
    return content


def encode_models(state_dicts: Sequence[Mapping[str, np.ndarray]]) -> ArrayRecord:
    """Server broadcast: M models in one ArrayRecord, keys ``"{m}/{param}"``."""
    return ArrayRecord(
        {
            f"{m}/{name}": Array(_c_order(a))
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
