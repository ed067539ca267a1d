"""The example's own model, data, split and training loop: nothing here comes from fedfusion."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

NUM_CLASSES = 10
VAL_SIZE, TEST_FRACTION, MIN_ROWS = 150, 0.3, 20


class DigitsNet(nn.Module):
    """conv3(1->8) - conv3(8->16) - fc(256->hidden) - fc(hidden->10), ReLU, with biases;
    ``batch_norm``: a BatchNorm2d after each convolution (running statistics as buffers)."""

    def __init__(self, hidden: int = 64, batch_norm: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.norm1 = nn.BatchNorm2d(8) if batch_norm else nn.Identity()
        self.conv2 = nn.Conv2d(8, 16, 3)
        self.norm2 = nn.BatchNorm2d(16) if batch_norm else nn.Identity()
        self.fc1 = nn.Linear(16 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def model_fn(run_config: Mapping[str, object]) -> Callable[[], DigitsNet]:
    """The run's network: ``batch-norm = true`` in the run config adds BatchNorm."""
    return functools.partial(DigitsNet, batch_norm=str(run_config["batch-norm"]).lower() == "true")


def _pool(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as [N, 1, 8, 8] floats in [0, 1], shuffled by ``seed``."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order], digits.target[order].astype(np.int64)


def server_data(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    """(validation, test) sets the clients never see."""
    x, y = _pool(seed)
    n_test = int(len(x) * TEST_FRACTION)
    test = torch.from_numpy(x[:n_test]), torch.from_numpy(y[:n_test])
    val = torch.from_numpy(x[n_test:n_test + VAL_SIZE]), torch.from_numpy(
        y[n_test:n_test + VAL_SIZE])
    return val, test


def client_data(partition: int, num_partitions: int, alpha: float, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition``'s rows of a Dirichlet(alpha) label split of the training pool."""
    x, y = _pool(seed)
    start = int(len(x) * TEST_FRACTION) + VAL_SIZE
    x, y = x[start:], y[start:]
    rng = np.random.default_rng([seed, 1])
    while True:  # redraw until every client holds at least MIN_ROWS rows
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for label in range(NUM_CLASSES):
            rows = rng.permutation(np.flatnonzero(y == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_partitions))[:-1] * len(rows))
            for client, chunk in enumerate(np.split(rows, cuts.astype(int))):
                parts[client] += chunk.tolist()
        if min(len(p) for p in parts) >= MIN_ROWS:
            break
    rows = np.sort(parts[partition])
    return torch.from_numpy(x[rows]), torch.from_numpy(y[rows])


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int) -> None:
    """Plain mini-batch SGD with momentum."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(32):
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    model.eval()
