"""Local training: plain mini-batch SGD with momentum, deterministic given a seed.

The loop indexes one in-memory tensor per client instead of going through a DataLoader:
on a CPU core a LeNet step costs a few milliseconds, and the DataLoader's per-batch
collation would be a sizeable share of it.

The objective is the cross-entropy plus optional :data:`LossTerm` s: FedProx's
:class:`ProximalTerm` (here) and MOON's model-contrastive term
(:class:`fedfusion.contrastive.ContrastiveTerm`). Without terms the loop is plain SGD.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 20
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 64


@dataclass(frozen=True)
class TrainStats:
    seconds: float
    samples: int
    final_loss: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)


#: an extra loss added to every step's cross-entropy, called with the batch inputs right
#: after the model's forward pass on them (so a hook may reuse that pass's activations)
LossTerm = Callable[[torch.Tensor], torch.Tensor]


class ProximalTerm:
    """FedProx (Li et al., 2020): ``mu / 2 * ||w - w_ref||^2`` over the model's parameters.

    ``reference`` (parameter name -> tensor) defaults to a copy of the model's parameters
    when the term is built, i.e. the global model the client just received."""

    def __init__(self, model: nn.Module, mu: float,
                 reference: Mapping[str, torch.Tensor] | None = None):
        if not mu >= 0:
            raise ValueError(f"the proximal mu must be >= 0, got {mu}")
        self.mu = mu
        self.params = dict(model.named_parameters())
        if reference is None:
            reference = {k: p.detach().clone() for k, p in self.params.items()}
        missing = sorted(set(self.params) - set(reference))
        if missing:
            raise ValueError(f"the proximal reference lacks parameters {missing}")
        self.reference = {k: torch.as_tensor(reference[k]).detach() for k in self.params}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mu / 2 * sum((p - self.reference[k]).pow(2).sum()
                                 for k, p in self.params.items())


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    seed: int,
    loss_terms: Sequence[LossTerm] = (),
) -> TrainStats:
    """Train ``model`` in place on ``(x, y)`` with SGD; the batch order depends on ``seed`` only.

    Each step minimises ``cross_entropy + sum(term(x_batch) for term in loss_terms)``."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    model.train()
    n = len(y)
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(config.epochs):
        order = torch.randperm(n, generator=generator)
        for begin in range(0, n, config.batch_size):
            batch = order[begin : begin + config.batch_size]
            optimizer.zero_grad(set_to_none=True)
            inputs = x[batch]
            loss = F.cross_entropy(model(inputs), y[batch])
            for term in loss_terms:
                loss = loss + term(inputs)
            loss.backward()
            optimizer.step()
    model.eval()
    return TrainStats(
        seconds=time.perf_counter() - start,
        samples=n * config.epochs,
        final_loss=float(loss.detach()),
    )
