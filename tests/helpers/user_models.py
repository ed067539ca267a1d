"""Users' own small models beyond the zoo (BatchNorm, LayerNorm, GroupNorm with a custom
layer and a residual addition) and running statistics that are not the defaults."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BNNet(nn.Module):
    """A user's small BatchNorm CNN: conv (bias) -> BN -> ReLU -> pool, twice, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.bn2 = nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.c2(x))), 2)
        return self.fc(x.flatten(1))


class LNNet(nn.Module):
    """An MLP with LayerNorm and an in-place ReLU after a Linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 3)
        self.fc0 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc0(x.flatten(1)), inplace=True)
        return self.fc2(torch.tanh(self.ln(self.fc1(h))))


class Scale(nn.Module):
    """A user's own parameterised layer: a learned per-channel gain used directly."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain[:, None, None]


class CustomNet(nn.Module):
    """GroupNorm, a custom layer and an Embedding-free residual addition."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.gn, self.scale = nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), Scale(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        h = F.max_pool2d(F.relu(self.scale(self.gn(h)) + h), 2)
        return self.fc(h.flatten(1))


def with_stats(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-default running statistics (a few train-mode passes), then eval mode."""
    gen = torch.Generator().manual_seed(seed)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, 1, 8, 8, generator=gen) * 2 + 0.5)
    return model.eval()
