"""Local training: plain mini-batch SGD with momentum, deterministic given a seed.

The loop indexes one in-memory tensor per client instead of going through a DataLoader:
on a CPU core a LeNet step costs a few milliseconds, and the DataLoader's per-batch
collation would be a sizeable share of it.
"""

from __future__ import annotations

import time
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


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    seed: int,
) -> TrainStats:
    """Train ``model`` in place on ``(x, y)`` with SGD; the batch order depends on ``seed`` only."""
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
            loss = F.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
    model.eval()
    return TrainStats(
        seconds=time.perf_counter() - start,
        samples=n * config.epochs,
        final_loss=float(loss.detach()),
    )
