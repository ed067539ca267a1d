"""SWA, statistical weight aggregation (Chatzikonstantinou et al., paper 001): layer-wise
averaging weighted by each client layer's distance from Gaussianity. Multi-round or one-shot.

For every member m, parameter tensor ("layer") l and client n, with ``w_{n,l}`` the
client's uploaded tensor:

* ``Gd_{n,l}``: the distance of ``w_{n,l}`` from a Gaussian, ``swa-distance`` = ``hos``
  (``|k3 k4|``) or ``renyi<a>`` (``D_a`` to an N(0, 1) sample), paper Eq. 3-6, computed
  on the standardised weights: see :mod:`fedfusion.gaussianity` for the choices made there;
* ``r_{n,l} = Gd_{n,l} / M_l`` with ``M_l = max_n Gd_{n,l}`` (Eq. 7);
* ``a_{n,l} = r_{n,l} s_n / sum_k r_{k,l} s_k`` with ``s_n`` = the client's number of
  examples when ``swa-size-weighting`` is on, else 1;
* ``W_{S,l} = sum_n a_{n,l} W_{n,l}`` (Eq. 8, normalised).

Where this departs from, or fills in, the paper:

* Eq. 8 taken literally, ``W_{S,l} = sum_n r_{n,l} W_{n,l}``, has weights summing to
  ``sum_n r_{n,l}`` in ``[1, N]``: the fused layer would be scaled up by as much as N
  (for N similar clients, N times the average). We divide by that sum, so every layer is a
  convex combination of the clients' layers (``sum_n a_{n,l} = 1``); the literal layer is
  ``(sum_n r_{n,l}) W_{S,l}``. After this normalisation ``M_l`` cancels: the weights are
  ``Gd_{n,l} s_n / sum_k Gd_{k,l} s_k``; ``r`` is kept in :meth:`report` as the paper's
  normalised score.
* A layer is one tensor of the state dict: a weight and its bias get separate weights (the
  zoo's LeNet and CNN have no biases).
* Where every client's ``Gd`` of a layer is 0 (``M_l = 0``: tensors with fewer than 4 or
  constant entries), ``r = 1``: the plain (or size-weighted) average.
* The paper's server knows nothing of the clients' data (Table I: "all clients are treated
  equally"), so size weighting is off by default; ``swa-distance=uniform`` sets ``Gd = 1``,
  which is the paper's "simple averaging" baseline (FedAvg with size weighting) in the
  same code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import nn

from fedfusion.architecture import ModelFn, ModelSpec
from fedfusion.gaussianity import DISTANCES, gaussianity_distance
from fedfusion.payload import ClientUpload, NumpyDict
from fedfusion.strategies.fedavg import FedAvg, weighted_average

#: the ``swa-distance`` choices
SWA_DISTANCES = (*DISTANCES, "uniform")


def gaussianity_scores(arrays: Sequence[NumpyDict], distance: str, seed: int = 0
                       ) -> dict[str, np.ndarray]:
    """``Gd_{n,l}`` (Eq. 6) per parameter name: one value per client."""
    if distance not in SWA_DISTANCES:
        raise ValueError(f"unknown swa-distance {distance!r}; choose one of "
                         f"{', '.join(SWA_DISTANCES)}")
    return {name: np.array([1.0 if distance == "uniform"
                            else gaussianity_distance(a[name], distance, seed) for a in arrays])
            for name in arrays[0]}


def normalised_scores(scores: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``r_{n,l} = Gd_{n,l} / M_l`` (Eq. 7); all ones for a layer whose maximum is 0."""
    return {name: gd / gd.max() if gd.max() > 0 else np.ones_like(gd)
            for name, gd in scores.items()}


def layer_weights(scores: dict[str, np.ndarray], sizes: Sequence[float] | None = None
                  ) -> dict[str, np.ndarray]:
    """``a_{n,l}`` per parameter name from the scores ``Gd_{n,l}``: ``r_{n,l} s_n`` normalised
    to sum to 1 over the clients (Eq. 7-8), ``s_n = sizes[n]`` or 1."""
    weights = {}
    for name, r in normalised_scores(scores).items():
        raw = r * (1.0 if sizes is None else np.asarray(sizes, dtype=np.float64))
        weights[name] = raw / raw.sum()
    return weights


class StatisticalWeightAggregation(FedAvg):
    """Layer-wise average weighted by the layers' distance from Gaussianity (SWA).

    Parameters
    ----------
    distance : {"hos", "renyi0", "renyi0.5", "renyi1", "renyi2", "uniform"}, default "hos"
        The Gaussianity distance of each client's layer (uniform = plain average).
    size_weighting : bool, default False
        Multiply each client's layer weights by its example count.
    weighted_by_key : str, default "num-examples"
        As :class:`FedAvg` (the upload metric each client is weighted by).
    """

    name = "swa"
    one_shot_only = False

    config_keys = {"distance": "swa-distance", "size_weighting": "swa-size-weighting"}

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 distance: str = "hos",
                 size_weighting: bool = False, **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        if distance not in SWA_DISTANCES:
            raise ValueError(f"unknown swa-distance {distance!r}; choose one of "
                             f"{', '.join(SWA_DISTANCES)}")
        self.distance = distance
        self.size_weighting = size_weighting
        self._last: dict[str, Any] = {}


    def member_average(self, holders: Sequence[ClientUpload], member: int) -> NumpyDict:
        arrays = [u.weights(member) for u in holders]
        scores = gaussianity_scores(arrays, self.distance, self.context.seed)
        weights = layer_weights(scores, [u.num_examples for u in holders]
                                if self.size_weighting else None)
        if member == 0:
            self._last = {"clients": [u.client_id for u in holders],
                          "gd": {k: v.tolist() for k, v in scores.items()},
                          "weights": {k: v.tolist() for k, v in weights.items()}}
        return weighted_average(arrays, weights)

    def report(self) -> dict[str, Any]:
        """The last fusion's ``Gd`` and layer weights of member 0, per client."""
        return {"distance": self.distance, "size_weighting": self.size_weighting,
                **self._last}
