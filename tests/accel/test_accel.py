"""The optional acceleration (fedfusion.accel) is opt-in, equal to the default path, and
loads only verified builds from a private cache."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from torch import nn

from fedfusion import accel, client
from fedfusion.accel import asdl_speedup, fast_kron, kernels, stacked
from fedfusion.curvature import KronCurvature, fit_curvature
from fedfusion.models import build_model
from fedfusion.training import TrainConfig, train_local, train_members


def _lenet_data(n: int = 192) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = build_model("lenet", (1, 28, 28), 10)
    train_local(model, x, y, TrainConfig(epochs=1, batch_size=32), seed=0)
    return model, x, y


def test_requested_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(accel.ENV, raising=False)
    assert not accel.requested() and accel.requested(True) and not accel.requested(False)
    monkeypatch.setenv(accel.ENV, "1")
    assert accel.requested() and not accel.requested(False)
    monkeypatch.setenv(accel.ENV, "no")
    assert not accel.requested()


def test_the_default_library_path_never_touches_the_accelerated_code(monkeypatch):
    """make_upload (Kron on a bias-free LeNet, the stacked engine's best case) and
    train_members run without the stacked trainer, its compiler or ASDL's patch."""
    monkeypatch.delenv(accel.ENV, raising=False)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the default library path reached fedfusion.accel")

    for module, name in [(kernels, "_library"), (stacked, "compile_members"),
                         (fast_kron, "kron_mc_factors"), (asdl_speedup, "patched")]:
        monkeypatch.setattr(module, name, refuse)
    model, x, y = _lenet_data()
    upload = client.make_upload([model], x, y, ["weights", "curvature.kron"])
    assert "curvature.kron" in upload.members[0]
    stats = train_members([build_model("lenet", (1, 28, 28), 10)], x, y,
                          TrainConfig(epochs=1, batch_size=64), [0])
    assert stats[0].samples == len(y)


def test_accelerated_kron_fit_equals_the_default_one():
    """The compiled fit draws the same MC labels as laplace-torch's asdl_mc: the same factors
    to float tolerance (and so the same upload)."""
    model, x, y = _lenet_data()
    plain = fit_curvature(model, x, y, "kron", seed=4, batch_size=64, accelerate=False)
    fast = fit_curvature(model, x, y, "kron", seed=4, batch_size=64, accelerate=True)
    assert isinstance(plain, KronCurvature) and isinstance(fast, KronCurvature)
    assert plain.factors.keys() == fast.factors.keys()
    for name, factor in plain.factors.items():
        for attr in ("eigvals_in", "eigvals_out"):
            a, b = getattr(factor, attr), getattr(fast.factors[name], attr)
            if a is None:
                assert b is None
                continue
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6 * float(a.abs().max()))
    # a different seed is a different MC estimate: the comparison above can fail
    other = fit_curvature(model, x, y, "kron", seed=5, batch_size=64, accelerate=True)
    first = next(iter(plain.factors))
    assert not torch.allclose(other.factors[first].eigvals_out,
                              plain.factors[first].eigvals_out, rtol=1e-3)


def test_asdl_patch_lives_only_inside_the_fit():
    from asdl.operations.conv import Conv2d

    found = {name: Conv2d.__dict__[name] for name in ("cov_kron_A", "cov_kron_B")}
    with asdl_speedup.patched() as used:
        assert used and Conv2d.__dict__["cov_kron_A"] is not found["cov_kron_A"]
        with asdl_speedup.patched():  # nested: one swap
            pass
        assert Conv2d.__dict__["cov_kron_A"] is not found["cov_kron_A"]
    assert {name: Conv2d.__dict__[name] for name in found} == found
    model, x, y = _lenet_data(96)
    fit_curvature(model, x, y, "kron", backend="asdl_ggn", batch_size=32, accelerate=True)
    assert {name: Conv2d.__dict__[name] for name in found} == found


@pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler")
def test_kernel_cache_is_private_and_loads_only_verified_builds(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setenv(kernels.CACHE_ENV, str(cache))
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    kernels._library.cache_clear()
    source = "int fedfusion_probe(void) { return 41; }\n"
    lib = kernels._library(source)
    assert lib is not None and lib.fedfusion_probe() == 41
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    built = next(cache.glob("*.so"))
    assert built.with_suffix(".sha256").read_text().strip() == kernels._sha256(built)
    # a swapped build (same name, other bytes) is rebuilt, not loaded
    swapped = tmp_path / "swapped.so"  # a new file: the loaded one stays mapped as it was
    swapped.write_bytes(built.read_bytes() + b"tampered")
    os.replace(swapped, built)
    kernels._library.cache_clear()
    with caplog.at_level("WARNING", logger="fedfusion"):
        again = kernels._library(source)
    assert "does not match its recorded hash" in caplog.text
    assert again is not None and again.fedfusion_probe() == 41
    assert kernels._sha256(built) == built.with_suffix(".sha256").read_text().strip()
    # an old cache open to others is closed before use
    os.chmod(cache, 0o777)
    kernels.private_cache_dir()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    kernels._library.cache_clear()


@pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler")
def test_with_a_compiler_the_kernels_build(monkeypatch):
    """A failed build must fail here, not hide behind the PyTorch fallback."""
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    assert kernels.pool_kernels() is not None
    assert kernels.conv_kernels(1, 6, 28, 28, 5, 5) is not None
