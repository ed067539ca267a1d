"""Where a client computes (run-config ``client-device``, :mod:`fedfusion.device`): ``auto``
is the CPU on a process without a GPU and is reported so, ``cuda`` is refused there naming
the client, an explicit ``cpu`` gives the very upload ``auto`` gives, and the library's
``make_upload`` reports the device of the models it is given. The same client on a GPU is
checked against the CPU where one is present (skipped otherwise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import InProcessGrid, initial_models
from torch import nn

from fedfusion.app.client_round import run_client
from fedfusion.app.config import ConfigError, Settings
from fedfusion.client import make_upload
from fedfusion.client_app import settings_for_node
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.diagnostics import client_table
from fedfusion.device import DEVICE_METRIC, client_device, device_label, device_metric
from fedfusion.server_app import run_server
from fedfusion.wire import decode_upload, encode_upload

LENET = ModelSpec("lenet", (1, 28, 28), 10)
#: every section kind a client builds: weights, a Kron fit (the compiled one on the CPU,
#: laplace-torch's elsewhere), Grams
SECTIONS = ("weights", "curvature.kron", "gram")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a process without a GPU")


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_client_device_accepts_the_documented_values(value):
    assert Settings(client_device=value).client_device == value
    # a SuperNode may set its own (a device with a GPU among CPU-only ones)
    assert settings_for_node({}, {"client-device": value}).client_device == value


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "mps", ""])
def test_client_device_refuses_anything_else(value):
    with pytest.raises(ConfigError, match="client-device"):
        Settings.from_mapping({"client-device": value})


@no_gpu
def test_auto_is_the_cpu_here_and_cuda_is_refused_naming_the_client():
    assert client_device("auto", 3) == torch.device("cpu")
    assert client_device("cpu", 3) == torch.device("cpu")
    for name in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(ValueError, match=rf"client 7: device '{name}' but this "
                                             "process sees no CUDA device"):
            client_device(name, 7)
    with pytest.raises(ValueError, match="client 7"):
        client_device("tpu", 7)


def test_device_metric_round_trips_to_its_label():
    assert device_label(device_metric(torch.device("cpu"))) == "cpu"
    assert device_label(device_metric(torch.device("cuda", 2))) == "cuda:2"
    assert device_label(device_metric(torch.device("meta"))) == "other"
    for bad in (None, -3, True, 0.5, "cpu"):
        assert device_label(bad) is None


def _client(settings: Settings, sections=SECTIONS):
    inits = initial_models(LENET, settings.num_members, settings.seed)
    return run_client(settings, 1, inits, sections)


@no_gpu
def test_explicit_cpu_and_auto_give_the_same_upload_and_report_the_cpu(small_settings):
    settings = small_settings.replace(train_subset=600, local_epochs=1, num_members=2)
    auto = _client(settings)
    cpu = _client(settings.replace(client_device="cpu"))
    assert auto.metrics[DEVICE_METRIC] == cpu.metrics[DEVICE_METRIC] == -1
    for a, c in zip(auto.members, cpu.members, strict=True):
        assert a.keys() == c.keys() == set(SECTIONS)
        for section in SECTIONS:
            assert a[section].keys() == c[section].keys()
            for name in a[section]:
                assert np.array_equal(a[section][name], c[section][name]), (section, name)
    # through the wire into results.json's client table
    decoded = decode_upload(encode_upload(auto), "client 1",
                            lambda _model, _kwargs: LENET.param_shapes(), SECTIONS)
    assert client_table([decoded])[0]["device"] == "cpu"


@no_gpu
def test_a_client_asked_for_cuda_fails_before_training(small_settings):
    settings = small_settings.replace(client_device="cuda", train_subset=600, local_epochs=1)
    with pytest.raises(ValueError, match="client 1: device 'cuda'"):
        _client(settings)


def test_make_upload_reports_the_models_device_and_refuses_mixed_devices():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    x, y = torch.randn(20, 1, 2, 2), torch.arange(20) % 3
    upload = make_upload([model], x, y, ("weights", "gram"))
    assert upload.metrics[DEVICE_METRIC] == -1
    assert upload.members[0]["gram"]["1.weight"].shape == (5, 5)
    meta = nn.Sequential(nn.Flatten(), nn.Linear(4, 3)).to("meta")
    with pytest.raises(ValueError, match="different devices"):
        make_upload([model, meta], x, y)
    # a caller's own metric wins over the reported device
    assert make_upload([model], x, y, metrics={DEVICE_METRIC: 0}).metrics[DEVICE_METRIC] == 0


def test_an_upload_with_a_malformed_device_metric_is_refused_naming_the_client():
    torch.manual_seed(0)
    upload = make_upload([nn.Sequential(nn.Flatten(), nn.Linear(4, 3))],
                         torch.randn(6, 1, 2, 2), torch.arange(6) % 3)
    upload.metrics[DEVICE_METRIC] = -7
    from fedfusion.wire import UploadError, UploadLimits

    with pytest.raises(UploadError, match=f"client 4.*{DEVICE_METRIC}"):
        decode_upload(encode_upload(upload), "client 4",
                      lambda _m, _k: {"1.weight": (3, 4), "1.bias": (3,)},
                      limits=UploadLimits(upload_bytes=10**6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_client_on_the_gpu_matches_the_cpu(small_settings):
    """Training, the Kron fit (laplace-torch's on the GPU, the compiled one on the CPU: the
    same MC-Fisher factors) and the Grams on ``cuda``: the same upload layout as the CPU's,
    weights within float tolerance after one epoch, curvature and Grams close."""
    settings = small_settings.replace(train_subset=600, local_epochs=1)
    gpu = _client(settings.replace(client_device="cuda"), (*SECTIONS, "curvature.diag_full"))
    cpu = _client(settings.replace(client_device="cpu"), (*SECTIONS, "curvature.diag_full"))
    assert gpu.metrics[DEVICE_METRIC] == torch.cuda.current_device()
    assert cpu.metrics[DEVICE_METRIC] == -1
    for g, c in zip(gpu.members, cpu.members, strict=True):
        assert g.keys() == c.keys()
        for section in g:
            assert g[section].keys() == c[section].keys()
            for name in g[section]:
                a, b = g[section][name], c[section][name]
                assert (a.shape, a.dtype) == (b.shape, b.dtype), (section, name)
        for name, w in g["weights"].items():
            # cuDNN convolutions may run in TF32 (10-bit mantissa) on the GPU
            np.testing.assert_allclose(w, c["weights"][name], rtol=1e-2, atol=1e-3)
        for name, gram in g["gram"].items():
            err = np.linalg.norm(gram - c["gram"][name]) / np.linalg.norm(c["gram"][name])
            assert err < 1e-2, name
        # MC draws differ between the devices: the factors' spectra agree to MC noise
        for name, vals in g["curvature.kron"].items():
            if "eigvals" in name:
                ref = c["curvature.kron"][name]
                assert abs(vals.sum() - ref.sum()) <= 0.2 * abs(ref.sum()) + 1e-6, name
    decoded = decode_upload(encode_upload(gpu), "client 1",
                            lambda _model, _kwargs: LENET.param_shapes(), SECTIONS)
    assert client_table([decoded])[0]["device"] == f"cuda:{torch.cuda.current_device()}"


@no_gpu
def test_a_federation_reports_each_clients_device_and_excludes_a_cuda_client_by_name(
        small_settings):
    """Through the server and the in-process grid: ``auto`` clients report ``"cpu"`` in
    results.json; a run asking for ``cuda`` on a machine without one excludes every client
    with the reason naming it (the round then fails), instead of training anywhere."""
    settings = small_settings.replace(train_subset=600, local_epochs=1)
    results = run_server(settings.replace(run_name="auto"), InProcessGrid(settings))
    assert results["status"] == "ok"
    assert [c["device"] for c in results["clients"]] == ["cpu"] * settings.num_clients
    cuda = settings.replace(client_device="cuda", run_name="cuda")
    with pytest.raises(RuntimeError, match="0 valid upload") as failed:
        run_server(cuda, InProcessGrid(cuda))
    for client in range(settings.num_clients):
        assert f"client {client}: device 'cuda' but this process sees no CUDA" in str(
            failed.value)
