"""Shared fixtures: an in-process Flower grid and small real-data settings."""

from __future__ import annotations

import pytest

from fedfusion.config import Settings
from fedfusion.inprocess import InProcessGrid, ensure_task_identity

__all__ = ["InProcessGrid"]  # tests import it from here

ensure_task_identity()


@pytest.fixture
def small_settings(tmp_path) -> Settings:
    """3 clients on a 3000-sample real FMNIST subset, 3 epochs: seconds per federation."""
    return Settings(num_clients=3, train_subset=3000, local_epochs=3, alpha=1.0,
                    output_dir=str(tmp_path), val_size=200)
