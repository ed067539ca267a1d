"""SWA: hand-computable weights, FedAvg equivalences, multi-round on real FMNIST, the CIFAR CNN
path on generated data, and its run-config keys."""

import numpy as np
import pytest
import torch
import torchvision.datasets
from conftest import InProcessGrid, initial_models
from flwr.app import ConfigRecord, MetricRecord
from scipy import stats
from test_datasets import FakeCIFAR
from test_payload import SPEC, make_upload

from fedfusion.app.config import ConfigError, Settings, build_strategy
from fedfusion.datasets import load_dataset
from fedfusion.payload import ClientUpload, encode_models
from fedfusion.predictors import ModelSpec
from fedfusion.server_app import run_server
from fedfusion.strategies import (
    FedAvg,
    StatisticalWeightAggregation,
)
from fedfusion.strategies.swa import SWA_DISTANCES, gaussianity_scores, layer_weights

TINY = ModelSpec("mlp", (1, 2, 4), 2, {"hidden_layers": 0})  # one Linear(8, 2): 16 weights


def _tiny_upload(client: int, weight: np.ndarray, examples: int = 100) -> ClientUpload:
    return ClientUpload(client, "mlp", {"hidden_layers": 0}, examples,
                        [{"weights": {"net.1.weight": weight.astype(np.float32).reshape(2, 8)}}])


def _fuse(strategy: StatisticalWeightAggregation, uploads: list[ClientUpload]) -> np.ndarray:
    return strategy.fuse(uploads).members[0].state_dict()["net.1.weight"].numpy()


SYMMETRIC = np.array([-3, -1, -1, 0, 0, 1, 1, 3, -2, 2, -5, 5, 0, 0, -1, 1], dtype=np.float64)
SKEWED = np.array([0, 0, 0, 0, 0, 0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 0], dtype=np.float64)


def test_hand_built_two_clients_hos():
    strategy = StatisticalWeightAggregation(TINY, num_clients=2, distance="hos")
    # k3 = 0 for a symmetric layer: Gd = 0, so the skewed client takes the whole layer
    fused = _fuse(strategy, [_tiny_upload(0, SYMMETRIC), _tiny_upload(1, SKEWED)])
    np.testing.assert_allclose(fused.ravel(), SKEWED, atol=1e-6)
    assert strategy.report()["weights"]["net.1.weight"] == pytest.approx([0.0, 1.0], abs=1e-12)
    # an affine image (positive scale) has the same Gd: equal weights, the plain average
    fused = _fuse(strategy, [_tiny_upload(0, SKEWED), _tiny_upload(1, 2 * SKEWED + 5)])
    np.testing.assert_allclose(fused.ravel(), (3 * SKEWED + 5) / 2, atol=1e-5)
    # the mirror image has k3 k4 of the opposite sign but the same |k3 k4|: they cancel
    fused = _fuse(strategy, [_tiny_upload(0, SKEWED), _tiny_upload(1, -SKEWED)])
    np.testing.assert_allclose(fused.ravel(), 0.0, atol=1e-6)


def test_hand_built_two_clients_with_size_weighting_and_brute_force_scores():
    a = np.array([0, 0, 0, 0, 0, 0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 0], dtype=np.float64)
    b = np.array([0, 1, 0, 2, 0, 3, 0, 4, 0, 0, 1, 0, 0, 0, 0, 9], dtype=np.float64)
    brute = []
    for x in (a, b):
        z = (x - x.mean()) / x.std(ddof=1)
        brute.append(abs(stats.kstat(z, 3) * stats.kstat(z, 4)))
    strategy = StatisticalWeightAggregation(TINY, num_clients=2, distance="hos",
                                            size_weighting=True)
    fused = _fuse(strategy, [_tiny_upload(0, a, examples=100), _tiny_upload(1, b, examples=300)])
    weights = np.array([brute[0] * 100, brute[1] * 300]) / (brute[0] * 100 + brute[1] * 300)
    np.testing.assert_allclose(strategy.report()["gd"]["net.1.weight"], brute, rtol=1e-9)
    np.testing.assert_allclose(fused.ravel(), weights[0] * a + weights[1] * b, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("distance", SWA_DISTANCES)
def test_layer_weights_sum_to_one_and_favour_the_non_gaussian_client(distance):
    rng = np.random.default_rng(0)
    gaussian = make_upload(0, members=1, seed=0)
    skewed = make_upload(1, members=1, seed=1)
    for value in skewed.weights(0).values():
        value[...] = rng.exponential(size=value.shape)
    strategy = StatisticalWeightAggregation(SPEC, num_clients=2, distance=distance)
    strategy.fuse([gaussian, skewed])
    weights = strategy.report()["weights"]
    assert set(weights) == set(gaussian.weights(0))
    for name, (w_gauss, w_skew) in weights.items():
        assert w_gauss + w_skew == pytest.approx(1.0, abs=1e-12)
        if distance == "uniform":
            assert w_gauss == w_skew == 0.5
        else:
            assert w_skew > 0.7, (name, w_skew)


def test_same_layer_distributions_equal_fedavg():
    """Clients whose layers hold the same values (permuted) get equal Gd: SWA with size
    weighting is FedAvg; the uniform distance with size weighting is FedAvg for any layers."""
    rng = np.random.default_rng(1)
    base = make_upload(0, members=2, seed=3)
    uploads = []
    for client, examples in enumerate((100, 250, 650)):
        members = [{"weights": {k: rng.permutation(v.ravel()).reshape(v.shape)
                                for k, v in m["weights"].items()}} for m in base.members]
        uploads.append(ClientUpload(client, "lenet", {}, examples, members))
    fedavg = FedAvg(SPEC, num_clients=3).fuse(uploads)
    distinct = [make_upload(i, members=2, seed=10 + i) for i in range(3)]
    for u, n in zip(distinct, (100, 250, 650), strict=True):
        u.num_examples = n
    for distance, case in [("hos", uploads), ("renyi1", uploads), ("uniform", distinct)]:
        swa = StatisticalWeightAggregation(SPEC, num_clients=3, distance=distance,
                                           size_weighting=True)
        expected = fedavg if case is uploads else FedAvg(SPEC, num_clients=3).fuse(case)
        for fused, reference in zip(swa.fuse(case).members, expected.members, strict=True):
            for name, value in fused.state_dict().items():
                torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5,
                                           atol=1e-6)


def test_identical_clients_fuse_to_that_client():
    upload = make_upload(0, members=1, seed=4)
    swa = StatisticalWeightAggregation(SPEC, num_clients=2, distance="renyi0.5")
    for name, value in swa.fuse([upload, upload]).members[0].state_dict().items():
        np.testing.assert_allclose(value.numpy(), upload.weights(0)[name], rtol=1e-6)


def test_scores_are_deterministic_and_degenerate_layers_average_plainly():
    uploads = [make_upload(i, members=1, seed=i) for i in range(2)]
    arrays = [u.weights(0) for u in uploads]
    first = gaussianity_scores(arrays, "renyi2", seed=7)
    again = gaussianity_scores(arrays, "renyi2", seed=7)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    weights = layer_weights({"bias": np.zeros(3)}, sizes=[1, 1, 2])
    np.testing.assert_allclose(weights["bias"], [0.25, 0.25, 0.5])
    with pytest.raises(ValueError, match="unknown swa-distance 'kl'"):
        StatisticalWeightAggregation(SPEC, num_clients=2, distance="kl")


def test_multi_round_swa_improves_on_real_fmnist(small_settings):
    """3 clients, 3 rounds x 3 epochs on 3,000 real FMNIST images: round 3 beats round 1 and
    clears 60% (FedAvg's floor in the same setting)."""
    settings = small_settings.replace(strategy="swa", num_rounds=3, alpha=100.0, run_name="swa")
    results = run_server(settings, InProcessGrid(settings))
    accuracies = [r["test_accuracy"] for r in results["rounds"]]
    assert len(accuracies) == 3
    assert accuracies[-1] > accuracies[0] and accuracies[-1] > 0.6
    report = results["strategy_report"]
    assert report["distance"] == "hos" and report["clients"] == [0, 1, 2]
    for weights in report["weights"].values():
        assert sum(weights) == pytest.approx(1.0)


def test_one_shot_swa_and_its_replay(small_settings, tmp_path):
    """One round (3 epochs, IID): above chance, and a replay of the saved uploads reproduces
    it exactly (the statistics and the reference samples are deterministic)."""
    settings = small_settings.replace(strategy="swa", swa_distance="renyi1", alpha=100.0,
                                      run_name="swa1")
    live = run_server(settings, InProcessGrid(settings))
    assert live["status"] == "ok" and live["test"]["accuracy"] > 0.2
    replayed = run_server(settings.replace(replay=str(tmp_path / "swa1" / "uploads"),
                                           run_name="re"))
    assert replayed["test"] == live["test"]
    assert replayed["strategy_report"] == live["strategy_report"]


def test_cifar10_cnn_path_on_generated_data(tmp_path, monkeypatch):
    """The CIFAR-10 default model (the bias-free CNN, 939,616 weights) through SWA, two rounds,
    on faked 3x32x32 data: shapes, weights summing to 1, a fused layer inside the clients'
    hull, log-probabilities out."""
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR)
    load_dataset.cache_clear()
    try:
        settings = Settings(dataset="cifar10", data_dir=str(tmp_path), val_size=4,
                            partitioner="iid", num_clients=2, local_epochs=1, batch_size=8,
                            strategy="swa", output_dir=str(tmp_path), seed=3)
        spec = ModelSpec("cnn", (3, 32, 32), 10)
        strategy = build_strategy(settings, spec)
        strategy.start(InProcessGrid(settings), encode_models(initial_models(spec, 1, 3)),
                       num_rounds=2, train_config=ConfigRecord(),
                       evaluate_fn=lambda rnd, arrays: MetricRecord({}))
    finally:
        load_dataset.cache_clear()
    assert [u.model for u in strategy.uploads] == ["cnn", "cnn"]
    report = strategy.report()
    assert len(report["weights"]) == 5
    for weights in report["weights"].values():
        assert sum(weights) == pytest.approx(1.0)
    fused = strategy.predictor.members[0].state_dict()
    for name, value in fused.items():
        clients = np.stack([u.weights(0)[name] for u in strategy.uploads])
        assert np.all(value.numpy() >= clients.min(0) - 1e-6)
        assert np.all(value.numpy() <= clients.max(0) + 1e-6)
    out = strategy.predictor(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 10)
    torch.testing.assert_close(out.exp().sum(1), torch.ones(3))


@pytest.mark.parametrize(("values", "message"), [
    ({"swa-distance": "renyi3"}, "'swa-distance' is 'renyi3'"),
    ({"prox-mu": -0.1}, "'prox-mu' must be"),
    ({"contrastive-weight": float("nan")}, "'contrastive-weight' must be"),
    ({"contrastive-temperature": 0.0}, "'contrastive-temperature' must be > 0"),
    ({"swa-size-weighting": "yes"}, "'swa-size-weighting' must be bool"),
])
def test_swa_run_config_is_validated(values, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_mapping(values)


def test_build_strategy_reads_the_swa_keys():
    settings = Settings(strategy="swa", swa_distance="renyi0.5", swa_size_weighting=True)
    strategy = build_strategy(settings, SPEC)
    assert isinstance(strategy, StatisticalWeightAggregation)
    assert (strategy.distance, strategy.size_weighting) == ("renyi0.5", True)
    assert not strategy.one_shot_only and strategy.client_config == {}
