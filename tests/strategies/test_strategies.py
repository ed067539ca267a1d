"""FedAvg and the uniform ensemble: the math, the Message API round, bad clients, replay."""

import dataclasses
import logging

import numpy as np
import pytest
import torch
from conftest import InProcessGrid, run_keeping_last_round
from flwr.app import ArrayRecord, Message
from helpers.uploads import SPEC, make_upload

from fedfusion.core.state import weighted_average
from fedfusion.server_app import run_server
from fedfusion.strategies import FedAvg, UniformEnsemble
from fedfusion.upload_store import load_uploads
from fedfusion.wire import UploadError, member_key


def test_fedavg_is_the_sample_weighted_mean():
    uploads = [make_upload(i, members=1, seed=i) for i in range(3)]
    for u, n in zip(uploads, (100, 300, 600), strict=True):
        u.num_examples = n
    predictor = FedAvg(SPEC, num_clients=3).fuse(uploads)
    fused = predictor.members[0].state_dict()
    for name in fused:
        expected = sum(n * u.weights(0)[name] for u, n in zip(uploads, (100, 300, 600),
                                                               strict=True)) / 1000
        np.testing.assert_allclose(fused[name].numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, 0, None])
def test_fedavg_by_a_metric_excludes_a_client_without_a_usable_weight(bad):
    """weighted_by_key: the client whose metric is no finite positive number is excluded,
    not the round; the others are averaged by their metric even near float's range."""
    uploads = [make_upload(i, members=1, seed=i) for i in range(3)]
    for upload, weight in zip(uploads, (1e308, 0.5e308, bad), strict=True):
        if weight is not None:
            upload.metrics["my-weight"] = weight
    strategy = FedAvg(SPEC, num_clients=3, weighted_by_key="my-weight", screen_factor=0)
    fused = strategy.fuse_uploads(uploads).members[0].state_dict()
    assert [e["client"] for e in strategy.exclusions] == ["2"]
    assert "'my-weight' (weighted_by_key) must be a finite positive number, got " in (
        strategy.exclusions[0]["reason"])
    for name in fused:
        expected = (2 * uploads[0].weights(0)[name] + uploads[1].weights(0)[name]) / 3
        np.testing.assert_allclose(fused[name].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_fedavg_by_a_metric_caps_it_as_counts_are_capped():
    """A weighted_by_key metric is capped like a claimed count: at num_examples_cap (3) x
    the median of the others', so a client claiming 1e9 against two of weight 1 weighs 3."""
    uploads = [make_upload(i, members=1, seed=i) for i in range(3)]
    for upload, weight in zip(uploads, (1.0, 1.0, 1e9), strict=True):
        upload.metrics["my-weight"] = weight
    strategy = FedAvg(SPEC, num_clients=3, weighted_by_key="my-weight", screen_factor=0)
    assert strategy.client_weights(uploads) == [1.0, 1.0, 3.0]
    fused = strategy.fuse_uploads(uploads).members[0].state_dict()
    for name in fused:
        expected = (uploads[0].weights(0)[name] + uploads[1].weights(0)[name]
                    + 3 * uploads[2].weights(0)[name]) / 5
        np.testing.assert_allclose(fused[name].numpy(), expected, rtol=1e-5, atol=1e-6)
    uncapped = FedAvg(SPEC, num_clients=3, weighted_by_key="my-weight", num_examples_cap=0)
    assert uncapped.client_weights(uploads) == [1.0, 1.0, 1e9]


def test_a_capped_metric_is_logged_once_a_fusion_not_once_a_member(caplog):
    uploads = [make_upload(i, members=3, seed=i) for i in range(3)]
    for upload, weight in zip(uploads, (1.0, 1.0, 1e9), strict=True):
        upload.metrics["my-weight"] = weight
    strategy = FedAvg(SPEC, num_clients=3, num_members=3, weighted_by_key="my-weight",
                      screen_factor=0, member_fusion="each")  # 3 averages, one per member
    for fusion in (1, 2):
        with caplog.at_level(logging.WARNING, logger="fedfusion"):
            strategy.fuse_uploads(uploads)
        capped = [r for r in caplog.records if "metric 'my-weight' = 1e+09" in r.getMessage()]
        assert len(capped) == fusion, [r.getMessage() for r in capped]


def test_fedavg_of_identical_clients_is_that_client():
    upload = make_upload(members=1)
    predictor = FedAvg(SPEC, num_clients=2).fuse([upload, upload])
    for name, value in predictor.members[0].state_dict().items():
        assert torch.equal(value, torch.from_numpy(upload.weights(0)[name]))
    # beside a distinct client, twins weigh as one client of their examples together:
    # (n_0 + n_1) w_0 + n_2 w_2 over n (client 0's model is another answer)
    first = make_upload(0, members=1, seed=1)
    twin = dataclasses.replace(first, client_id=1, num_examples=300)
    other = make_upload(2, members=1, seed=2)
    fused = FedAvg(SPEC, num_clients=3).fuse([first, twin, other]).members[0].state_dict()
    total = first.num_examples + 300 + other.num_examples
    for name, value in fused.items():
        expected = ((first.num_examples + 300) * first.weights(0)[name]
                    + other.num_examples * other.weights(0)[name]) / total
        np.testing.assert_allclose(value.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_ensemble_holds_every_member_of_every_client():
    uploads = [make_upload(0, members=2), make_upload(1, members=3, seed=1)]
    predictor = UniformEnsemble(SPEC, num_clients=2).fuse(uploads)
    assert len(predictor.members) == 5
    x = torch.randn(4, 1, 28, 28)
    models = [SPEC.build(m["weights"]) for u in uploads for m in u.members]
    expected = torch.stack([m(x).softmax(1) for m in models]).mean(0)
    assert torch.allclose(predictor(x).exp(), expected, atol=1e-6)


def test_diagnostics_are_the_results_json_keys_as_plain_data():
    """Without Flower: what fuse_uploads leaves is one JSON value, each client's row from
    its upload, a capped claim marked in its row, the cost from the sections fused."""
    import json

    uploads = [make_upload(i, members=2, seed=i) for i in range(4)]
    uploads[3].num_examples = 10**6  # far above the others' median: capped
    uploads[3].metrics["class-histogram"] = [10**6] + [0] * 9
    strategy = FedAvg(SPEC, num_clients=4, num_members=2)  # broadcasts 2, fuses member 0
    strategy.fuse_uploads(uploads)
    diagnostics = json.loads(json.dumps(strategy.diagnostics(), allow_nan=False))
    assert set(diagnostics) == {"num_members", "clients", "excluded", "strategy_report",
                                "cost", "capped_claims", "screening", "chance", "at_chance",
                                "norm_stats", "timing"}
    assert diagnostics["num_members"] == [2, 2, 2, 2]
    rows = diagnostics["clients"]
    assert [r["client_id"] for r in rows] == [0, 1, 2, 3]
    assert [r["num_examples"] for r in rows] == [u.num_examples for u in uploads]
    (capped,) = diagnostics["capped_claims"]
    assert capped["client_id"] == 3 and rows[3]["num_examples_weighted"] == capped["capped_to"]
    assert all("num_examples_weighted" not in r for r in rows[:3])
    member_bytes = sum(a.nbytes for a in uploads[0].weights(0).values())
    assert diagnostics["cost"]["upload_bytes_per_client"] == member_bytes  # member 0 only
    assert diagnostics["cost"]["download_bytes_per_client"] == 2 * member_bytes
    assert diagnostics["norm_stats"] == diagnostics["strategy_report"]["norm_stats"]
    assert diagnostics["chance"] is None and diagnostics["at_chance"] is None  # no val
    assert diagnostics["timing"]["server_fuse_s"] > 0


def _nan_for_client(bad: int):
    def tamper(client: int, reply: Message) -> Message:
        if client == bad:
            key = member_key(0, "weights")
            arrays = {k: v.numpy().copy() for k, v in reply.content[key].items()}
            arrays["classifier.0.weight"][3, 3] = np.inf
            from flwr.app import Array
            reply.content[key] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        return reply
    return tamper


def test_a_bad_client_is_excluded_and_the_run_finishes(small_settings):
    settings = small_settings.replace(strategy="ensemble", run_name="bad")
    results = run_server(settings, InProcessGrid(settings, tamper=_nan_for_client(1)))
    assert results["status"] == "ok"
    assert [c["client_id"] for c in results["clients"]] == [0, 2]
    (excluded,) = results["excluded"]
    assert "'classifier.0.weight' has NaN or Inf" in excluded["reason"]
    assert results["test"]["accuracy"] > 0.2  # two skewed clients of three, 3 epochs


def test_a_crashing_client_is_excluded(small_settings):
    settings = small_settings.replace(strategy="ensemble", run_name="crash")
    results = run_server(settings, InProcessGrid(settings, crash={0}))
    assert [c["client_id"] for c in results["clients"]] == [1, 2]
    assert "client 0 ran out of memory" in results["excluded"][0]["reason"]


def test_a_round_short_of_valid_uploads_keeps_them_for_a_replay(small_settings, tmp_path):
    """min_valid_uploads unmet: the run fails naming the shortfall, but the uploads that
    arrived stay a complete upload folder (manifest and files), so the clients' training is
    replayed with a lower minimum instead of lost."""
    settings = small_settings.replace(strategy="ensemble", min_valid_uploads=3,
                                      run_name="short")
    with pytest.raises(RuntimeError, match=r"2 valid upload\(s\), need at least 3"):
        run_server(settings, InProcessGrid(settings, crash={2}))
    _, kept, _ = load_uploads(tmp_path / "short" / "uploads", strict=True)
    assert sorted(u.client_id for u in kept) == [0, 1]
    replayed = run_server(small_settings.replace(
        strategy="ensemble", replay=str(tmp_path / "short" / "uploads"), run_name="re"))
    assert replayed["status"] == "ok" and [c["client_id"] for c in replayed["clients"]] == [0, 1]


def test_multi_round_fedavg_improves(small_settings):
    """3 rounds on near-IID clients: round 3 beats round 1 and clears 60%, and the final
    model is the sample-weighted average of round 3's replies (recorded on the wire), not
    one client's (client 0 alone scores as well here: accuracy cannot tell them apart)."""
    settings = small_settings.replace(num_rounds=3, run_name="multi", alpha=100.0)
    results, last, fused = run_keeping_last_round(settings)
    accuracies = [r["test_accuracy"] for r in results["rounds"]]
    assert len(accuracies) == 3
    assert accuracies[-1] > accuracies[0] and accuracies[-1] > 0.6
    expected = weighted_average([u.weights(0) for u in last], [u.num_examples for u in last])
    gap = 0.0
    for name, value in fused.items():
        np.testing.assert_allclose(value.numpy(), expected[name], rtol=1e-5, atol=1e-6)
        gap = max(gap, float(np.abs(value.numpy() - last[0].weights(0)[name]).max()))
    assert gap > 1e-4, gap  # not client 0's model


def test_ensemble_refuses_more_than_one_round(small_settings):
    settings = small_settings.replace(strategy="ensemble", num_rounds=2, run_name="x")
    with pytest.raises(ValueError, match="one-shot: set num-rounds=1"):
        run_server(settings, InProcessGrid(settings))


def test_replay_reproduces_the_live_result_and_feeds_other_strategies(small_settings, tmp_path):
    live = run_server(small_settings.replace(run_name="live"), InProcessGrid(small_settings))
    uploads = tmp_path / "live" / "uploads"
    replayed = run_server(small_settings.replace(replay=str(uploads), run_name="re"))
    assert replayed["test"] == live["test"]
    assert replayed["timing"]["client_train_s_sum"] == live["timing"]["client_train_s_sum"]
    ensemble = run_server(small_settings.replace(replay=str(uploads), strategy="ensemble",
                                                 run_name="re-ens"))
    # the ensemble of the 3 client models against their FedAvg (the live run): measured
    # 36.6% against 31.9%; its exact form is test_ensemble_holds_every_member_of_every_client
    assert ensemble["test"]["accuracy"] >= live["test"]["accuracy"] + 0.03


def test_replay_excludes_a_corrupted_cached_upload(small_settings, tmp_path):
    run_server(small_settings.replace(run_name="live"), InProcessGrid(small_settings))
    uploads = tmp_path / "live" / "uploads"
    with np.load(uploads / "client_2.npz") as data:
        arrays = dict(data)
    arrays["m0/weights/features.0.weight"] = arrays["m0/weights/features.0.weight"][:3]
    np.savez(uploads / "client_2.npz", **arrays)
    results = run_server(small_settings.replace(replay=str(uploads), run_name="re"))
    assert [c["client_id"] for c in results["clients"]] == [0, 1]
    assert "features.0.weight' has shape (3, 1, 5, 5)" in results["excluded"][0]["reason"]


def test_no_valid_upload_fails_clearly_and_keeps_results(small_settings, tmp_path):
    settings = small_settings.replace(num_clients=3, run_name="allbad")
    grid = InProcessGrid(settings, tamper=lambda c, r: _nan_for_client(c)(c, r))
    with pytest.raises(RuntimeError, match="0 valid upload"):
        run_server(settings, grid)
    import json
    saved = json.loads((tmp_path / "allbad" / "results.json").read_text())
    assert saved["status"] == "failed" and "0 valid upload" in saved["error"]


def test_mismatched_architecture_is_excluded_from_fedavg():
    upload = make_upload(0, members=1)
    upload.model_kwargs = {"oops": 1}
    strategy = FedAvg(SPEC, num_clients=2)
    with pytest.raises(RuntimeError, match="0 valid"):
        strategy.fuse_uploads([upload])
    # refused by comparing with the server's architecture, before anything is built from it
    assert "differs from the server's lenet{}" in strategy.exclusions[0]["reason"]
    assert isinstance(UploadError(1, "x"), ValueError)


def test_a_failing_optional_section_does_not_exclude_the_client(small_settings):
    settings = small_settings.replace(extra_sections="no-such-section", run_name="opt")
    results = run_server(settings, InProcessGrid(settings))
    assert len(results["clients"]) == 3 and not results["excluded"]


def test_non_finite_results_are_errors_and_results_json_stays_strict():
    """A fused predictor that outputs NaN is an error, not a result; results.json never holds
    a bare NaN (not JSON)."""
    import json
    import math

    import torch

    from fedfusion.app.output import strict_json

    class NaNFedAvg(FedAvg):
        name = "nan-fedavg"

        def fuse(self, uploads):
            predictor = super().fuse(uploads)
            for p in predictor.parameters():
                p.data.fill_(float("nan"))
            return predictor

    val = (torch.randn(16, 1, 28, 28), torch.arange(16) % 10)
    strategy = NaNFedAvg(SPEC, val=val, device="cpu")
    with pytest.raises(FloatingPointError, match="NaN/Inf on the validation inputs"):
        strategy.fuse_uploads([make_upload(0, members=1), make_upload(1, members=1)])
    data = strict_json({"a": math.nan, "b": np.float32(1.5), "c": [np.inf, 2], "d": (1,)})
    assert data == {"a": None, "b": 1.5, "c": [None, 2], "d": [1]}
    json.dumps(data, allow_nan=False)


def test_server_optimiser_refuses_a_non_finite_objective():
    import torch

    from fedfusion.core.fusion import FusionContext
    from fedfusion.strategies.fedbens.server_optim import ServerOptimiser

    def objective(w):  # run 1 diverged (as extreme curvature makes the log-density do)
        value = sum(v.sum(dim=tuple(range(1, v.dim()))) for v in w.values())
        return value * torch.tensor([1.0, float("inf")])

    starts = [make_upload(0, members=1).weights(0), make_upload(1, members=1).weights(0)]
    with pytest.raises(FloatingPointError, match=r"not finite at step 0 in run\(s\) \[1\]"):
        ServerOptimiser(steps=3).maximise(objective, starts, FusionContext(SPEC))


def test_a_non_finite_objective_between_evaluations_is_named_by_its_step():
    """The objectives are checked at the next evaluation, not at every step (a check waits
    for the device's queued work), and the error still names the first bad step and run."""
    from fedfusion.core.fusion import FusionContext
    from fedfusion.strategies.fedbens.server_optim import ServerOptimiser

    calls = []

    def objective(w):  # finite for steps 0-6, then run 0 diverges
        calls.append(len(calls))
        value = sum(v.sum(dim=tuple(range(1, v.dim()))) for v in w.values())
        return value * torch.tensor([float("inf") if len(calls) > 7 else 1.0, 1.0])

    starts = [make_upload(0, members=1).weights(0), make_upload(1, members=1).weights(0)]
    with pytest.raises(FloatingPointError, match=r"not finite at step 7 in run\(s\) \[0\]"):
        ServerOptimiser(steps=40, eval_every=10).maximise(objective, starts,
                                                          FusionContext(SPEC))
    assert len(calls) == 11  # found at the evaluation of step 10


def test_initial_models_are_seeded_and_perturbed_around_member_0_on_request():
    independent = FedAvg(SPEC, num_members=3, seed=4).initial_models()
    again = FedAvg(SPEC, num_members=3, seed=4).initial_models()
    perturbed = FedAvg(SPEC, num_members=3, seed=4, init_perturbation=0.001).initial_models()
    for name in independent[0]:
        np.testing.assert_array_equal(independent[1][name], again[1][name])  # seeded
        np.testing.assert_array_equal(perturbed[0][name], independent[0][name])
        assert independent[1][name].dtype == perturbed[1][name].dtype
    for m in (1, 2):
        noise = np.concatenate([(perturbed[m][k] - perturbed[0][k]).ravel()
                                for k in perturbed[0]])
        assert 0.0009 < noise.std() < 0.0011 and abs(noise.mean()) < 1e-4
        spread = np.concatenate([(independent[m][k] - independent[0][k]).ravel()
                                 for k in independent[0]])
        assert spread.std() > 10 * noise.std()  # independent inits are far apart
    with pytest.raises(ValueError, match="init_perturbation"):
        FedAvg(SPEC, init_perturbation=-1.0)


def test_ensemble_of_size_k_takes_member_0_of_every_client_first_without_validation():
    uploads = [make_upload(0, members=2), make_upload(1, members=3, seed=1)]
    strategy = UniformEnsemble(SPEC, num_clients=2, size=3)
    predictor = strategy.fuse(uploads)
    expected = [uploads[0].weights(0), uploads[1].weights(0), uploads[0].weights(1)]
    assert len(predictor.members) == 3 and strategy.report()["selection"] == "order"
    for model, weights in zip(predictor.members, expected, strict=True):
        for name, value in model.state_dict().items():
            assert torch.equal(value, torch.from_numpy(weights[name]))
    assert len(UniformEnsemble(SPEC, num_clients=2, size=5).fuse(uploads).members) == 5
    with pytest.raises(ValueError, match="size"):
        UniformEnsemble(SPEC, size=-1)

