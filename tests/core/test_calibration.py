"""Temperature scaling: the fitted T against a brute-force search of the NLL, its scale
equivariance, the bounds, and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from fedfusion.core.calibration import TEMPERATURE_BOUNDS, fit_temperature, succession_smoothing


def nll(logits: torch.Tensor, labels: torch.Tensor, t: float, smoothing: float = 0.0) -> float:
    return float(torch.nn.functional.cross_entropy(logits.double() / t, labels,
                                                   label_smoothing=smoothing))


def noisy_logits(seed: int, rows: int = 400, classes: int = 7) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, classes, generator=generator)
    labels = (logits + 3 * torch.randn(rows, classes, generator=generator)).argmax(1)
    return logits, labels


@pytest.mark.parametrize(("seed", "smoothing"), [(0, 0.0), (1, 0.0), (2, 0.05)])
def test_the_temperature_minimises_the_nll_found_by_a_fine_search(seed, smoothing):
    """Against torch's cross-entropy (label_smoothing spreads e over all K classes, as
    fit_temperature's smoothed labels do) on a grid."""
    logits, labels = noisy_logits(seed)
    t = fit_temperature(logits, labels, smoothing)
    grid = torch.logspace(-1, 1, 2001, dtype=torch.float64)
    nlls = torch.tensor([nll(logits, labels, float(g), smoothing) for g in grid],
                        dtype=torch.float64)
    best = float(grid[nlls.argmin()])
    assert t == pytest.approx(best, rel=2.5e-3)  # the grid's step is 2.3e-3 in log T
    assert nll(logits, labels, t, smoothing) <= min(
        nll(logits, labels, t * f, smoothing) for f in (0.999, 1.001))


def test_scaled_or_shifted_logits_get_the_same_calibrated_logits():
    logits, labels = noisy_logits(3)
    t = fit_temperature(logits, labels)
    assert fit_temperature(4 * logits, labels) == pytest.approx(4 * t, rel=1e-9)
    shift = 50 * torch.randn(len(logits), 1, generator=torch.Generator().manual_seed(4))
    assert fit_temperature(logits + shift, labels) == pytest.approx(t, rel=1e-6)


def test_a_perfect_model_and_a_model_worse_than_chance_hit_the_bounds():
    logits, _ = noisy_logits(5)
    assert fit_temperature(logits, logits.argmax(1)) == TEMPERATURE_BOUNDS[0]
    assert fit_temperature(-logits, logits.argmax(1)) == TEMPERATURE_BOUNDS[1]


def test_smoothing_by_succession_keeps_a_perfect_model_finite_and_scale_equivariant():
    """A model right on all 400 rows: the rule of succession (1/402 on the wrong classes)
    gives it a finite temperature, still scaling with its logits."""
    logits, _ = noisy_logits(5)
    smoothing = succession_smoothing(400, 7)
    assert smoothing * 6 / 7 == pytest.approx(1 / 402)
    t = fit_temperature(logits, logits.argmax(1), smoothing)
    assert TEMPERATURE_BOUNDS[0] < t < 1
    assert fit_temperature(4 * logits, logits.argmax(1), smoothing) == pytest.approx(4 * t,
                                                                                    rel=1e-9)
    assert succession_smoothing(10, 1) == 0.0
    with pytest.raises(ValueError, match="smoothing"):
        fit_temperature(logits, logits.argmax(1), 1.0)


@pytest.mark.parametrize(("logits", "labels", "message"), [
    (torch.zeros(4), torch.zeros(4, dtype=torch.long), r"logits \[N, K\]"),
    (torch.zeros(4, 3), torch.zeros(5, dtype=torch.long), r"labels \[N\]"),
    (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), "N > 0"),
    (torch.full((2, 3), math.nan), torch.zeros(2, dtype=torch.long), "finite"),
])
def test_bad_inputs_are_refused(logits, labels, message):
    with pytest.raises(ValueError, match=message):
        fit_temperature(logits, labels)
