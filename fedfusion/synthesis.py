"""Synthetic inputs for data-free distillation: DENSE's class-conditional generator, the
pool of its recent batches, and the losses that shape them (shared by DENSE, Co-Boosting and
``distill='synthetic'``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

#: data range assumed per channel when there is no validation set to read it from
FALLBACK_RANGE = (-2.0, 2.0)


class Generator(nn.Module):
    """Class-conditional DCGAN-like G: (z [B, d], y [B]) -> images [B, C, H, W] in
    [low_c, high_c] per channel.

    z * embed(y) (a learnt d-vector per class), linear d -> 2w * ceil(H/4) * ceil(W/4),
    reshape, BN, LeakyReLU(0.2),
    transposed conv4/2 2w->w (doubles the side), BN, LeakyReLU(0.2), transposed conv4/2 w->C,
    crop to H x W, then x = low + (high - low) * (tanh + 1) / 2. Transposed convolutions,
    not the reference's upsample + conv3 at full resolution: 5x cheaper on a CPU.
    """

    def __init__(self, latent_dim: int, input_shape: Sequence[int], num_classes: int,
                 width: int, low: torch.Tensor, high: torch.Tensor):
        super().__init__()
        channels, self.height, self.width = (int(v) for v in input_shape)
        self.seed_shape = (2 * width, math.ceil(self.height / 4), math.ceil(self.width / 4))
        self.embed = nn.Embedding(num_classes, latent_dim)
        self.fc = nn.Linear(latent_dim, math.prod(self.seed_shape))
        self.body = nn.Sequential(
            nn.BatchNorm2d(2 * width),
            nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(width, channels, 4, stride=2, padding=1),
        )
        self.register_buffer("low", low.reshape(1, -1, 1, 1).float())
        self.register_buffer("high", high.reshape(1, -1, 1, 1).float())

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(z * self.embed(y)).view(-1, *self.seed_shape)
        out = self.body(h)[:, :, :self.height, :self.width]
        return self.low + (self.high - self.low) * (torch.tanh(out) + 1) / 2


def kl_teacher_student(t_logits: torch.Tensor, s_logits: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """Per-sample T^2 KL(softmax(t/T) || softmax(s/T)), shape [B]."""
    log_pt = F.log_softmax(t_logits / temperature, dim=1)
    log_ps = F.log_softmax(s_logits / temperature, dim=1)
    return (log_pt.exp() * (log_pt - log_ps)).sum(1) * temperature**2


def input_stats_loss(x: torch.Tensor) -> torch.Tensor:
    """||mu_c(x)||_2 + ||sigma^2_c(x) - 1||_2: distance of the per-channel batch mean and
    (biased) variance to the N(0, 1) statistics of normalised data."""
    mean = x.mean(dim=(0, 2, 3))
    var = x.var(dim=(0, 2, 3), unbiased=False)
    return torch.linalg.vector_norm(mean) + torch.linalg.vector_norm(var - 1)


class SamplePool:
    """Ring buffer of the last ``capacity`` synthetic images, their teacher logits and the
    labels the generator was asked for."""

    def __init__(self, capacity: int, input_shape: Sequence[int], num_classes: int,
                 device: torch.device):
        self.x = torch.empty(capacity, *input_shape, device=device)
        self.logits = torch.empty(capacity, num_classes, device=device)
        self.y = torch.zeros(capacity, dtype=torch.long, device=device)
        self.size = self.next = 0

    def add(self, x: torch.Tensor, logits: torch.Tensor, y: torch.Tensor | None = None
            ) -> None:
        capacity = self.x.shape[0]
        index = (self.next + torch.arange(x.shape[0], device=x.device)) % capacity
        self.x[index], self.logits[index] = x.detach(), logits.detach()
        if y is not None:
            self.y[index] = y.detach()
        self.next = (self.next + x.shape[0]) % capacity
        self.size = min(self.size + x.shape[0], capacity)

    def draw(self, n: int, rng: torch.Generator) -> torch.Tensor:
        """n row indices drawn uniformly with replacement."""
        return torch.randint(self.size, (n,), generator=rng, device=self.x.device)

    def sample(self, n: int, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n rows (images, teacher logits) drawn uniformly with replacement."""
        index = self.draw(n, rng)
        return self.x[index], self.logits[index]
