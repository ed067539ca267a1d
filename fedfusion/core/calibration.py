"""Temperature scaling (Guo et al., ICML 2017): the one scalar T > 0 that minimises the
negative log-likelihood of softmax(f / T) on held-out rows."""

from __future__ import annotations

import math

import torch

#: the range searched for T; a model at a bound is (nearly) perfect or no better than chance
TEMPERATURE_BOUNDS = (1e-6, 1e6)


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor,
                    smoothing: float = 0.0) -> float:
    """T = 1 / b*, b* = argmin_b mean_i [logsumexp(b f_i) - b E_q_i[f_i]] over ``logits``
    ``[N, K]`` and ``labels`` ``[N]``, with q_i the label y_i smoothed by ``smoothing`` e:
    (1 - e) onehot(y_i) + e / K (e = 0: the plain validation NLL).

    The objective is convex in b (its second derivative is the mean variance of f_i under
    softmax(b f_i)), so b* is the root of its derivative mean_i (E_{softmax(b f_i)}[f_i] -
    E_q_i[f_i]), found by bisection on log b in float64: exact to rounding, and T(a f) = a T(f)
    for any a > 0 (a client that scales its logits is calibrated back). Without smoothing a
    model that separates the rows has no finite optimum (T -> 0); any e > 0 gives one. The
    root is clamped to :data:`TEMPERATURE_BOUNDS`.
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or not len(labels):
        raise ValueError(f"need logits [N, K] and labels [N] with N > 0, got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    f = logits.detach().double()
    if not torch.isfinite(f).all():
        raise ValueError("logits must be finite to fit a temperature")
    target = ((1 - smoothing) * f.gather(1, labels.long().view(-1, 1)).squeeze(1)
              + smoothing * f.mean(1))

    def slope(log_b: float) -> float:
        p = torch.softmax(math.exp(log_b) * f, dim=1)
        return float(((p * f).sum(1) - target).mean())

    low, high = math.log(1 / TEMPERATURE_BOUNDS[1]), math.log(1 / TEMPERATURE_BOUNDS[0])
    if slope(low) >= 0:  # no better than uniform: its logits are flattened away
        return TEMPERATURE_BOUNDS[1]
    if slope(high) <= 0:  # separable: a larger b always lowers the NLL
        return TEMPERATURE_BOUNDS[0]
    for _ in range(100):  # the interval (27.6 wide) shrinks to float64's resolution
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if slope(middle) < 0 else (low, middle)
    return math.exp(-(low + high) / 2)


def succession_smoothing(num_rows: int, num_classes: int) -> float:
    """e such that the smoothed labels put 1 / (n + 2) on the wrong classes (Laplace's rule of
    succession for an error rate seen on n rows): a model right on every validation row is
    still not taken as certain. 0 for one class."""
    if num_classes < 2:
        return 0.0
    return num_classes / ((num_classes - 1) * (num_rows + 2))
