"""The Gaussianity statistics of SWA against scipy and closed forms (a second or two)."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from fedfusion.strategies.swa.gaussianity import (
    DISTANCES,
    binned_distributions,
    gaussianity_distance,
    hos_distance,
    hos_product,
    is_degenerate,
    k_statistics,
    reference_sample,
    renyi_divergence,
    renyi_to_gaussian,
    standardise,
)


@pytest.mark.parametrize("size", [4, 7, 50, 1000])
def test_k_statistics_equal_scipy_kstat(size):
    x = np.random.default_rng(size).gamma(2.0, 3.0, size) - 4.0
    np.testing.assert_allclose(k_statistics(x), [stats.kstat(x, n) for n in (2, 3, 4)],
                               rtol=1e-9, atol=1e-12)


def test_k_statistics_are_unbiased_on_a_small_exhaustive_population():
    """E[k_r] over all samples drawn with replacement equals the population cumulant."""
    population = np.array([0.0, 1.0, 5.0])
    samples = np.array(np.meshgrid(*[population] * 4)).reshape(4, -1).T  # all 3^4 samples
    mean_k = np.mean([k_statistics(s) for s in samples], axis=0)
    d = population - population.mean()
    kappa2, kappa3 = np.mean(d**2), np.mean(d**3)
    kappa4 = np.mean(d**4) - 3 * kappa2**2
    np.testing.assert_allclose(mean_k, [kappa2, kappa3, kappa4], rtol=1e-9)


def test_hos_is_scale_and_shift_invariant_and_mirror_symmetric():
    x = np.random.default_rng(0).exponential(size=500)
    assert hos_distance(3.0 * x - 7.0) == pytest.approx(hos_distance(x), rel=1e-9)
    assert hos_product(-x) == pytest.approx(-hos_product(x), rel=1e-9)
    assert hos_distance(-x) == pytest.approx(hos_distance(x), rel=1e-9)
    assert hos_product(x) > 0


def test_standardised_weights_have_unit_k2():
    z = standardise(np.random.default_rng(1).uniform(-3, 9, 300))
    k2, _, _ = k_statistics(z)
    assert abs(z.mean()) < 1e-12 and k2 == pytest.approx(1.0, abs=1e-12)


def test_gaussian_samples_are_near_zero_for_every_distance():
    x = 0.05 * np.random.default_rng(2).standard_normal(100_000) + 0.3  # a "layer" scale
    for distance in DISTANCES:
        # binned estimates of two samples of one law: O(bins / N) ~ 1e-3, not 0
        assert gaussianity_distance(x, distance, seed=5) < 5e-3, distance


def test_laplace_excess_kurtosis_is_three_and_its_hos_is_small():
    x = np.random.default_rng(3).laplace(size=1_000_000)
    k2, k3, k4 = k_statistics(x)
    assert k4 / k2**2 == pytest.approx(3.0, abs=0.25)
    assert abs(k3 / k2**1.5) < 0.03  # symmetric: the product k3 k4 is near 0
    assert hos_distance(x) < 0.1


def test_negative_exponential_has_negative_product_and_positive_distance():
    """Skewness -2, excess kurtosis 6: k3 k4 = -12, Gd = |k3 k4| = 12."""
    x = -np.random.default_rng(4).exponential(size=1_000_000)
    assert hos_product(x) == pytest.approx(-12.0, abs=1.5)
    assert hos_distance(x) == pytest.approx(12.0, abs=1.5)


def _laplace_pdf(t: float) -> float:
    b = 1 / math.sqrt(2)  # unit variance
    return math.exp(-abs(t) / b) / (2 * b)


def _normal_pdf(t: float) -> float:
    return math.exp(-t * t / 2) / math.sqrt(2 * math.pi)


def test_binned_kl_and_bhattacharyya_match_the_continuous_closed_forms():
    kl = integrate.quad(lambda t: _laplace_pdf(t) * math.log(_laplace_pdf(t) / _normal_pdf(t)),
                        -30, 30, points=[0], limit=200)[0]
    d_half = -2 * math.log(integrate.quad(lambda t: math.sqrt(_laplace_pdf(t) * _normal_pdf(t)),
                                          -30, 30, points=[0], limit=200)[0])
    assert kl == pytest.approx(0.0724, abs=1e-3)  # -h(Laplace) + 1/2 + log(2 pi)/2
    x = np.random.default_rng(5).laplace(size=1_000_000)
    assert renyi_to_gaussian(x, 1.0) == pytest.approx(kl, abs=0.008)
    assert renyi_to_gaussian(x, 0.5) == pytest.approx(d_half, abs=0.003)
    assert gaussianity_distance(x, "renyi1") == renyi_to_gaussian(x, 1.0)


def test_renyi_orders_against_brute_force_sums():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.25, 0.25, 0.25, 0.25])
    assert renyi_divergence(p, q, 0) == pytest.approx(-math.log(0.75))
    assert renyi_divergence(p, q, 0.5) == pytest.approx(
        -2 * math.log(sum(math.sqrt(a * b) for a, b in zip(p, q, strict=True))))
    assert renyi_divergence(p, q, 1) == pytest.approx(
        sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0))
    assert renyi_divergence(p, q, 2) == pytest.approx(
        math.log(sum(a * a / b for a, b in zip(p, q, strict=True))))
    # the general form tends to KL as the order tends to 1, and D_a grows with a
    assert renyi_divergence(p, q, 1 + 1e-6) == pytest.approx(renyi_divergence(p, q, 1), rel=1e-4)
    values = [renyi_divergence(p, q, a) for a in (0, 0.5, 1, 2)]
    assert values == sorted(values)
    assert renyi_divergence(q, q, 2) == pytest.approx(0.0, abs=1e-12)


def test_binning_is_shared_and_the_reference_smoothed():
    z = np.array([10.0, 10.0, 10.0, 10.0])  # far outside every reference draw
    reference = reference_sample(4, seed=0)
    p, q = binned_distributions(z, reference, bins=4)
    assert p.sum() == pytest.approx(1.0) and q.sum() == pytest.approx(1.0)
    assert p[-1] == 1.0 and np.all(q > 0)  # the empty reference bin got its half count
    np.testing.assert_array_equal(reference, reference_sample(4, seed=0))
    assert not np.array_equal(reference, reference_sample(4, seed=1))


def test_degenerate_and_bad_layers():
    for distance in DISTANCES:
        assert gaussianity_distance(np.ones(100), distance) == 0.0
        assert gaussianity_distance(np.array([1.0, 2.0, 3.0]), distance) == 0.0
    with pytest.raises(ValueError, match="NaN or Inf"):
        gaussianity_distance(np.array([1.0, np.nan, 2.0, 3.0, 4.0]), "hos")
    with pytest.raises(ValueError, match="unknown distance 'renyi3'"):
        gaussianity_distance(np.arange(10.0), "renyi3")
    with pytest.raises(ValueError, match="at least 4"):
        k_statistics(np.arange(3.0))


def test_near_constant_normalisation_tensors():
    """A BatchNorm weight 1 + 1e-3 u is measured by its deviations u (scale and shift
    invariance); one whose entries differ by float32 rounding only is degenerate (0), as are
    constant tensors and tensors of fewer than 4 entries."""
    u = np.random.default_rng(3).exponential(size=64)
    weight = (1.0 + 1e-3 * u).astype(np.float32)
    assert not is_degenerate(weight)
    assert hos_distance(weight) == pytest.approx(hos_distance(u), rel=1e-3)
    ulps = np.float32(1.0) + np.float32(2**-23) * np.array([0, 1, 0, 2, 1, 0, 3, 0], np.float32)
    assert len(set(ulps.tolist())) == 4 and is_degenerate(ulps)
    for distance in DISTANCES:
        assert gaussianity_distance(ulps, distance) == 0.0
    assert is_degenerate(np.zeros(10)) and is_degenerate(np.array([0.1, 2.0, 5.0]))
    assert not is_degenerate(np.array([0.0, 0.0, 0.0, 1e-30]))  # tiny but not rounding
