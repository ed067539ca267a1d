"""examples/ams_toy.py (AMS paper, Figure 1): concatenating two one-neuron networks sums
their logits, and the fused model succeeds or fails with the seed although the two local
models are alike; AMS-top1 follows the concatenation on this toy."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ams_toy.py"


@pytest.fixture(scope="module")
def toy():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("ams_toy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ams_toy"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(toy):  # noqa: ANN201
    """Seed 4: the paper's success case; seed 1: its fail case (Leaky ReLU, Adam lr 0.5,
    600 epochs, as in the paper)."""
    return {r.seed: r for r in toy.run_toy([1, 4])}


def test_concatenation_sums_the_local_logits(results):
    for r in results.values():
        assert np.allclose(r.logits["concat"], r.logits["left"] + r.logits["right"], atol=1e-5)


def test_alike_local_models_fuse_well_or_badly_depending_on_the_seed(results):
    for r in results.values():
        assert 0.70 <= r.accuracy["left"] <= 0.86 and 0.70 <= r.accuracy["right"] <= 0.86
    success, failure = results[4].accuracy, results[1].accuracy
    assert success["concat"] >= max(success["left"], success["right"]) + 0.10
    assert failure["concat"] < min(failure["left"], failure["right"]) - 0.05


def test_the_failed_fusion_loses_what_the_local_models_knew(results):
    """Fail case: the concatenation misclassifies 100 of the 300 test points, mostly (92%)
    class-0 points in the wedges x2 < |x1|, and the local model of the half a point lies in
    got most of them (92%) right."""
    r = results[1]
    wrong = r.logits["concat"].argmax(-1) != r.y
    assert wrong.sum() >= 60 and (r.y[wrong] == 0).mean() >= 0.85
    own_model = np.where(r.x[:, 0] < 0, r.logits["left"].argmax(-1), r.logits["right"].argmax(-1))
    assert (own_model[wrong] == r.y[wrong]).mean() >= 0.8


def test_ams_top1_follows_the_concatenation_on_this_toy(results, toy):
    for r in results.values():
        assert abs(r.accuracy["ams"] - r.accuracy["concat"]) <= 0.01
        chosen = np.where(r.logits["left"].max(-1) >= r.logits["right"].max(-1), 0, 1)
        expected = np.stack([r.logits["left"], r.logits["right"]])[chosen, np.arange(len(r.y))]
        assert np.allclose(r.logits["ams"], torch.log_softmax(torch.from_numpy(expected), -1))


def test_the_figure_is_written(results, toy, tmp_path):
    pytest.importorskip("matplotlib")  # the App's plotting extra, absent from library-only envs
    path = toy.plot(list(results.values()), tmp_path / "toy.png", "leaky_relu")
    assert path.stat().st_size > 10_000
