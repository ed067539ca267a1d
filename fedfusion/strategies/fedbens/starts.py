"""Where FedBEns' server runs start.

The uploaded members are N = sum_c M_c points w_m^c of parameter space, client c weighing
n_c (its training examples) spread evenly over its M_c members. Four rules:

* ``median`` (the paper's Algorithm 1, line 21): R = max_c M_c runs, run r at the
  per-parameter median over the clients that have member r;
* ``mean``: run r at the sample-weighted average of member r (FedAvg of member r);
* ``members``: one run from every member (N runs);
* ``clustered``: K runs from K representative members, the weighted K-medoids of the
  members in parameter space: the K members m_1..m_K minimising

      sum_j weight_j min_k ||w_j - w_{m_k}||^2 .

  Members trained from one broadcast initialisation stay near each other, so the clusters
  split each member index's group by client; K = N is ``members`` exactly.

Buffers (running statistics) are never optimised: a median or mean start carries their
sample-weighted average, a member start the member's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedfusion.core.state import weighted_average
from fedfusion.wire import ClientUpload, NumpyDict

#: exchanges of PAM's SWAP phase at most (it converges in a handful at these sizes)
MAX_SWAPS = 100


def per_index_starts(uploads: Sequence[ClientUpload], parameters: set[str], runs: int,
                     rule: str, device: torch.device | None = None) -> list[NumpyDict]:
    """Run r (< ``runs``) at the median (``rule="median"``) or sample-weighted average
    (``"mean"``) over the clients that uploaded member r; medians on ``device`` when it is a
    CUDA device (:func:`median`)."""
    starts = []
    for r in range(runs):
        holders = [u for u in uploads if u.num_members > r]
        start = weighted_average([u.weights(r) for u in holders],
                                 [u.num_examples for u in holders])
        if rule == "median":
            start.update({name: median([u.weights(r)[name] for u in holders], device)
                          for name in parameters})
        starts.append(start)
    return starts


def median(arrays: Sequence[np.ndarray], device: torch.device | None = None) -> np.ndarray:
    """Element-wise median of ``arrays``, ``np.median``'s (the mean of the two middle values
    for an even count): by numpy on the host, or, on a CUDA ``device``, from a sort there
    (:func:`sorted_median`, so that a GPU fusion does not wait on a host-side selection)."""
    if device is None or device.type != "cuda":
        return np.median(np.stack(arrays), axis=0)
    return sorted_median(arrays, device)


def sorted_median(arrays: Sequence[np.ndarray], device: torch.device) -> np.ndarray:
    """``np.median(np.stack(arrays), axis=0)`` to the bit, from a sort on ``device``."""
    ordered = torch.from_numpy(np.stack(arrays)).to(device).sort(dim=0).values
    half = (len(arrays) - 1) // 2
    middle = ordered[half] if len(arrays) % 2 else (ordered[half] + ordered[half + 1]) / 2
    return middle.cpu().numpy()


def member_weights(uploads: Sequence[ClientUpload]) -> np.ndarray:
    """``[N]`` each member's share of the federation: n_c / M_c, in upload order."""
    return np.array([u.num_examples / u.num_members for u in uploads
                     for _ in range(u.num_members)], dtype=np.float64)


def squared_distances(points: Sequence[NumpyDict], parameters: Sequence[str]) -> np.ndarray:
    """``[N, N]`` squared Euclidean distances between the points over ``parameters``, one
    parameter at a time (float64 Gram matrices: at most one parameter of all points is
    copied at once)."""
    n = len(points)
    gram = np.zeros((n, n))
    for name in parameters:
        stacked = np.stack([p[name].reshape(-1) for p in points]).astype(np.float64)
        gram += stacked @ stacked.T
    norms = np.diag(gram)
    return np.maximum(norms[:, None] + norms[None, :] - 2.0 * gram, 0.0)


def weighted_medoids(distances: np.ndarray, weights: np.ndarray, k: int) -> list[int]:
    """The ``k`` medoids minimising ``sum_j weights_j min_i distances[j, medoid_i]``.

    PAM (Kaufman & Rousseeuw): the greedy BUILD (each new medoid the point that lowers the
    cost most), then SWAP (the single medoid <-> point exchange that lowers the cost most,
    until none does), so no single exchange improves the result. Deterministic: ties go to
    the lowest index. Returned largest cluster (by weight) first.
    """
    n = len(weights)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= {n} medoids, got {k}")

    def cost_with(nearest: np.ndarray) -> np.ndarray:
        """``[n]`` the cost once each candidate joins medoids at distances ``nearest``."""
        return (weights[:, None] * np.minimum(nearest[:, None], distances)).sum(axis=0)

    medoids: list[int] = []
    nearest = np.full(n, np.inf)
    for _ in range(k):
        cost = cost_with(nearest)
        cost[medoids] = np.inf
        medoids.append(int(np.argmin(cost)))
        nearest = np.minimum(nearest, distances[:, medoids[-1]])
    current = float((weights * nearest).sum())
    for _ in range(MAX_SWAPS):
        best = (current, -1, -1)
        for i in range(k):
            others = medoids[:i] + medoids[i + 1:]
            without = distances[:, others].min(axis=1) if others else np.full(n, np.inf)
            cost = cost_with(without)
            cost[medoids] = np.inf
            h = int(np.argmin(cost))
            # a swap must gain more than rounding to count (no cycling between equals)
            if cost[h] < best[0] - 1e-12 * max(abs(current), 1.0):
                best = (float(cost[h]), i, h)
        if best[1] < 0:
            break
        current, medoids[best[1]] = best[0], best[2]
    assignment = np.argmin(distances[:, medoids], axis=1)
    mass = np.bincount(assignment, weights=weights, minlength=k)
    return [medoids[i] for i in sorted(range(k), key=lambda i: (-mass[i], medoids[i]))]


def member_starts(uploads: Sequence[ClientUpload]) -> list[NumpyDict]:
    """Every uploaded member, in upload order."""
    return [u.weights(m) for u in uploads for m in range(u.num_members)]


def clustered_starts(uploads: Sequence[ClientUpload], parameters: Sequence[str],
                     k: int) -> list[NumpyDict]:
    """The weighted K-medoids of all uploaded members (``k`` >= their number: every member)."""
    members = member_starts(uploads)
    if k >= len(members):
        return members
    medoids = weighted_medoids(squared_distances(members, sorted(parameters)),
                               member_weights(uploads), k)
    return [members[i] for i in medoids]
