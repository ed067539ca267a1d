"""Where an App client's training data comes from (run-config ``client-data``).

* ``partition`` (the default; simulations and demos): every process derives the same split
  of a built-in dataset (or reads the same ``partition-file``) and node ``partition-id``
  trains those rows; the number of clients is fixed by ``num-clients``.
* ``local`` (real devices): the node trains on its own file, ``data-path`` in its node
  config (:mod:`fedfusion.datasets.local_file`), and nothing else, normalised as the
  server's description in the train config says (:mod:`fedfusion.app.data_description`).
  Devices can join and leave between runs without changing anyone else's data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedfusion.app.config import ConfigError, Settings
from fedfusion.app.data_description import read_data_description
from fedfusion.app.federation import federated_split
from fedfusion.datasets.local_file import LocalDataError, normalise, read_local_data


@dataclass(frozen=True)
class TrainingData:
    """What a client trains on: normalised images, labels, and the dataset's shape."""

    x: torch.Tensor
    y: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int


def training_data(settings: Settings, client_id: int, config: Mapping[str, Any] | None = None
                  ) -> TrainingData:
    """Client ``client_id``'s training data: its rows of the shared split (``client-data =
    'partition'``) or the node's own file ``data-path`` (``'local'``), normalised as the
    server's description in the train config ``config`` says."""
    if settings.client_data != "local":
        split = federated_split(settings)
        x, y = split.client_data(client_id)
        return TrainingData(x, y, split.bundle.input_shape, split.bundle.num_classes)
    if not settings.data_path:
        raise ConfigError(
            f"client {client_id}: the run has client-data='local' but this node has no "
            "data-path: start its SuperNode with --node-config \"data-path='/path/to/data.npz'\"")
    described = read_data_description(config or {}, client_id)
    try:
        data = normalise(read_local_data(settings.data_path, described.input_shape,
                                         described.num_classes), described.mean, described.std)
    except LocalDataError as exc:
        raise LocalDataError(f"client {client_id}: {exc}") from exc
    return TrainingData(data.x, data.y, described.input_shape, described.num_classes)
