import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedfusion import training
from fedfusion.accel import kernels, stacked
from fedfusion.contrastive import ContrastiveTerm
from fedfusion.models import build_model
from fedfusion.training import ProximalTerm, TrainConfig, train_local, train_members


def _train(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 6, 6), 4, hidden_layers=1, hidden=8)
    g = torch.Generator().manual_seed(123)
    x, y = torch.randn(200, 1, 6, 6, generator=g), torch.randint(0, 4, (200,), generator=g)
    stats = train_local(model, x, y, TrainConfig(epochs=3, batch_size=32), seed)
    assert stats.samples == 600
    return model.state_dict()


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = _train(1), _train(1), _train(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_training_fits_a_learnable_task():
    torch.manual_seed(0)
    x = torch.randn(512, 1, 4, 4)
    y = (x.flatten(1).sum(1) > 0).long()
    model = build_model("mlp", (1, 4, 4), 2, hidden_layers=1, hidden=16)
    train_local(model, x, y, TrainConfig(epochs=10, batch_size=32, lr=0.05), seed=0)
    assert (model(x).argmax(1) == y).float().mean() > 0.9


# ------------------------------------------------------------------ train_members (stacked)
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not (FMNIST / "train-images-idx3-ubyte.gz").is_file(),
                                  reason="Fashion-MNIST not installed")
needs_kernels = pytest.mark.skipif(kernels.compiler() is None,
                                   reason="no C compiler: the compiled kernels are unavailable")


@pytest.fixture(scope="module")
def fmnist_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """The first 600 Fashion-MNIST training rows, normalised with the usual constants."""
    with gzip.open(FMNIST / "train-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16)[: 600 * 784]
    with gzip.open(FMNIST / "train-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)[:600]
    x = (torch.from_numpy(images.astype(np.float32)).view(600, 1, 28, 28) / 255 - 0.286) / 0.353
    return x, torch.from_numpy(labels.astype(np.int64))


def _members(name: str, input_shape: tuple[int, int, int], count: int, first_init: int = 100,
             **kwargs: object) -> list[nn.Module]:
    models = []
    for m in range(count):
        torch.manual_seed(first_init + m)  # each member its own init
        models.append(build_model(name, input_shape, 10, **kwargs))
    return models


def _as_rgb32(x: torch.Tensor) -> torch.Tensor:
    """1x28x28 rows as the 3x32x32 inputs of the CNN (padded, channel-replicated)."""
    return F.pad(x, (2, 2, 2, 2), value=float(x.min())).repeat(1, 3, 1, 1).contiguous()


def _max_relative_error(a: list[nn.Module], b: list[nn.Module]) -> float:
    return max(float((p - q).detach().abs().max() / p.detach().abs().max())
               for ma, mb in zip(a, b, strict=True)
               for p, q in zip(ma.parameters(), mb.parameters(), strict=True))


MODELS = [("lenet", (1, 28, 28), {}), ("cnn", (3, 32, 32), {}), ("mlp", (1, 28, 28), {}),
          ("mlp", (1, 28, 28), {"bias": True, "hidden_layers": 3, "hidden": 64})]


@needs_fmnist
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize(("name", "shape", "kwargs"), MODELS,
                         ids=["lenet", "cnn", "mlp", "mlp-bias"])
def test_stacked_members_equal_the_members_trained_one_by_one(
        fmnist_rows, name, shape, kwargs, use_kernels, monkeypatch):
    if use_kernels and kernels.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(kernels.DISABLE_ENV, "0" if use_kernels else "1")
    monkeypatch.setattr(training, "CHUNK_BYTES", 2**40)  # all three members in one stack
    x, y = fmnist_rows
    x = _as_rgb32(x) if shape[0] == 3 else x
    x, y = x[:200], y[:200]  # 4 steps of 64 and a last one of 8 per epoch
    config = TrainConfig(epochs=2, batch_size=64)
    seeds = [7, 8, 9]
    # A trajectory that passes a ReLU or pool choice within float noise of a tie (margins of
    # 1e-9 to 1e-7 occur every few steps) takes the other branch under another summation
    # order, and that member then drifts apart (CNN, init 102 / seed 9: 1e-3 after the flat
    # layers' GEMMs went feature-major; the same member alone, at any position, the same
    # drift). A bug moves every member: inits without such a near-tie are used.
    first_init = 200 if name == "cnn" else 100
    reference = _members(name, shape, 3, first_init, **kwargs)
    stacked_models = _members(name, shape, 3, first_init, **kwargs)
    expected = [train_local(m, x, y, config, s) for m, s in zip(reference, seeds, strict=True)]
    assert stacked.compile_members(stacked_models, x, [[]] * 3) is not None  # not a fallback
    got = train_members(stacked_models, x, y, config, seeds, accelerate=True)
    assert _max_relative_error(reference, stacked_models) < 1e-5
    for e, g in zip(expected, got, strict=True):
        assert g.samples == e.samples == 400
        assert g.final_loss == pytest.approx(e.final_loss, rel=1e-5)
    assert all(not m.training for m in stacked_models)


@needs_fmnist
def test_stacked_members_follow_their_own_seed_and_equal_seeds_give_equal_bits(fmnist_rows):
    x, y = fmnist_rows
    config = TrainConfig(epochs=1, batch_size=32)
    runs = []
    for _ in range(2):
        models = _members("lenet", (1, 28, 28), 3)
        train_members(models, x[:300], y[:300], config, [1, 1, 2], accelerate=True)
        runs.append([m.state_dict() for m in models])
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # members 0 and 1 differ in init only; 1 and 2 in their seed only: both must differ
    alike = _members("lenet", (1, 28, 28), 2)
    alike[1].load_state_dict(alike[0].state_dict())
    train_members(alike, x[:300], y[:300], config, [1, 2], accelerate=True)
    assert any(not torch.equal(p, q) for p, q in zip(alike[0].parameters(),
                                                      alike[1].parameters(), strict=True))


@needs_fmnist
def test_stacked_fedprox_members_equal_their_one_by_one_training(fmnist_rows):
    x, y = fmnist_rows[0][:200], fmnist_rows[1][:200]
    config = TrainConfig(epochs=2, batch_size=64)
    reference, models = _members("lenet", (1, 28, 28), 3), _members("lenet", (1, 28, 28), 3)
    anchors = _members("lenet", (1, 28, 28), 1)[0].state_dict()  # a "global model" elsewhere
    mus = [0.0, 0.5, 2.0]

    def terms(group: list[nn.Module]) -> list[list[ProximalTerm]]:
        return [[ProximalTerm(m, mu, anchors)] if mu else []
                for m, mu in zip(group, mus, strict=True)]

    ref_terms, stacked_terms = terms(reference), terms(models)
    expected = [train_local(m, x, y, config, 3, t)
                for m, t in zip(reference, ref_terms, strict=True)]
    assert stacked.compile_members(models, x, stacked_terms) is not None
    got = train_members(models, x, y, config, [3, 3, 3], stacked_terms, accelerate=True)
    assert _max_relative_error(reference, models) < 1e-5
    assert [g.final_loss for g in got] == pytest.approx([e.final_loss for e in expected],
                                                        rel=1e-5)


class _TanhNet(nn.Module):
    """A model the stacked engine does not know (tanh): trained one member at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def test_unknown_models_and_contrastive_terms_fall_back_to_one_by_one_training():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 1, 4, 4, generator=g), torch.randint(0, 3, (96,), generator=g)
    config = TrainConfig(epochs=2, batch_size=32)
    torch.manual_seed(0)
    a, b = _TanhNet(), _TanhNet()
    b.load_state_dict(a.state_dict())
    assert stacked.compile_members([b], x, [[]]) is None
    train_local(a, x, y, config, 5)
    train_members([b], x, y, config, [5], accelerate=True)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))

    models = [build_model("mlp", (1, 4, 4), 3, hidden_layers=1, hidden=8) for _ in range(2)]
    with ContrastiveTerm(models[0], models[0].state_dict(), models[1].state_dict(), 1.0,
                         0.5) as term:
        assert stacked.compile_members(models, x, [[term], []]) is None
        stats = train_members(models, x, y, config, [1, 2], [[term], []])
    assert len(stats) == 2 and all(math.isfinite(s.final_loss) for s in stats)


class _Strided(nn.Module):
    """Padding, stride, bias and odd-sized pooling: the im2col path in full generality."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 2, dilation=2)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(5 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.relu(self.conv2(F.relu(self.conv(x)))))  # 11 -> 6 -> 4 -> 2 (odd: 5)
        return self.fc(torch.flatten(h, 1))


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "torch-ops"])
def test_strided_padded_dilated_convolutions_and_odd_pooling(use_kernels, monkeypatch):
    monkeypatch.setenv(kernels.DISABLE_ENV, "0" if use_kernels else "1")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(80, 1, 11, 11, generator=g), torch.randint(0, 3, (80,), generator=g)
    config = TrainConfig(epochs=2, batch_size=16)
    torch.manual_seed(1)
    reference = [_Strided() for _ in range(2)]
    models = [_Strided() for _ in range(2)]
    for r, m in zip(reference, models, strict=True):
        m.load_state_dict(r.state_dict())
    assert stacked.compile_members(models, x, [[], []]) is not None
    for r, s in zip(reference, (4, 5), strict=True):
        train_local(r, x, y, config, s)
    train_members(models, x, y, config, [4, 5])
    assert _max_relative_error(reference, models) < 1e-5


def test_train_members_rejects_mismatched_arguments():
    models = [build_model("mlp", (1, 4, 4), 3, hidden_layers=1, hidden=8) for _ in range(2)]
    x, y = torch.randn(8, 1, 4, 4), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match="train_members got 2 models and 1 seeds"):
        train_members(models, x, y, TrainConfig(epochs=1), [0])
    with pytest.raises(ValueError, match="train_members got 2 models and 1 lists of loss terms"):
        train_members(models, x, y, TrainConfig(epochs=1), [0, 1], [[]])


@needs_fmnist
def test_large_members_train_in_chunks_with_the_same_result(fmnist_rows, monkeypatch):
    x = _as_rgb32(fmnist_rows[0][:130])
    y = fmnist_rows[1][:130]
    models = _members("cnn", (3, 32, 32), 3)
    assert training._members_per_chunk(models, x, 64) == 1  # 37 MB of maps per member
    lenets = _members("lenet", (1, 28, 28), 5)
    assert training._members_per_chunk(lenets, fmnist_rows[0][:2], 64) == 5
    config = TrainConfig(epochs=1, batch_size=64)
    chunked, together = _members("cnn", (3, 32, 32), 3), _members("cnn", (3, 32, 32), 3)
    first = train_members(chunked, x, y, config, [1, 2, 3])
    monkeypatch.setattr(training, "CHUNK_BYTES", 2**40)
    second = train_members(together, x, y, config, [1, 2, 3])
    assert _max_relative_error(chunked, together) < 1e-5
    assert [s.final_loss for s in first] == pytest.approx([s.final_loss for s in second],
                                                          rel=1e-5)


def _has_sgd_kernel_here() -> bool:
    """A C compiler and FMA hardware (PyTorch's CPU kernels then round ``add_`` with
    ``alpha`` once, as the compiled step does)."""
    from pathlib import Path

    from fedfusion.accel import kernels

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return kernels.compiler() is not None and " fma " in flags


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("from_first_step", [True, False])
def test_the_stacked_sgd_step_is_torch_sgd_bit_for_bit(monkeypatch, compiled, from_first_step):
    """From a momentum buffer of any value (or from PyTorch's first step), over several
    steps, on large tensors and on small ones of odd sizes, where vectorised kernels handle
    a tail (PyTorch's fused SGD differs from its own single-tensor step there in the last
    bit), with the compiled one-pass step and with PyTorch's ops."""
    from fedfusion.accel import kernels
    from fedfusion.accel.stacked import _MomentumSGD

    if compiled:
        monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
        if not _has_sgd_kernel_here():
            pytest.skip("no C compiler or no FMA here")
        assert kernels.sgd_kernel() is not None
    else:
        monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 100, 784), (1, 6, 1, 5, 5), (3, 7), (5, 10, 100)]
    start = [torch.randn(s, generator=g) for s in shapes]
    momentum = [1e-2 * torch.randn(s, generator=g) for s in shapes]
    steps = [[1e-3 * torch.randn(s, generator=g) for s in shapes] for _ in range(6)]
    params, grads = [p.clone() for p in start], [torch.empty(s) for s in shapes]
    ours = _MomentumSGD(params, grads, lr=0.01, momentum=0.9,
                        buffers=None if from_first_step else [b.clone() for b in momentum])
    for step in steps:
        for grad, value in zip(grads, step, strict=True):
            grad.copy_(value)
        ours.step()
    assert (ours._compiled is not None) == compiled
    reference = [p.clone().requires_grad_() for p in start]
    optimizer = torch.optim.SGD(reference, lr=0.01, momentum=0.9)
    if not from_first_step:
        for p, b in zip(reference, momentum, strict=True):
            optimizer.state[p]["momentum_buffer"] = b.clone()
    for step in steps:
        for p, grad in zip(reference, step, strict=True):
            p.grad = grad.clone()
        optimizer.step()
    assert all(torch.equal(p, r.detach()) for p, r in zip(params, reference, strict=True))
    assert ours.buffers is not None
    assert all(torch.equal(b, optimizer.state[r]["momentum_buffer"])
               for b, r in zip(ours.buffers, reference, strict=True))


def test_a_compiled_sgd_step_that_rounds_differently_is_not_used(monkeypatch):
    """The load-time check against PyTorch's step: a kernel fusing ``buf * momentum + grad``
    into one rounding (as PyTorch's fused SGD does) is refused, and PyTorch's ops are used."""
    from fedfusion.accel import kernels

    if not _has_sgd_kernel_here():
        pytest.skip("no C compiler or no FMA here")
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    fused = kernels._SGD_SOURCE.replace("float b = buf[i] * momentum;\n        b = b + grad[i];",
                                        "float b = fmaf(buf[i], momentum, grad[i]);")
    assert fused != kernels._SGD_SOURCE
    monkeypatch.setattr(kernels, "_SGD_SOURCE", fused)
    kernels._checked_sgd_kernel.cache_clear()
    try:
        assert kernels.sgd_kernel() is None
    finally:
        monkeypatch.undo()
        kernels._checked_sgd_kernel.cache_clear()
    assert kernels.sgd_kernel() is not None


@pytest.mark.parametrize("n", [8, 64, 130])
def test_member_batches_follow_each_members_own_order(n):
    """Step s holds rows [s*b, (s+1)*b) of member 0's order, then of member 1's, ...; the
    last step is the partial batch (also when there is no full one)."""
    from fedfusion.accel.stacked import _member_batches

    g = torch.Generator().manual_seed(n)
    orders = torch.stack([torch.randperm(n, generator=g) for _ in range(3)])
    batches = _member_batches(orders, 64)
    starts = list(range(0, n, 64))
    assert len(batches) == len(starts)
    for batch, begin in zip(batches, starts, strict=True):
        assert batch.is_contiguous()
        assert torch.equal(batch, orders[:, begin:begin + 64].reshape(-1))
