"""How far a layer's weights are from a Gaussian: the statistics of SWA (paper 001, Sec. II-B).

Two families of distances ``Gd`` of a flattened weight vector ``x`` (N entries):

* **HOS** (Eq. 3-5): the product of the unbiased 3rd and 4th cumulant estimators (Fisher's
  k-statistics) ``k3 = N^2 m3 / ((N-1)(N-2))`` and
  ``k4 = N^2 ((N+1) m4 - 3 (N-1) m2^2) / ((N-1)(N-2)(N-3))``, with ``m_i`` the central
  moments. Both vanish for a Gaussian.
* **Renyi divergence** of order ``a`` (Eq. 1-2) ``D_a(P||Q)`` between the empirical
  distribution ``P`` of the weights and that of ``N`` samples ``Q`` of ``N(0, 1)``:
  ``a = 0``: ``-log Q(p > 0)``; ``a = 0.5``: ``-2 log sum sqrt(p q)`` (twice the
  Bhattacharyya distance); ``a = 1``: ``sum p log(p / q)`` (Kullback-Leibler);
  ``a = 2``: ``log sum p^2 / q``; any other ``a > 0``: ``log(sum p^a q^(1-a)) / (a - 1)``.

Choices the paper leaves open (made here, and tested):

* **Standardisation.** ``x`` is first standardised, ``z = (x - mean) / sd`` with the
  unbiased ``sd`` (ddof = 1, so ``k2(z) = 1`` exactly). Without it both statistics would
  mostly measure the layer's scale (k3 * k4 scales as sd^7, and trained weights with
  sd ~ 0.05 are far from N(0, 1) whatever their shape), not its Gaussianity, which is what
  the paper motivates. HOS is therefore ``skewness * excess kurtosis`` (sample versions).
* **Sign.** ``k3 * k4`` is negative for, e.g., a left-skewed heavy-tailed layer, yet it is
  as far from Gaussian as its mirror image; ``Gd = |k3 * k4|`` (the mirror image of a
  layer gets the same weight). :func:`hos_product` keeps the sign for diagnostics.
* **Binning** (Renyi). ``P`` and ``Q`` are histograms of ``z`` and of the reference
  sample over the same equal-width bins spanning both samples, ``ceil(2 N^(1/3))`` bins
  (Rice's rule). ``p`` is the raw relative frequency (its empty bins drop out: the
  ``0 log 0 = 0`` convention); ``q`` gets half a count added to every bin
  (Krichevsky-Trofimov smoothing), so that ``p / q`` is finite in the weights' tails,
  where ``N`` Gaussian draws rarely fall.
* **Reference sample.** ``Q`` is drawn from ``N(0, 1)`` with ``numpy.random.default_rng
  ([seed, N])``: every client's layer of the same size is compared with the same sample.
* **Degenerate layers** have no defined distance (:func:`is_degenerate`): fewer than 4
  entries (the k-statistics up to order 4 need 4), or constant up to float32 rounding (a
  spread ``max - min <= MIN_RELATIVE_SPREAD * max|x|``, 1e-6, about 8 float32 ulps: such
  entries differ by rounding only, so their standardised "shape" is noise).
  :func:`gaussianity_distance` returns 0 for them (no evidence of non-Gaussianity); SWA
  averages a layer that is degenerate for any client by size (see
  :mod:`fedfusion.strategies.swa.strategy`).
* **Normalisation layers.** A BatchNorm/LayerNorm ``weight`` or ``bias`` is a 1-D tensor,
  one entry per channel, usually near 1 (weights) or near 0 (biases). Nothing here depends on
  a tensor's rank, and both statistics are invariant to shift and scale, so a near-constant
  tensor such as ``1 + 1e-3 * u`` gets the distance of its deviations ``u``, like any layer;
  only the degenerate cases above are set apart.
"""

from __future__ import annotations

import functools
import math

import numpy as np

#: the ``swa-distance`` choices that are statistics of the weights
DISTANCES = ("hos", "renyi0", "renyi0.5", "renyi1", "renyi2")
#: half a count of smoothing per bin of the reference histogram
SMOOTHING = 0.5
MIN_SIZE = 4
#: a layer whose spread (max - min) is at most this fraction of its largest magnitude is
#: constant up to float32 rounding (2^-23 = 1.2e-7 is one float32 ulp relative)
MIN_RELATIVE_SPREAD = 1e-6


def _as_vector(x: np.ndarray) -> np.ndarray:
    values = np.asarray(x, dtype=np.float64).ravel()
    if not np.all(np.isfinite(values)):
        raise ValueError("the weights contain NaN or Inf")
    return values


def standardise(x: np.ndarray) -> np.ndarray:
    """``(x - mean) / sd`` (unbiased sd), flattened, in float64."""
    values = _as_vector(x)
    if values.size < 2:
        raise ValueError(f"cannot standardise {values.size} value(s)")
    sd = values.std(ddof=1)
    if not sd > 0:
        raise ValueError("cannot standardise constant weights (zero variance)")
    return (values - values.mean()) / sd


def k_statistics(x: np.ndarray) -> tuple[float, float, float]:
    """Unbiased cumulant estimators ``(k2, k3, k4)`` of ``x`` (paper Eq. 3-4; k2 = N m2/(N-1))."""
    values = _as_vector(x)
    n = values.size
    if n < MIN_SIZE:
        raise ValueError(f"k-statistics up to order 4 need at least {MIN_SIZE} values, got {n}")
    d = values - values.mean()
    d2 = d * d
    m2, m3, m4 = d2.mean(), (d2 * d).mean(), (d2 * d2).mean()
    k2 = n * m2 / (n - 1)
    k3 = n**2 * m3 / ((n - 1) * (n - 2))
    k4 = n**2 * ((n + 1) * m4 - 3 * (n - 1) * m2**2) / ((n - 1) * (n - 2) * (n - 3))
    return float(k2), float(k3), float(k4)


def hos_product(x: np.ndarray) -> float:
    """Signed ``k3 * k4`` of the standardised weights (paper Eq. 5 after standardising)."""
    _, k3, k4 = k_statistics(standardise(x))
    return k3 * k4


def hos_distance(x: np.ndarray) -> float:
    """``|k3 * k4|`` of the standardised weights: 0 for a Gaussian, larger = less Gaussian."""
    return abs(hos_product(x))


@functools.lru_cache(maxsize=32)
def reference_sample(size: int, seed: int) -> np.ndarray:
    """``size`` draws of N(0, 1), the same for every call with the same ``(size, seed)``
    (cached, read-only: a multi-round run compares every round with the same samples)."""
    sample = np.random.default_rng([seed, size]).standard_normal(size)
    sample.setflags(write=False)
    return sample


def num_bins(size: int) -> int:
    """Rice's rule, ``ceil(2 N^(1/3))``."""
    return max(1, math.ceil(2 * size ** (1 / 3)))


def binned_distributions(z: np.ndarray, reference: np.ndarray, bins: int | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """``(p, q)``: relative frequencies of ``z`` and of ``reference`` over shared equal-width
    bins spanning both; ``q`` smoothed with :data:`SMOOTHING` counts per bin."""
    z, reference = _as_vector(z), _as_vector(reference)
    bins = bins or num_bins(max(z.size, reference.size))
    low = min(z.min(), reference.min())
    high = max(z.max(), reference.max())
    edges = np.linspace(low, high, bins + 1)
    p = np.histogram(z, edges)[0].astype(np.float64)
    q = np.histogram(reference, edges)[0].astype(np.float64) + SMOOTHING
    return p / p.sum(), q / q.sum()


def renyi_divergence(p: np.ndarray, q: np.ndarray, order: float) -> float:
    """``D_order(P || Q)`` of two discrete distributions (paper Eq. 1-2); needs ``q > 0``
    wherever ``p > 0``. Order 0 is ``-log Q(p > 0)``, order 1 is KL."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"p and q have shapes {p.shape} and {q.shape}")
    if order < 0:
        raise ValueError(f"the Renyi order must be >= 0, got {order}")
    support = p > 0
    if np.any(q[support] <= 0):
        raise ValueError("q must be positive wherever p is")
    p, q = p[support], q[support]
    if order == 0:
        value = -math.log(q.sum())
    elif order == 1:
        value = float(np.sum(p * np.log(p / q)))
    else:
        value = math.log(float(np.sum(p**order * q ** (1 - order)))) / (order - 1)
    return max(value, 0.0)  # >= 0 in exact arithmetic; clip rounding below zero


def renyi_to_gaussian(x: np.ndarray, order: float, seed: int = 0) -> float:
    """``D_order`` between the standardised weights and an N(0, 1) sample of their size."""
    z = standardise(x)
    return renyi_divergence(*binned_distributions(z, reference_sample(z.size, seed)), order)


def is_degenerate(x: np.ndarray) -> bool:
    """True where no Gaussianity distance is defined: fewer than :data:`MIN_SIZE` entries, or
    entries equal up to float32 rounding (``max - min <= MIN_RELATIVE_SPREAD * max|x|``)."""
    values = _as_vector(x)
    if values.size < MIN_SIZE:
        return True
    low, high = float(values.min()), float(values.max())
    return not high - low > MIN_RELATIVE_SPREAD * max(abs(low), abs(high))


def gaussianity_distance(x: np.ndarray, distance: str, seed: int = 0) -> float:
    """``Gd`` (paper Eq. 6) of one layer: ``distance`` is one of :data:`DISTANCES`.

    Returns 0 for a degenerate layer (:func:`is_degenerate`: no distance is defined; see the
    module docstring)."""
    if distance not in DISTANCES:
        raise ValueError(f"unknown distance {distance!r}; choose one of {', '.join(DISTANCES)}")
    values = _as_vector(x)
    if is_degenerate(values):
        return 0.0
    if distance == "hos":
        return hos_distance(values)
    return renyi_to_gaussian(values, float(distance.removeprefix("renyi")), seed)
