"""The default Kron fit on the stacked trainer's layers equals laplace-torch's asdl_mc fit."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fedfusion.accel.fast_kron import kron_mc_factors
from fedfusion.curvature import fit_curvature
from fedfusion.curvature.fit import fit_laplace, param_shapes
from fedfusion.models import build_model
from fedfusion.training import TrainConfig, train_members


class _PaddedNet(nn.Module):
    """Padding and a bias: the patch path of the A factor, and laplace-torch's bias block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


CASES = [("lenet", (1, 28, 28), 10), ("mlp-bias", (1, 28, 28), 10), ("padded", (2, 8, 8), 4)]


def _trained(name: str, shape: tuple[int, int, int], classes: int
             ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, *shape, generator=g)
    y = torch.randint(0, classes, (300,), generator=g)
    torch.manual_seed(1)
    if name == "padded":
        model: nn.Module = _PaddedNet()
    elif name == "mlp-bias":
        model = build_model("mlp", shape, classes, bias=True)
    else:
        model = build_model(name, shape, classes)
    train_members([model], x, y, TrainConfig(epochs=2, batch_size=32), [0])
    return model, x, y


@pytest.mark.parametrize(("name", "shape", "classes"), CASES, ids=[c[0] for c in CASES])
def test_factors_equal_laplace_torchs_asdl_mc_factors_draw_for_draw(name, shape, classes):
    model, x, y = _trained(name, shape, classes)
    la = fit_laplace(model, x, y, "kron", backend="asdl_mc", seed=7, batch_size=64)
    before = torch.get_rng_state()
    ours = kron_mc_factors(model, x, seed=7, batch_size=64)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is left alone
    assert ours is not None
    names = list(param_shapes(model))
    assert len(la.H_facs.kfacs) == len(names) == len(ours)
    for parameter, factors in zip(names, la.H_facs.kfacs, strict=True):
        expected = factors if len(factors) == 2 else [torch.ones(1, 1), factors[0]]
        for got, want in zip(ours[parameter], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # another seed, other draws: the MC estimate changes
    other = kron_mc_factors(model, x, seed=8, batch_size=64)
    assert other is not None
    assert not torch.allclose(other[names[0]][0], ours[names[0]][0])


def test_fit_curvature_uses_it_and_falls_back_to_laplace_torch_elsewhere():
    model, x, y = _trained("lenet", (1, 28, 28), 10)
    fast = fit_curvature(model, x, y, "kron", seed=2, accelerate=True)
    via_laplace = fit_curvature(model, x, y, "kron", seed=2, backend="asdl_ggn")  # exact GGN
    assert fast.precision_logdet() == pytest.approx(via_laplace.precision_logdet(), rel=0.05)

    class Tanh(nn.Module):  # unknown to the stacked trainer
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.fc(x))

    assert kron_mc_factors(Tanh(), torch.randn(10, 4), seed=0) is None
    curvature = fit_curvature(Tanh(), torch.randn(40, 4), torch.randint(0, 3, (40,)), "kron",
                              accelerate=True)
    assert curvature.precision_logdet() > 0


def test_a_kron_client_never_imports_laplace_torch() -> None:
    """The default Kron fit needs no laplace-torch (~2 s and 0.3 GB per client process)."""
    script = (
        "import sys\n"
        "from fedfusion.app.config import Settings\n"
        "from fedfusion.app.client_round import run_client\n"
        "settings = Settings(num_clients=2, train_subset=400, local_epochs=1, num_members=2,\n"
        "                    val_size=100)\n"
        "upload = run_client(settings, 0, [], sections=('weights', 'curvature.kron'))\n"
        "assert 'laplace' not in sys.modules, 'the client imported laplace-torch'\n"
        "assert all('curvature.kron' in member for member in upload.members)\n"
        "assert upload.metrics['load-time-s'] > 0\n"
        "assert upload.metrics['client-time-s'] >= upload.metrics['train-time-s']\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
