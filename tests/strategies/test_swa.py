"""SWA: hand-computable weights, normalisation layers and buffers, FedAvg equivalences,
multi-round on real FMNIST, the CIFAR CNN path on generated data, and its run-config keys."""

import dataclasses

import numpy as np
import pytest
import torch
import torchvision.datasets
from conftest import InProcessGrid, initial_models, run_keeping_last_round
from flwr.app import ConfigRecord, MetricRecord
from helpers.fake_datasets import FakeCIFAR
from helpers.uploads import SPEC, make_upload
from scipy import stats
from torch import nn
from torch.nn import functional as F

from fedfusion.app.config import ConfigError, Settings, build_strategy
from fedfusion.core.predictors import ModelSpec
from fedfusion.core.state import weighted_average
from fedfusion.datasets import load_dataset
from fedfusion.server_app import run_server
from fedfusion.strategies import (
    FedAvg,
    StatisticalWeightAggregation,
)
from fedfusion.strategies.predictors import load_predictor
from fedfusion.strategies.swa.strategy import (
    SWA_DISTANCES,
    buffer_owners,
    gaussianity_scores,
    layer_weights,
)
from fedfusion.upload_store import load_uploads
from fedfusion.wire import ClientUpload, encode_models

TINY = ModelSpec("mlp", (1, 2, 4), 2, {"hidden_layers": 0})  # one Linear(8, 2): 16 weights


def _tiny_upload(client: int, weight: np.ndarray, examples: int = 100) -> ClientUpload:
    return ClientUpload(client, "mlp", {"hidden_layers": 0}, examples,
                        [{"weights": {"net.1.weight": weight.astype(np.float32).reshape(2, 8)}}])


def _fuse(strategy: StatisticalWeightAggregation, uploads: list[ClientUpload]) -> np.ndarray:
    return strategy.fuse(uploads).members[0].state_dict()["net.1.weight"].numpy()


SYMMETRIC = np.array([-3, -1, -1, 0, 0, 1, 1, 3, -2, 2, -5, 5, 0, 0, -1, 1], dtype=np.float64)
SKEWED = np.array([0, 0, 0, 0, 0, 0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 0], dtype=np.float64)


def test_hand_built_two_clients_hos():
    strategy = StatisticalWeightAggregation(TINY, num_clients=2, distance="hos", score_cap=0)
    # the paper's rule (no score cap); k3 = 0 for a symmetric layer: Gd = 0, so the skewed
    # client takes the whole layer
    fused = _fuse(strategy, [_tiny_upload(0, SYMMETRIC), _tiny_upload(1, SKEWED)])
    np.testing.assert_allclose(fused.ravel(), SKEWED, atol=1e-6)
    assert strategy.report()["weights"]["net.1.weight"] == pytest.approx([0.0, 1.0], abs=1e-12)
    # an affine image (positive scale) has the same Gd: equal weights, the plain average
    fused = _fuse(strategy, [_tiny_upload(0, SKEWED), _tiny_upload(1, 2 * SKEWED + 5)])
    np.testing.assert_allclose(fused.ravel(), (3 * SKEWED + 5) / 2, atol=1e-5)
    # the mirror image has k3 k4 of the opposite sign but the same |k3 k4|: they cancel
    fused = _fuse(strategy, [_tiny_upload(0, SKEWED), _tiny_upload(1, -SKEWED)])
    np.testing.assert_allclose(fused.ravel(), 0.0, atol=1e-6)


@pytest.mark.parametrize("weighted_by_key", ["num-examples", "data-size"])
def test_hand_built_two_clients_with_size_weighting_and_brute_force_scores(weighted_by_key):
    """Size weighting multiplies by each client's weight: its example count, or the metric
    ``weighted_by_key`` names (here 100 and 300 while both claim 200 examples)."""
    a = np.array([0, 0, 0, 0, 0, 0, 0, 8, 1, 0, 0, 0, 2, 0, 0, 0], dtype=np.float64)
    b = np.array([0, 1, 0, 2, 0, 3, 0, 4, 0, 0, 1, 0, 0, 0, 0, 9], dtype=np.float64)
    brute = []
    for x in (a, b):
        z = (x - x.mean()) / x.std(ddof=1)
        brute.append(abs(stats.kstat(z, 3) * stats.kstat(z, 4)))
    strategy = StatisticalWeightAggregation(TINY, num_clients=2, distance="hos",
                                            size_weighting=True, weighted_by_key=weighted_by_key)
    uploads = [_tiny_upload(0, a, examples=100), _tiny_upload(1, b, examples=300)]
    if weighted_by_key != "num-examples":
        uploads = [dataclasses.replace(u, num_examples=200, metrics={weighted_by_key: n})
                   for u, n in zip(uploads, (100, 300), strict=True)]
    fused = _fuse(strategy, uploads)
    weights = np.array([brute[0] * 100, brute[1] * 300]) / (brute[0] * 100 + brute[1] * 300)
    np.testing.assert_allclose(strategy.report()["gd"]["net.1.weight"], brute, rtol=1e-9)
    np.testing.assert_allclose(fused.ravel(), weights[0] * a + weights[1] * b, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("distance", SWA_DISTANCES)
class NormNet(nn.Module):
    """fc1 (2->4) -> BatchNorm1d(4) -> ReLU -> fc2 (4->3) -> LayerNorm(3), bias-free Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 4, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(4, 3, bias=False)
        self.ln = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc2(F.relu(self.bn(self.fc1(x.flatten(1))))))


NORM = ModelSpec("NormNet", (1, 1, 2), 3, model_fn=NormNet)


def _hos(x: np.ndarray) -> float:
    """|k3 k4| of the standardised values, by scipy."""
    z = (x - x.mean()) / x.std(ddof=1)
    return abs(stats.kstat(z, 3) * stats.kstat(z, 4))


def test_normalisation_parameters_and_buffers_follow_the_stated_rule():
    """Two NormNet clients (100 and 300 examples, size weighting on), values chosen by hand:
    fc1 / bn.weight get Gaussianity weights; bn.bias (client 0 still at its zero init) and
    the 3-entry LayerNorm tensors have no defined distance, so they are the size-weighted
    average 1/4, 3/4; bn's running statistics take bn.weight's weights, num_batches_tracked
    is not averaged but follows weighted_average's rule with bn.weight's weights."""
    f32 = np.float32
    a = {"fc1.weight": np.array([-3, -1, -1, 0, 0, 1, 1, 3], f32).reshape(4, 2),  # k3 = 0
         "bn.weight": np.array([1.0, 1.0, 1.0, 2.0], f32),
         "bn.bias": np.zeros(4, f32),
         "bn.running_mean": np.array([0.1, 0.2, 0.3, 0.4], f32),
         "bn.running_var": np.array([1.0, 2.0, 3.0, 4.0], f32),
         "bn.num_batches_tracked": np.array(5, np.int64),
         "fc2.weight": np.arange(12, dtype=f32).reshape(3, 4) ** 2 / 50,
         "ln.weight": np.array([1.0, 0.9, 1.2], f32),
         "ln.bias": np.array([0.0, 0.1, -0.1], f32)}
    b = {"fc1.weight": np.array([0, 0, 0, 0, 0, 0, 1, 8], f32).reshape(4, 2),
         "bn.weight": np.array([0.5, 1.0, 1.5, 3.0], f32),
         "bn.bias": np.array([0.1, -0.2, 0.3, 0.6], f32),
         "bn.running_mean": np.array([1.0, 2.0, 3.0, 4.0], f32),
         "bn.running_var": np.array([0.5, 0.5, 0.25, 2.0], f32),
         "bn.num_batches_tracked": np.array(7, np.int64),
         "fc2.weight": np.sqrt(np.arange(12, dtype=f32)).reshape(3, 4),
         "ln.weight": np.array([0.8, 1.1, 1.0], f32),
         "ln.bias": np.array([0.2, 0.0, 0.3], f32)}
    uploads = [ClientUpload(0, NORM.name, {}, 100, [{"weights": a}]),
               ClientUpload(1, NORM.name, {}, 300, [{"weights": b}])]
    strategy = StatisticalWeightAggregation(NORM, num_clients=2, distance="hos", score_cap=0,
                                            size_weighting=True)
    fused = {k: v.numpy() for k, v in strategy.fuse(uploads).members[0].state_dict().items()}
    report = strategy.report()
    weights = report["weights"]
    # fc1: client 0 is symmetric (k3 = 0, Gd = 0), so client 1 takes the layer
    assert weights["fc1.weight"] == pytest.approx([0.0, 1.0], abs=1e-12)
    np.testing.assert_allclose(fused["fc1.weight"], b["fc1.weight"], atol=1e-6)
    # bn.weight: a normalisation parameter weighted like any tensor (4 entries: defined)
    gd = np.array([_hos(a["bn.weight"].astype(np.float64)),
                   _hos(b["bn.weight"].astype(np.float64))])
    expected = gd * [100, 300] / np.sum(gd * [100, 300])
    assert gd.min() > 0 and abs(expected[0] - 0.25) > 0.05  # not the size average
    np.testing.assert_allclose(report["gd"]["bn.weight"], gd, rtol=1e-6)
    np.testing.assert_allclose(weights["bn.weight"], expected, rtol=1e-6)
    np.testing.assert_allclose(fused["bn.weight"], expected[0] * a["bn.weight"]
                               + expected[1] * b["bn.weight"], rtol=1e-5)
    # undefined distances (a constant tensor; 3 entries): the size-weighted average
    assert report["undefined"] == ["bn.bias", "ln.bias", "ln.weight"]
    assert report["gd"]["bn.bias"][0] is None and report["gd"]["bn.bias"][1] > 0
    for name in ("bn.bias", "ln.weight", "ln.bias"):
        assert weights[name] == pytest.approx([0.25, 0.75], abs=1e-12), name
        np.testing.assert_allclose(fused[name], 0.25 * a[name] + 0.75 * b[name], rtol=1e-6,
                                   atol=1e-7, err_msg=name)
    # buffers: bn.weight's weights; running statistics averaged with them
    assert report["buffers"] == {"bn.running_mean": "bn.weight", "bn.running_var": "bn.weight",
                                 "bn.num_batches_tracked": "bn.weight"}
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        np.testing.assert_allclose(weights[name], expected, rtol=1e-6)
        assert name not in report["gd"]
    for name in ("bn.running_mean", "bn.running_var"):
        np.testing.assert_allclose(fused[name], expected[0] * a[name] + expected[1] * b[name],
                                   rtol=1e-5, err_msg=name)
    # the counter: whatever weighted_average does with an integer entry under these weights
    counter = weighted_average([a, b], {k: np.asarray(v) for k, v in weights.items()})
    assert fused["bn.num_batches_tracked"] == counter["bn.num_batches_tracked"]
    assert sorted(fused) == sorted(a)
    for w in weights.values():
        assert sum(w) == pytest.approx(1.0)


def test_buffer_owners():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False), nn.BatchNorm1d(3))
    model.register_buffer("scale", torch.ones(1))
    assert buffer_owners(model) == {
        "scale": None,
        "1.running_mean": None, "1.running_var": None, "1.num_batches_tracked": None,
        "2.running_mean": "2.weight", "2.running_var": "2.weight",
        "2.num_batches_tracked": "2.weight"}
    # a buffer of a parameterless module takes the size weights
    uploads = []
    for client, examples in ((0, 100), (1, 300)):
        torch.manual_seed(client)
        bn = nn.BatchNorm1d(4, affine=False)
        bn.running_mean.normal_()
        uploads.append(ClientUpload(client, "BN", {}, examples, [{"weights": {
            k: v.numpy().copy() for k, v in bn.state_dict().items()}}]))
    spec = ModelSpec("BN", (4,), 4, model_fn=lambda: nn.BatchNorm1d(4, affine=False))
    strategy = StatisticalWeightAggregation(spec, num_clients=2, size_weighting=True)
    fused = strategy.fuse(uploads).members[0].state_dict()
    assert strategy.report()["weights"]["running_mean"] == pytest.approx([0.25, 0.75])
    np.testing.assert_allclose(fused["running_mean"].numpy(),
                               0.25 * uploads[0].weights()["running_mean"]
                               + 0.75 * uploads[1].weights()["running_mean"], rtol=1e-6)


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
    # twins earn no weight by being two: symmetric twins (client 0 and 1: k3 = 0, Gd = 0)
    # beside a skewed client, the skewed one takes the whole layer under the paper's rule
    # (client 0's model and FedAvg are other weights)
    swa = StatisticalWeightAggregation(TINY, num_clients=3, distance="hos", score_cap=0)
    fused = _fuse(swa, [_tiny_upload(0, SYMMETRIC), _tiny_upload(1, SYMMETRIC),
                        _tiny_upload(2, SKEWED)])
    np.testing.assert_allclose(fused.ravel(), SKEWED, atol=1e-6)


def test_scores_are_deterministic_and_degenerate_layers_average_plainly():
    uploads = [make_upload(i, members=1, seed=i) for i in range(2)]
    arrays = [u.weights(0) for u in uploads]
    first = gaussianity_scores(arrays, "renyi2", seed=7)
    again = gaussianity_scores(arrays, "renyi2", seed=7)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    weights = layer_weights({"bias": np.zeros(3)}, sizes=[1, 1, 2])
    np.testing.assert_allclose(weights["bias"], [0.25, 0.25, 0.5])
    with pytest.raises(ValueError, match="unknown distance 'kl'"):
        StatisticalWeightAggregation(SPEC, num_clients=2, distance="kl")


def test_multi_round_swa_improves_on_real_fmnist(small_settings):
    """3 clients, 3 rounds x 3 epochs on 3,000 real FMNIST images: round 3 beats round 1 and
    clears 60% (FedAvg's floor in the same setting), and the final model is SWA's fusion of
    round 3's replies (recorded on the wire): their layer-wise average with the Gd weights,
    which are not the sample-size weights, so FedAvg in any round fails here."""
    settings = small_settings.replace(strategy="swa", num_rounds=3, alpha=100.0, run_name="swa")
    results, last, fused = run_keeping_last_round(settings)
    accuracies = [r["test_accuracy"] for r in results["rounds"]]
    assert len(accuracies) == 3
    assert accuracies[-1] > accuracies[0] and accuracies[-1] > 0.6
    spec = ModelSpec(results["model"], (1, 28, 28), 10)
    weights = StatisticalWeightAggregation(spec).entry_weights(last, 0).weights
    expected = weighted_average([u.weights(0) for u in last], weights)
    by_size = weighted_average([u.weights(0) for u in last], [u.num_examples for u in last])
    gap = 0.0
    for name, value in fused.items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-5, atol=1e-6)
        gap = max(gap, float(np.abs(value.numpy() - by_size[name]).max()))
    assert gap > 1e-4, gap  # not FedAvg's model
    report = results["strategy_report"]
    assert report["distance"] == "hos" and report["clients"] == [0, 1, 2]
    assert report["weights"] == {k: v.tolist() for k, v in weights.items()}


def test_one_shot_swa_and_its_replay(small_settings, tmp_path):
    """One round (3 epochs, IID), against FedAvg of the same uploads. SWA is not more accurate
    than FedAvg here (measured: SWA 29.6%, FedAvg 29.5%), so what tells it from a FedAvg
    stub is the fused model itself: it is the layer-wise average with the reported Gd weights
    (computed here from the uploads), and those weights are not the sample-size ones, so it
    differs from FedAvg's. A replay of the saved uploads reproduces it exactly (the statistics
    and the reference samples are deterministic)."""
    settings = small_settings.replace(strategy="swa", swa_distance="renyi1", alpha=100.0,
                                      run_name="swa1")
    live = run_server(settings, InProcessGrid(settings))
    uploads = tmp_path / "swa1" / "uploads"
    fedavg = run_server(settings.replace(strategy="fedavg", replay=str(uploads),
                                         run_name="fedavg"))
    print(live["test"], fedavg["test"])
    assert live["status"] == "ok" and live["test"]["accuracy"] > 0.2  # sanity: chance is 10%
    _, clients, _ = load_uploads(uploads)
    arrays = [u.weights(0) for u in clients]
    weights = StatisticalWeightAggregation(SPEC, distance="renyi1").entry_weights(
        clients, 0).weights
    expected = weighted_average(arrays, weights)
    by_size = weighted_average(arrays, [u.num_examples for u in clients])
    fused = load_predictor(tmp_path / "swa1" / "predictor.pt").members[0].state_dict()
    gap = 0.0
    for name, value in fused.items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-5, atol=1e-6)
        gap = max(gap, float(np.abs(value.numpy() - by_size[name]).max()))
    # IID clients from one init: Gd weights near 1/3 (measured: up to 0.019 away), so SWA's
    # model is near FedAvg's (measured: up to 2.4e-4 apart, 240x the tolerance above)
    assert max(float(np.abs(w - 1 / 3).max()) for w in weights.values()) > 0.01
    assert gap > 1e-4, gap  # not FedAvg's model
    assert live["strategy_report"]["weights"] == {k: v.tolist() for k, v in weights.items()}
    replayed = run_server(settings.replace(replay=str(uploads), run_name="re"))
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
    ({"contrastive-temperature": 0.0}, "'contrastive-temperature' must be a finite number > 0"),
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


def test_the_score_cap_bounds_one_clients_share_of_a_layer():
    """Gd'_n = min(Gd_n, k median_{j != n} Gd_j) against the weights by hand: five clients
    with near-Gaussian layers and one whose layer is one spike (|k3 k4| in the thousands,
    ordinary norm). Under the paper's rule (score_cap=0) the spike takes over 95% of the
    layer; capped at k = 3 its score is 3x the others' median (its share 0.43 here; at most
    k / (k + C - 1) = 3/8 were the others' scores equal) and the others keep their relative
    weights; the report names the capped client."""
    rng = np.random.default_rng(0)
    honest = [rng.standard_normal(16) for _ in range(5)]
    spike = np.zeros(16)
    spike[3] = 4.0
    uploads = [_tiny_upload(c, w) for c, w in enumerate([*honest, spike])]
    gd = np.array([_hos(w) for w in [*honest, spike]])
    paper = StatisticalWeightAggregation(TINY, num_clients=6, distance="hos", score_cap=0)
    _fuse(paper, uploads)
    assert paper.report()["weights"]["net.1.weight"][5] > 0.95
    assert paper.report()["capped"] == {}
    capped = StatisticalWeightAggregation(TINY, num_clients=6, distance="hos")
    fused = _fuse(capped, uploads)
    by_hand = np.array([min(g, 3 * np.median(np.delete(gd, n))) for n, g in enumerate(gd)])
    share = by_hand / by_hand.sum()
    weights = capped.report()["weights"]["net.1.weight"]
    assert weights == pytest.approx(share, abs=1e-6)  # the scores of float32 uploads
    assert weights[5] < 0.45
    np.testing.assert_allclose(fused.ravel(), sum(a * w for a, w in zip(
        share, [*honest, spike], strict=True)), rtol=1e-5, atol=1e-6)
    assert capped.report()["capped"] == {"net.1.weight": [5]}
    assert capped.report()["score_cap"] == 3.0


def test_the_score_cap_leaves_similar_clients_and_refuses_a_bad_factor():
    """No client is capped unless its score exceeds k times the others' median: four layers
    of one skewed shape plus noise (scores 42-49) fuse at the default k = 3 exactly as under
    the paper's rule."""
    rng = np.random.default_rng(1)
    uploads = [_tiny_upload(c, SKEWED + 0.3 * rng.standard_normal(16)) for c in range(4)]
    plain = _fuse(StatisticalWeightAggregation(TINY, num_clients=4, score_cap=0), uploads)
    strategy = StatisticalWeightAggregation(TINY, num_clients=4)
    np.testing.assert_array_equal(_fuse(strategy, uploads), plain)
    assert strategy.report()["capped"] == {}
    for bad in (0.5, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="score_cap"):
            StatisticalWeightAggregation(TINY, score_cap=bad)
