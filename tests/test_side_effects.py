"""Library calls leave the caller's process as they found it: torch's, numpy's and Python's
global RNGs (a GPU's too: no call reseeds one it does not run on, as ``torch.manual_seed``
would, even queued for a GPU not yet started), torch's default dtype and thread count, the
logging configuration and ASDL's classes."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import pytest
import torch
from conftest import label_skewed_fmnist, sgd, sgd_client_app
from flwr.app import Message
from torch import nn

from fedfusion import LocalGrid, client
from fedfusion.strategies import (
    FENS,
    CoBoosting,
    Dense,
    FedAvg,
    FedBEns,
    FedFisher,
    OTFusion,
    RegMean,
    StatisticalWeightAggregation,
)


class BNNet(nn.Module):
    """A user's model with BatchNorm (hybrid Kron curvature, statistics recalibration)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 5, stride=2)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def lenet() -> nn.Module:  # the stacked engine's favourite: bias-free conv chain
    return nn.Sequential(nn.Conv2d(1, 6, 5, bias=False), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(6 * 12 * 12, 10, bias=False))


#: the seeds given to a GPU's generators during the current test (:func:`gpu_seeds`)
GPU_SEEDS: list[int] = []


@pytest.fixture(autouse=True)
def gpu_seeds(monkeypatch) -> None:
    """Records every (re)seeding of the GPUs' generators, which the CPU cannot otherwise see."""
    GPU_SEEDS.clear()
    monkeypatch.setattr(torch.cuda, "manual_seed_all", GPU_SEEDS.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", GPU_SEEDS.append)


def process_state() -> dict[str, Any]:
    from asdl.operations.conv import Conv2d

    root, ours = logging.getLogger(), logging.getLogger("fedfusion")
    return {
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
        "default_dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "logging": (root.level, list(root.handlers), ours.level, list(ours.handlers),
                    ours.propagate),
        "asdl": {k: Conv2d.__dict__[k] for k in ("cov_kron_A", "cov_kron_B")},
        "gpu_seeds": list(GPU_SEEDS),
    }


def assert_unchanged(before: dict[str, Any], what: str) -> None:
    after = process_state()
    assert torch.equal(before["torch_rng"], after["torch_rng"]), f"{what}: torch's global RNG"
    assert np.array_equal(before["numpy_rng"], after["numpy_rng"]), f"{what}: numpy's RNG"
    for key in ("python_rng", "default_dtype", "threads", "logging", "asdl", "gpu_seeds"):
        assert before[key] == after[key], f"{what}: {key} changed"


@pytest.fixture(scope="module")
def data() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return label_skewed_fmnist(200, 100, 200)


@pytest.mark.parametrize("model_fn", [lenet, BNNet], ids=["lenet", "batchnorm"])
def test_make_upload_leaves_the_process_alone(data, model_fn):
    x, y = data["client0"]
    models = [model_fn(), model_fn()]  # built (and so drawn from the RNG) before the snapshot
    for model in models:
        sgd(model, x, y, epochs=1)
    for sections in (["weights", "curvature.kron"], ["weights", "curvature.diag", "gram"]):
        before = process_state()
        upload = client.make_upload(models, x, y, sections)
        assert_unchanged(before, f"make_upload {sections}")
        assert all(s in upload.members[0] for s in sections)


def checked_reply(msg: Message, models: list[nn.Module], x: torch.Tensor, y: torch.Tensor
                  ) -> Message:
    before = process_state()
    reply = client.reply(msg, models, x, y)
    assert_unchanged(before, "client.reply")
    return reply


def test_start_and_fuse_uploads_leave_the_process_alone(data):
    """strategy.start (initial models, a round on a LocalGrid, fusion with recalibrated
    BatchNorm statistics) and fuse_uploads of every kind of fusion."""
    grid = LocalGrid(sgd_client_app(BNNet, data, reply=checked_reply), num_nodes=3)
    before = process_state()
    fedbens = FedBEns(BNNet, num_clients=3, num_members=2, val=data["val"], steps=10,
                      eval_every=5, extra_sections=["gram", "curvature.diag"])
    fedbens.start(grid)
    assert_unchanged(before, "FedBEns.start")
    assert len(fedbens.uploads) == 3 and not fedbens.exclusions
    for strategy in (FedAvg(BNNet), RegMean(BNNet, val=data["val"]),
                     FedFisher(BNNet, steps=5), OTFusion(BNNet),
                     Dense(BNNet, epochs=1, val=data["val"]),
                     CoBoosting(BNNet, epochs=1, val=data["val"]),
                     FENS(BNNet, val=data["val"]),
                     StatisticalWeightAggregation(BNNet)):
        before = process_state()
        predictor = strategy.fuse_uploads(fedbens.uploads)
        assert_unchanged(before, f"{type(strategy).__name__}.fuse_uploads")
        with torch.no_grad():
            assert torch.isfinite(predictor(data["test"][0][:8])).all()


def test_seeded_draws_what_manual_seed_draws_and_restores_the_caller():
    from fedfusion.seeding import seeded

    torch.manual_seed(3)
    wanted = torch.rand(4)
    before = process_state()
    with seeded(3):
        drawn = torch.rand(4)
    assert torch.equal(drawn, wanted)
    assert_unchanged(before, "seeded")
