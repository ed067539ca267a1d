"""Shared fixtures: an in-process Flower grid and small real-data settings."""

from __future__ import annotations

import pytest

from fedfusion.app.config import Settings
from fedfusion.app.inprocess import InProcessGrid, ensure_task_identity

__all__ = ["LAUNCH_TIMEOUT_S", "InProcessGrid", "initial_models"]  # tests import them from here

#: limit of one `flwr run` launched by a test: a run here takes 10-60 s; a hung simulation
#: (seen once, while another process started its own Ray cluster at the same moment) fails
#: its test instead of stalling CI
LAUNCH_TIMEOUT_S = 600

ensure_task_identity()


@pytest.fixture
def small_settings(tmp_path) -> Settings:
    """3 clients on a 3000-sample real FMNIST subset, 3 epochs: seconds per federation."""
    return Settings(num_clients=3, train_subset=3000, local_epochs=3, alpha=1.0,
                    output_dir=str(tmp_path), val_size=200)


def initial_models(spec, num_members: int, seed: int) -> list:
    """The M seeded initial models a strategy broadcasts (any strategy: the base class's)."""
    from fedfusion.strategies import FedAvg

    return FedAvg(spec, num_members=num_members, seed=seed).initial_models()
