"""Shared fixtures: an in-process Flower grid and small real-data settings."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedfusion.app.config import Settings
from fedfusion.app.inprocess import InProcessGrid, ensure_task_identity

# the operations helpers live outside the package (scripts/deploy_tools.py, not in the
# wheel); the deployment tests import them from there
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

__all__ = ["DIFFERS", "FLOWER_PROCESSES", "LAUNCH_TIMEOUT_S", "InProcessGrid", "SharedRun",
           "client0_model", "initial_models", "label_skewed_fmnist", "prediction_gap",
           "run_keeping_last_round", "sgd"]
# (tests import them from here)

#: limit of one `flwr run` launched by a test: a run here takes 10-60 s; a hung simulation
#: (seen once, while another process started its own Ray cluster at the same moment) fails
#: its test instead of stalling CI
LAUNCH_TIMEOUT_S = 600

ensure_task_identity()

#: the test files that start Flower or Ray processes (flwr run, SuperLinks, SuperNodes) and
#: look for the processes they left carry ``pytestmark = FLOWER_PROCESSES``: scripts/test.sh
#: runs them one after another in one pytest process, beside a second one for the other tests
FLOWER_PROCESSES = pytest.mark.flower_processes


@pytest.fixture
def small_settings(tmp_path) -> Settings:
    """3 clients on a 3000-sample real FMNIST subset, 3 epochs: seconds per federation."""
    return Settings(num_clients=3, train_subset=3000, local_epochs=3, alpha=1.0,
                    output_dir=str(tmp_path), val_size=200)


@dataclass
class SharedRun:
    """A live one-shot run's settings, results and saved uploads; :meth:`replay` fuses the same
    uploads into any strategy (no training), so a test compares a strategy with FedAvg and the
    ensemble on exactly the same client models."""

    settings: Settings
    live: dict[str, Any]
    _names: itertools.count = field(default_factory=itertools.count)

    @property
    def uploads(self) -> str:
        return f"{self.live['output_dir']}/uploads"

    def replay(self, strategy: str, **changes: Any) -> dict[str, Any]:
        from fedfusion.server_app import run_server

        name = f"{strategy}-{next(self._names)}"  # every replay its own output folder
        return run_server(self.settings.replace(strategy=strategy, replay=self.uploads,
                                                run_name=name, **changes))


@pytest.fixture(scope="session")
def fmnist_split(tmp_path_factory) -> SharedRun:
    """3 clients, Dirichlet 0.5 on a 9,000-sample real FMNIST subset, LeNet from the server's
    common initialisation, 2 local epochs, 300 validation images: one live FedAvg run whose
    clients upload every section the one-shot baselines need (Kron and diagonal curvature,
    Gram matrices). RegMean, FedFisher, Fisher merging, OTFusion and DENSE replay it.
    Measured on it: FedAvg 50.9%, the uniform ensemble 64.2% test accuracy."""
    from fedfusion.server_app import run_server

    settings = Settings(strategy="fedavg", num_clients=3, train_subset=9000, local_epochs=2,
                        alpha=0.5, val_size=300, run_name="live",
                        extra_sections="curvature.kron,curvature.diag,gram",
                        output_dir=str(tmp_path_factory.mktemp("fmnist-split")))
    live = run_server(settings, InProcessGrid(settings))
    assert live["status"] == "ok" and not live["excluded"]
    return SharedRun(settings, live)


def run_keeping_last_round(settings: Settings) -> tuple[dict, list, dict[str, torch.Tensor]]:
    """Run ``settings`` through the App's ServerApp in process, and return its results, the
    last round's replies decoded as the server got them (sorted by client) and the saved
    predictor's state: what a multi-round test checks the last fusion against."""
    from flwr.app import Message

    from fedfusion.server_app import run_server
    from fedfusion.strategies.predictors import load_predictor
    from fedfusion.wire import decode_upload

    replies: list[Message] = []

    def record(index: int, reply: Message) -> Message:
        replies.append(reply)
        return reply

    results = run_server(settings, InProcessGrid(settings, tamper=record))
    assert len(replies) == settings.num_rounds * settings.num_clients
    predictor = load_predictor(Path(results["output_dir"]) / "predictor.pt")
    shapes = predictor.specs[0].param_shapes()
    last = sorted((decode_upload(r.content, "client", lambda _m, _k: shapes)
                   for r in replies[-settings.num_clients:]), key=lambda u: u.client_id)
    return results, last, predictor.members[0].state_dict()


def initial_models(spec, num_members: int, seed: int) -> list:
    """The M seeded initial models a strategy broadcasts (any strategy: the base class's)."""
    from fedfusion.strategies import FedAvg

    return FedAvg(spec, num_members=num_members, seed=seed).initial_models()


#: the least a fusion that is meant to differ from a lazy answer (client 0's model, FedAvg, the
#: ensemble of the same uploads) must differ by: the largest change of any class probability
#: on the test inputs (:func:`prediction_gap`); float noise of one fusion is ~1e-6
DIFFERS = 1e-3


def prediction_gap(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    """max |p_a(y|x) - p_b(y|x)| over the rows of ``x`` and the classes, for two predictors
    that return log-probabilities: a difference in predictions, not only in weights."""
    with torch.no_grad():
        return float((a(x).exp() - b(x).exp()).abs().max())


def client0_model(spec, uploads, members: int | None = None) -> torch.nn.Module:
    """The lowest client id's model(s), unfused, as one predictor: a stub's lazy answer. Its
    first ``members`` models (all by default: 1 where the strategy fuses member 0 only)."""
    from fedfusion.core.predictors import Ensemble

    first = min(uploads, key=lambda u: u.client_id)
    count = first.num_members if members is None else min(members, first.num_members)
    return Ensemble([spec.build(first.weights(m)) for m in range(count)], [spec] * count)


def label_skewed_fmnist(rows: int, val_size: int, test_rows: int
                        ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """3 label-skewed clients of ``rows`` real FMNIST rows each ("client0".."client2": labels
    0-5, 4-9 and the even ones + 9), ``val_size`` validation and ``test_rows`` test rows."""
    from fedfusion.datasets import load_dataset

    bundle = load_dataset("fmnist", val_size=val_size, seed=0)
    x, y = bundle.train.x, bundle.train.y
    rng = np.random.default_rng(0)
    data = {}
    for c, labels in enumerate([(0, 1, 2, 3, 4, 5), (4, 5, 6, 7, 8, 9), (0, 2, 4, 6, 8, 9)]):
        chosen = rng.choice(np.flatnonzero(np.isin(y.numpy(), labels)), rows, replace=False)
        data[f"client{c}"] = (x[chosen], y[chosen])
    data["val"] = (bundle.val.x, bundle.val.y)
    data["test"] = (bundle.test.x[:test_rows], bundle.test.y[:test_rows])
    return data


def sgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 3,
        seed: int = 0, batch_size: int = 64) -> None:
    """A user's plain training loop: SGD with momentum in train mode, then eval mode."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    model.eval()


def sgd_client_app(model_fn: Callable[[], torch.nn.Module], data: dict, epochs: int = 1,
                   reply: Callable[..., Any] | None = None) -> Any:
    """A user's ClientApp: client ``partition-id`` of ``data`` (``"client<i>"``), the
    broadcast models trained by :func:`sgd`, answered with ``reply`` (default
    ``fedfusion.client.reply``)."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    from fedfusion import client

    answer = reply or client.reply
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        x, y = data[f"client{context.node_config['partition-id']}"]
        models = client.initial_models(msg, model_fn)
        for m, model in enumerate(models):
            sgd(model, x, y, epochs=epochs, seed=m)
        return answer(msg, models, x, y)

    return app


class SmallCNN(torch.nn.Module):
    """One strided convolution and a linear head: 1x28x28 -> 10 logits (a user's own model,
    not the zoo's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 5, stride=2)
        self.fc = torch.nn.Linear(4 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class TinyNet(torch.nn.Module):
    """4 features -> log-probabilities of 3 classes: the smallest model a round can carry."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(x), dim=1)


@pytest.fixture
def one_thread():
    """One torch thread: distillation is many small ops, which threads only slow down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
