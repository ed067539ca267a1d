"""How a ``client-data='local'`` server describes its data to the devices, both sides.

The devices' own files hold raw pixels; the server sends, in every train config, the image
shape ``[C, H, W]``, the class count and the per-channel normalisation of its test set
(:func:`data_description`), and each device checks its file against them and normalises it
with them (:func:`read_data_description`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedfusion.app.config import ConfigError

#: the train-config keys of the description
DATA_DESCRIPTION_KEYS = ("data.input-shape", "data.num-classes", "data.input-mean",
                         "data.input-std")


@dataclass(frozen=True)
class DataDescription:
    """What a device's file must match (shape, classes) and how to normalise it."""

    input_shape: tuple[int, ...]
    num_classes: int
    mean: list[float]
    std: list[float]


def data_description(input_shape: Sequence[int], num_classes: int, mean: Sequence[float],
                     std: Sequence[float]) -> dict[str, Any]:
    """The server's side: the train-config entries (:data:`DATA_DESCRIPTION_KEYS`)."""
    return dict(zip(DATA_DESCRIPTION_KEYS, (
        [int(v) for v in input_shape], int(num_classes), [float(v) for v in mean],
        [float(v) for v in std]), strict=True))


def read_data_description(config: Mapping[str, Any], client_id: int) -> DataDescription:
    """The device's side: the description in the server's train ``config``; ConfigError
    naming ``client_id`` where it is missing (a server not on ``client-data='local'``),
    malformed, or not a shape of 3 positive sizes, >= 1 class and finite statistics with
    every std > 0."""
    missing = [key for key in DATA_DESCRIPTION_KEYS if key not in config]
    if missing:
        raise ConfigError(f"client {client_id}: the server's train config lacks {missing}: it "
                          "must run fedfusion with client-data='local' as well")
    try:
        shape = tuple(int(v) for v in config["data.input-shape"])
        num_classes = int(config["data.num-classes"])
        mean = [float(v) for v in config["data.input-mean"]]
        std = [float(v) for v in config["data.input-std"]]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"client {client_id}: malformed data description in the train "
                          f"config: {exc}") from exc
    if len(shape) != 3 or min(shape) < 1 or num_classes < 1 or not all(
            math.isfinite(v) for v in mean + std) or not all(v > 0 for v in std):
        raise ConfigError(f"client {client_id}: invalid data description in the train config: "
                          f"shape {shape}, {num_classes} classes, mean {mean}, std {std}")
    return DataDescription(shape, num_classes, mean, std)
