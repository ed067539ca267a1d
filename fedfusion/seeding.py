"""Seeded work that leaves the caller's random number generators as they were.

``torch.manual_seed`` inside ``torch.random.fork_rng(devices=[])`` restores only the CPU's
generator: it also reseeds every GPU's (and, for a GPU not yet initialised, queues the seed
for its start). :func:`seeded` touches the CPU's generator and, when the work runs on one, a
single CUDA device's, and restores both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def stream_seed(*words: int) -> int:
    """A seed in [0, 2**63) for torch's generators from several words (e.g. the run's seed and
    a round): numpy's SeedSequence mixes them, so (s, 1) and (s + 1, 0) share no stream."""
    sequence = np.random.SeedSequence([w % 2**64 for w in words])
    return int(sequence.generate_state(1, np.uint64)[0]) % 2**63


@contextmanager
def seeded(seed: int | None, device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside: the CPU's global generator, and ``device``'s when it is a CUDA device, seeded
    with ``seed`` (None: forked, not seeded); after: both as they were. The CPU's draws are
    those of ``torch.manual_seed(seed)``."""
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        if seed is not None:
            torch.random.default_generator.manual_seed(seed)
            if cuda:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
        yield
