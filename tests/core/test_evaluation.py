import math
import re

import pytest
import torch

from fedfusion.core.evaluation import ECE_BINS, classification_metrics, evaluate
from fedfusion.core.predictors import Ensemble, ModelSpec, save_predictor
from fedfusion.strategies.predictors import load_predictor


def brute_force_ece(probs: torch.Tensor, y: torch.Tensor) -> float:
    total = 0.0
    conf, pred = probs.max(1)
    for b in range(ECE_BINS):
        low, high = b / ECE_BINS, (b + 1) / ECE_BINS
        last = b == ECE_BINS - 1
        idx = [i for i in range(len(y)) if low <= conf[i] < high or (last and conf[i] == 1)]
        if idx:
            acc = sum(float(pred[i] == y[i]) for i in idx) / len(idx)
            total += len(idx) / len(y) * abs(acc - float(conf[idx].mean()))
    return total


def test_metrics_against_brute_force():
    torch.manual_seed(0)
    logits = 3 * torch.randn(500, 10)
    y = torch.randint(0, 10, (500,))
    metrics = classification_metrics(torch.log_softmax(logits, 1), y)
    probs = logits.softmax(1)
    assert math.isclose(metrics["accuracy"], float((probs.argmax(1) == y).float().mean()))
    nll = -float(torch.log(probs[torch.arange(500), y]).mean())
    assert math.isclose(metrics["nll"], nll, rel_tol=1e-5)
    assert math.isclose(metrics["ece"], brute_force_ece(probs, y), rel_tol=1e-4, abs_tol=1e-6)


def test_ensemble_averages_probabilities_and_saves(tmp_path):
    spec = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 1, "hidden": 5})
    torch.manual_seed(1)
    models = [spec.build() for _ in range(3)]
    ensemble = Ensemble(models, [spec] * 3)
    x = torch.randn(8, 1, 4, 4)
    expected = torch.stack([m(x).softmax(1) for m in models]).mean(0)
    assert torch.allclose(ensemble(x).exp(), expected, atol=1e-6)
    loaded = load_predictor(save_predictor(ensemble, tmp_path / "p.pt"))
    assert torch.equal(loaded(x), ensemble(x))
    y = torch.randint(0, 3, (8,))
    assert evaluate(loaded, x, y) == evaluate(ensemble, x, y)


def test_a_predictor_with_batchnorm_saves_and_loads(tmp_path):
    """BatchNorm's int64 step count is kept as built; a float where the model has it, or an
    int where the model wants a float, is refused."""
    spec = ModelSpec("bn_cnn", (1, 28, 28), 10, {})
    torch.manual_seed(2)
    models = [spec.build() for _ in range(2)]
    for model in models:  # running statistics away from their initial values
        model.train()
        model(torch.randn(16, 1, 28, 28))
        model.eval()
    ensemble = Ensemble(models, [spec] * 2)
    path = save_predictor(ensemble, tmp_path / "bn.pt")
    x = torch.randn(4, 1, 28, 28)
    assert torch.equal(load_predictor(path)(x), ensemble(x))
    payload = torch.load(path, weights_only=True)
    name = next(k for k in payload["states"][0] if k.endswith("num_batches_tracked"))
    for wrong in (payload["states"][0][name].float(),
                  torch.zeros_like(payload["states"][0][name.replace("num_batches_tracked",
                                                                     "running_mean")]).long()):
        bad = dict(payload)
        bad["states"] = [dict(payload["states"][0]), payload["states"][1]]
        key = name if wrong.dtype == torch.float32 else name.replace("num_batches_tracked",
                                                                     "running_mean")
        bad["states"][0][key] = wrong
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match=f"states\\[0\\]\\['{re.escape(key)}'\\]"):
            load_predictor(tmp_path / "bad.pt")
