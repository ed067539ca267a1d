"""FENS' aggregator training, without Flower: the clients' features, a client's local epochs,
the server's FedAdam / FedAvg step on the aggregator.

The features of an input x are the K uploaded models' log-probabilities z(x) ``[K, C]``
(:func:`~fedfusion.strategies.fens.predictor.member_log_probs`), computed once per client on the
rows it held out of local training. The aggregator g
(:class:`~fedfusion.strategies.fens.predictor.LogitAggregator`) minimises the cross-entropy of
softmax(g(z)) over every client's held-out rows, by federated rounds: each client takes
``epochs`` passes of SGD over its rows from the global g, the server moves g by the
sample-weighted mean update Delta = sum_i n_i (g_i - g) / sum_i n_i:

* ``fedavg``: g <- g + Delta;
* ``fedadam`` (Reddi et al., ICLR 2021, FENS' choice): m <- b1 m + (1 - b1) Delta,
  v <- b2 v + (1 - b2) Delta^2, g <- g + lr m / (sqrt(v) + tau).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import nn
from torch.nn import functional as F

from fedfusion.device import model_device
from fedfusion.grad_mode import gradients_on
from fedfusion.strategies.fens.predictor import LogitAggregator, member_log_probs
from fedfusion.wire import DEFAULT_LIMITS, UploadLimits, decode_array

#: train-config keys of an aggregator round (the client helpers read them)
PHASE_KEY, PHASE_AGGREGATOR = "fens.phase", "aggregator"
HIDDEN_KEY, NUM_MODELS_KEY, NUM_CLASSES_KEY = "fens.hidden", "fens.num-models", "fens.num-classes"
#: the records of an aggregator round: the global g, and (once per client) the K models
AGGREGATOR_RECORD, MODELS_RECORD = "aggregator", "models"
SERVER_OPTIMIZERS = ("fedadam", "fedavg")


def decode_aggregator(record: object, shapes: Mapping[str, tuple[int, ...]],
                      limits: UploadLimits = DEFAULT_LIMITS) -> dict[str, torch.Tensor]:
    """The aggregator the other side sent (the server to a device, a device back), decoded
    as uploads are: an ``ArrayRecord`` holding every entry of ``shapes``, each a float array
    of that shape whose ``.npy`` header agrees (:func:`~fedfusion.wire.decode_array`), as
    float32 tensors. Raises ValueError naming what is wrong."""
    if not isinstance(record, ArrayRecord):
        raise ValueError(f"record {AGGREGATOR_RECORD!r} is a {type(record).__name__}, not an "
                         "ArrayRecord")
    missing = sorted(set(shapes) - set(record.keys()))
    if missing:
        raise ValueError(f"the aggregator lacks {missing}")
    return {name: torch.from_numpy(decode_array(name, record[name], shape, limits)
                                   .astype(np.float32)) for name, shape in shapes.items()}


#: a server's aggregator round asks a device for at most this many epochs, of batches of at
#: most this many rows (FENS' own: one epoch of 64)
MAX_LOCAL_EPOCHS = 1000
MAX_BATCH_SIZE = 2**20


@dataclass(frozen=True)
class LocalTraining:
    """A client's part of one aggregator round: ``epochs`` passes of SGD over its rows."""

    epochs: int = 1
    lr: float = 0.1
    momentum: float = 0.9
    batch_size: int = 64

    #: train-config key -> field
    KEYS: ClassVar[dict[str, str]] = {"fens.local-epochs": "epochs", "fens.lr": "lr",
                                      "fens.momentum": "momentum",
                                      "fens.batch-size": "batch_size"}

    def __post_init__(self) -> None:
        if not (1 <= self.epochs <= MAX_LOCAL_EPOCHS and 1 <= self.batch_size <= MAX_BATCH_SIZE
                and self.lr > 0 and 0 <= self.momentum < 1 and np.isfinite(self.lr)):
            raise ValueError(f"FENS local training needs epochs in 1..{MAX_LOCAL_EPOCHS}, "
                             f"batch_size in 1..{MAX_BATCH_SIZE}, lr > 0 and momentum in "
                             f"[0, 1), got {self}")

    def to_config(self) -> dict[str, float | int]:
        return {key: getattr(self, name) for key, name in self.KEYS.items()}

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> LocalTraining:
        values = {}
        for key, name in cls.KEYS.items():
            value = config.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    np.isfinite(value)):
                raise ValueError(f"train config {key!r} must be a finite number, got "
                                 f"{value!r}")
            values[name] = int(value) if name in ("epochs", "batch_size") else float(value)
        return cls(**values)


@torch.no_grad()
def features(models: Sequence[nn.Module], x: torch.Tensor, batch_size: int = 1000
             ) -> torch.Tensor:
    """``[N, K, C]``: every model's log-probabilities on every row of ``x`` (eval mode),
    computed on the models' device (``x`` moved there a batch at a time), returned on the
    CPU."""
    for model in models:
        model.eval()
    device = model_device(models[0]) if models else torch.device("cpu")
    return torch.cat([member_log_probs(models, x[i:i + batch_size].to(device)).float().cpu()
                      for i in range(0, len(x), batch_size)]) if len(x) else torch.empty(0)


@gradients_on()
def train_locally(aggregator: LogitAggregator, z: torch.Tensor, y: torch.Tensor,
                  training: LocalTraining, seed: int) -> float:
    """``training.epochs`` passes of SGD on the cross-entropy of ``aggregator`` over
    (z, y), batches shuffled by ``seed``; returns the last epoch's mean loss. The
    aggregator trains on its own device, ``(z, y)`` moved there a batch at a time."""
    device = model_device(aggregator)
    optimizer = torch.optim.SGD(aggregator.parameters(), lr=training.lr,
                                momentum=training.momentum)
    generator = torch.Generator().manual_seed(seed)
    loss_sum = 0.0
    for _ in range(training.epochs):
        loss_sum = 0.0
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), training.batch_size):
            index = order[start:start + training.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(aggregator(z[index].to(device)),
                                   y[index].long().to(device))
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(index)
    return loss_sum / max(len(y), 1)


class ServerOptimizer:
    """The server's step on g from the clients' new g_i (see the module docstring)."""

    def __init__(self, kind: str = "fedadam", lr: float = 0.01, betas: tuple[float, float] =
                 (0.9, 0.99), tau: float = 1e-3):
        if kind not in SERVER_OPTIMIZERS:
            raise ValueError(f"server optimizer {kind!r}: choose one of {SERVER_OPTIMIZERS}")
        if not (lr > 0 and tau > 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"FedAdam needs lr > 0, tau > 0, betas in [0, 1), got lr {lr}, "
                             f"tau {tau}, betas {betas}")
        self.kind, self.lr, self.betas, self.tau = kind, lr, betas, tau
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def step(self, state: Mapping[str, torch.Tensor],
             client_states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
             ) -> dict[str, torch.Tensor]:
        """The next global state from the current one and the clients' (weighted)."""
        total = float(sum(weights))
        if not client_states or total <= 0:
            return {k: v.clone() for k, v in state.items()}
        new = {}
        for name, value in state.items():
            delta = sum(w * (c[name] - value) for c, w in zip(client_states, weights,
                                                                strict=True)) / total
            if self.kind == "fedavg":
                new[name] = value + delta
                continue
            b1, b2 = self.betas
            self.m[name] = b1 * self.m.get(name, torch.zeros_like(value)) + (1 - b1) * delta
            self.v[name] = b2 * self.v.get(name, torch.zeros_like(value)) + (1 - b2) * delta**2
            new[name] = value + self.lr * self.m[name] / (self.v[name].sqrt() + self.tau)
        return new
