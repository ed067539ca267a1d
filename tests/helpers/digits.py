"""scikit-learn's digits as 64 integer tokens split over 3 label-skewed clients, a token
model (Embedding, BatchNorm) and its Adam training loop."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn

#: the fraction of the training rows given to a random client (the rest by label)
MOVED = 0.1


class TokenNet(nn.Module):
    """64 integer tokens -> Embedding -> Linear -> BatchNorm1d -> ReLU -> Linear (10)."""

    def __init__(self, vocab: int = 17, dim: int = 4, length: int = 64, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim * length, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.hidden(self.emb(x).flatten(1)))))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int, epochs: int = 8
          ) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(32):
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimiser.step()
    return model.eval()


def split_digits(moved_fraction: float = MOVED) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """500 test and 300 validation rows; 3 clients of the rest, label-skewed: client c holds
    the classes k with k % 3 == c, and ``moved_fraction`` of the rows go to a random client."""
    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.int64)  # 0..16
    y = torch.tensor(bunch.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    out = {"test": (x[order[:500]], y[order[:500]]), "val": (x[order[500:800]],
                                                             y[order[500:800]])}
    rest = order[800:]
    owner = y[rest] % 3
    moved = torch.rand(len(rest), generator=g) < moved_fraction
    owner[moved] = torch.randint(3, (int(moved.sum()),), generator=g)
    for c in range(3):
        rows = rest[owner == c]
        out[f"client{c}"] = (x[rows], y[rows])
    return out
