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


class DropNet(nn.Module):
    """A user's model with dropout: its forward in train mode draws from torch's global RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 5, stride=2)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(torch.relu(self.conv(x)).flatten(1)))


def small() -> nn.Module:  # a last layer small enough for a quick diag_full block
    return nn.Sequential(nn.Conv2d(1, 2, 5, stride=4, bias=False), nn.ReLU(), nn.Flatten(),
                         nn.Linear(2 * 6 * 6, 10, bias=False))


def _upload_arrays(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    upload = client.make_upload([model], x, y, ["weights", "curvature.kron", "curvature.diag",
                                                "curvature.diag_full"])
    return {f"{s}/{k}": v for s, arrays in upload.members[0].items() for k, v in arrays.items()}


@pytest.mark.parametrize("caller_mode", [torch.no_grad, torch.inference_mode],
                         ids=["no_grad", "inference_mode"])
def test_the_callers_grad_mode_changes_no_upload_and_no_fusion(data, caller_mode):
    """Evaluation code wraps calls in no_grad or inference_mode: the uploads (the laplace-torch
    Kron and diagonal fits, the last-layer block) and the fusions that optimise (FedBEns,
    FedFisher, DENSE, distillation) are the same as outside it, not an error (inference
    mode) or another estimator (the diagonal under no_grad fell back to a different
    Monte-Carlo estimate, up to 7.7 off on values of 12)."""
    x, y = data["client0"]
    model = small()
    sgd(model, x, y, epochs=1)
    expected = _upload_arrays(model, x, y)
    with caller_mode():
        got = _upload_arrays(model, x, y)
    assert expected.keys() == got.keys()
    for key, array in expected.items():
        np.testing.assert_array_equal(got[key], array, err_msg=key)
    uploads = [client.make_upload([m], *data[f"client{c}"], ["weights", "curvature.kron"],
                                  client_id=c)
               for c, m in enumerate([model, *(small() for _ in range(2))])]
    x_test = data["test"][0][:64]
    # training: the clients' SGD loop and FENS' aggregator step
    from fedfusion.strategies.fens.predictor import LogitAggregator
    from fedfusion.strategies.fens.training import LocalTraining, train_locally
    from fedfusion.training import TrainConfig, train_local

    def untrained() -> tuple[nn.Module, nn.Module]:  # built outside the caller's mode
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return small(), LogitAggregator(3, 10, 4)

    def train(net: nn.Module, head: nn.Module) -> list[torch.Tensor]:
        train_local(net, x, y, TrainConfig(epochs=1), seed=3)
        train_locally(head, log_probs, y, LocalTraining(), seed=3)
        return [t.clone() for t in (*net.state_dict().values(), *head.state_dict().values())]

    log_probs = torch.randn(len(y), 3, 10, generator=torch.Generator().manual_seed(0))
    expected_weights = train(*untrained())
    models = untrained()
    with caller_mode():
        got_weights = train(*models)
    for want, got in zip(expected_weights, got_weights, strict=True):
        assert torch.equal(want, got)
    for make in (lambda: FedBEns(small, steps=6, eval_every=3, val=data["val"]),
                 lambda: FedFisher(small, steps=4, val=data["val"]),
                 lambda: Dense(small, epochs=1, val=data["val"]),
                 lambda: FedAvg(small, val=data["val"], distill="val", distill_epochs=1)):
        plain = make().fuse_uploads(uploads)
        with caller_mode():
            moded = make().fuse_uploads(uploads)
        with torch.no_grad():
            torch.testing.assert_close(moded(x_test), plain(x_test), rtol=0, atol=0)


def test_dropout_draws_come_from_the_seed_not_the_caller(data):
    """train_local and a DENSE student with dropout: the same seed gives the same weights
    whatever the caller drew before, and the caller's RNG is left as it was (dropout drew
    from the caller's generator and advanced it)."""
    from fedfusion.training import TrainConfig, train_local

    x, y = data["client0"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        start = DropNet().state_dict()
    trained, predictions = [], []
    uploads = []
    for caller_seed in (1, 2):
        model = DropNet()
        model.load_state_dict(start)
        torch.manual_seed(caller_seed)
        before = process_state()
        train_local(model, x, y, TrainConfig(epochs=1, batch_size=32), seed=5)
        assert_unchanged(before, "train_local with dropout")
        trained.append(model.state_dict())
        uploads = [client.make_upload([model], x, y, client_id=0),
                   client.make_upload([DropNet()], *data["client1"], client_id=1)] \
            if not uploads else uploads
        before = process_state()
        student = Dense(DropNet, epochs=2, batch_size=16, val=data["val"]).fuse_uploads(uploads)
        assert_unchanged(before, "Dense with a dropout student")
        with torch.no_grad():
            predictions.append(student(data["test"][0][:64]))
    for name, tensor in trained[0].items():
        assert torch.equal(tensor, trained[1][name]), name
    assert torch.equal(predictions[0], predictions[1])


def test_importing_laplace_torch_leaves_the_callers_logging_alone(tmp_path):
    """laplace-torch logs at import; without a handler on the root logger that configured
    the caller's logging (a StreamHandler on root), and the caller's basicConfig later did
    nothing. Run in a fresh interpreter: pytest keeps handlers on the root logger."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "caller.py"
    script.write_text(
        "import logging, torch\n"
        "from torch import nn\n"
        "from fedfusion import client\n"
        "x, y = torch.randn(32, 1, 4, 4), torch.randint(0, 3, (32,))\n"
        "client.make_upload([nn.Sequential(nn.Flatten(), nn.Linear(16, 3))], x, y,\n"
        "                   ['weights', 'curvature.kron'])\n"
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
        "logging.basicConfig(level=logging.INFO, format='MYAPP %(message)s')\n"
        "logging.getLogger('caller').info('configured')\n")
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=repo, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MYAPP configured" in done.stderr


def test_loading_a_fens_predictor_leaves_the_callers_rng(data, tmp_path):
    from fedfusion.core.predictors import save_predictor
    from fedfusion.strategies.fens.predictor import AggregatedEnsemble, LogitAggregator
    from fedfusion.strategies.predictors import load_predictor

    with torch.random.fork_rng(devices=[]):
        members = [lenet(), lenet()]
        aggregator = LogitAggregator(2, 10, 4)
    spec = FedAvg(lenet, val=data["val"]).context.model_spec
    path = save_predictor(AggregatedEnsemble(members, [spec, spec], aggregator),
                          tmp_path / "fens.pt")
    before = process_state()
    loaded = load_predictor(path, model_fn=lenet)
    assert_unchanged(before, "load_predictor of a FENS predictor")
    x = data["test"][0][:16]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), AggregatedEnsemble(
            members, [spec, spec], aggregator)(x))
