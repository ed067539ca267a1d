"""Honest but degenerate inputs a user's project can hand a strategy: a validation set that
lacks a class, no validation set where one is needed, a 1-row or odd-sized validation set
with BatchNorm1d, a caller inside ``torch.no_grad()``, a client without rows. Each either
works or is refused with an error that says what to do, before any client trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedfusion import client
from fedfusion.core.architecture import ModelSpec
from fedfusion.strategies import Dense, FedAvg, FedBEns

X = torch.randn(80, 1, 4, 4, generator=torch.Generator().manual_seed(0))
Y = torch.arange(80) % 4


class Net(nn.Module):
    """A user's model_fn: 16 inputs -> 4 classes (no spec: shape and classes unknown)."""

    def __init__(self) -> None:
        super().__init__()
        self.f1, self.f2 = nn.Linear(16, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f2(torch.relu(self.f1(x.flatten(1))))


class BatchNormNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f2(torch.relu(self.norm(self.f1(x.flatten(1)))))


def uploads(model_fn: type[Net], sections: tuple[str, ...] = ("weights",)) -> list:
    out = []
    for c in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c)
            model = model_fn()
        optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
        model.train()
        for _ in range(20):
            optimiser.zero_grad()
            F.cross_entropy(model(X), Y).backward()
            optimiser.step()
        out.append(client.make_upload([model.eval()], X, Y, list(sections), client_id=c,
                                      model_name=model_fn.__name__))
    return out


def test_the_classes_come_from_the_model_not_from_the_validation_labels():
    """A validation set without class 3 made DENSE's generator draw 3 classes for a 4-class
    teacher and crash after every client had trained."""
    strategy = Dense(Net, val=(X[:30], torch.arange(30) % 3), epochs=1)
    assert strategy.context.model_spec.num_classes == 4
    predictor = strategy.fuse_uploads(uploads(Net))
    assert predictor(X[:5]).shape == (5, 4)


def test_a_data_free_strategy_without_shape_or_classes_is_refused_at_construction():
    with pytest.raises(ValueError, match="dense generates its inputs, so it needs the model's "
                                         r"input shape and number of classes: pass val=\(x, y\)"):
        Dense(Net, epochs=1)
    # an input shape is enough: the classes come from a dry forward of the model
    strategy = Dense(ModelSpec.from_model_fn(Net, input_shape=(1, 4, 4)), epochs=1)
    assert strategy.context.model_spec.num_classes == 4


def test_batchnorm1d_with_a_one_row_or_odd_sized_validation_set():
    """BatchNorm1d refuses a batch of one row in training mode: a 1-row validation set is
    not recalibrated on (nothing to estimate), and distillation leaves out a last batch of
    one row (65 rows, batches of 64)."""
    fused = uploads(BatchNormNet)
    strategy = FedAvg(BatchNormNet, val=(X[:1], Y[:1]))
    strategy.fuse_uploads(fused)
    assert strategy.recalibrated_layers == 0
    distilled = FedAvg(BatchNormNet, val=(X[:65], Y[:65]), distill="val", distill_epochs=1,
                       norm_stats="average")
    assert distilled.fuse_uploads(fused)(X[:5]).isfinite().all()
    assert distilled.distill_report["steps_per_epoch"] == 1


def test_fusing_inside_no_grad_gives_the_same_result():
    fused = uploads(Net, ("weights", "curvature.kron"))
    expected = FedBEns(Net, steps=5).fuse_uploads(fused)(X)
    with torch.no_grad():
        assert torch.equal(FedBEns(Net, steps=5).fuse_uploads(fused)(X), expected)


def test_an_upload_of_no_rows_says_so():
    with pytest.raises(ValueError, match="make_upload needs at least one training row"):
        client.make_upload([Net()], X[:0], Y[:0], ["weights", "curvature.kron"])
