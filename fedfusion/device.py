"""Where a client computes: the device of its models, chosen by the run-config key
``client-device`` in the App and by the caller in the library.

A client's data stays on the CPU; every consumer (training, curvature, Grams, FENS'
features) moves one batch at a time to the device of the model it is given, so a dataset
that does not fit in GPU memory still trains there. Uploads are always built from CPU copies
(:func:`fedfusion.core.state.state_arrays`, :func:`fedfusion.curvature.base.to_numpy`), so their
arrays have the same layout whatever the device.

The device travels in an upload as the metric :data:`DEVICE_METRIC`, an integer (Flower's
metrics are numbers): -1 for the CPU, ``i`` for ``cuda:i``, -2 for another device type (a
library client's model on ``mps``, say).
"""

from __future__ import annotations

import re

import torch
from torch import nn

#: values of the run-config key ``client-device``
CLIENT_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
#: the upload metric that says where the client computed: -1 = CPU, i = ``cuda:i``, -2 =
#: another device type
DEVICE_METRIC = "cuda-device"


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (else buffer); the CPU for a model with
    neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def client_device(name: str, client_id: int | str) -> torch.device:
    """The device run-config ``client-device = name`` means in this process: ``auto`` is
    ``cuda`` (the process's current GPU: the share Ray or the SuperNode gave it) when
    ``torch.cuda.is_available()``, else the CPU; ``cuda`` / ``cuda:i`` must exist here.
    Raises ValueError naming ``client_id`` otherwise."""
    if not CLIENT_DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"client {client_id}: device {name!r} must be 'auto', 'cpu', "
                         "'cuda' or 'cuda:<i>'")
    device = present_device(name, f"client {client_id}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def present_device(name: str | torch.device, who: str) -> torch.device:
    """``name`` as a device this process has: ``auto`` is CUDA when present, else the CPU;
    another name must parse as a torch device, and a CUDA or MPS one must be there. Raises
    ValueError naming ``who`` and the way out otherwise."""
    if isinstance(name, str) and name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{who}: device {str(name)[:40]!r} is not a torch device ('auto', "
                         "'cpu', 'cuda', 'cuda:<i>', 'mps', ...)") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{who}: device {str(name)!r} but this process sees no CUDA device "
                "(torch.cuda.is_available() is False: a CPU-only torch build, no driver, or no "
                "GPU share given, e.g. client-resources-num-gpus=0 in a simulation); use "
                "device 'auto' or 'cpu'")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{who}: device {str(name)!r} but this process sees {count} CUDA "
                             f"device(s), cuda:0..cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{who}: device {str(name)!r} but this process has no MPS device; use "
                         "device 'auto' or 'cpu'")
    return device


def device_metric(device: torch.device) -> int:
    """The :data:`DEVICE_METRIC` value of ``device``: -1 for the CPU, ``i`` for ``cuda:i``,
    -2 for any other device type."""
    if device.type == "cuda":
        return torch.cuda.current_device() if device.index is None else int(device.index)
    return -1 if device.type == "cpu" else -2


def device_label(value: object) -> str | None:
    """``"cpu"`` / ``"cuda:i"`` / ``"other"`` from a :data:`DEVICE_METRIC` value; None where
    it is absent or not such a value (a client that did not report it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -2:
        return None
    return {-1: "cpu", -2: "other"}.get(value, f"cuda:{value}")
