"""SWA, statistical weight aggregation (Chatzikonstantinou et al., paper 001): layer-wise
averaging weighted by each client layer's distance from Gaussianity. Multi-round or one-shot.

For every member m, parameter tensor ("layer") l and client n, with ``w_{n,l}`` the
client's uploaded tensor:

* ``Gd_{n,l}``: the distance of ``w_{n,l}`` from a Gaussian, ``swa-distance`` = ``hos``
  (``|k3 k4|``) or ``renyi<a>`` (``D_a`` to an N(0, 1) sample), paper Eq. 3-6, computed
  on the standardised weights: see :mod:`fedfusion.strategies.swa.gaussianity` for the
  choices made there;
* ``Gd'_{n,l} = min(Gd_{n,l}, k median_{j != n} Gd_{j,l})`` with k = ``score_cap`` (run
  config ``swa-score-cap``, default 3; 0 = the paper's rule, no cap): not in the paper, see
  below;
* ``r_{n,l} = Gd'_{n,l} / M_l`` with ``M_l = max_n Gd'_{n,l}`` (Eq. 7);
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
* A layer is one PARAMETER tensor of the state dict: a weight and its bias get separate
  weights (the zoo's LeNet and CNN have no biases).
* Where every client's ``Gd`` of a layer is 0 (``M_l = 0``), ``r = 1``: the plain (or
  size-weighted) average.
* **The score cap.** ``Gd`` is unbounded: a client whose layer is far from Gaussian, by
  chance (|k3 k4| varies by an order of magnitude between honest non-IID clients) or by
  design (a crafted heavy-tailed layer passes every norm check), takes nearly all of that
  layer. Each client's ``Gd`` is capped at k times the median of the OTHER clients' (the
  rule of the claimed-count cap, :func:`fedfusion.core.screening.capped_weights`; a client
  cannot raise its own cap), so with C clients of similar scores one client's share of a
  layer is at most k / (k + C - 1) (3 / 12 of 10 clients at k = 3, against 100%; 3 / 4 of
  two), and no client is capped unless its score exceeds k times the others' median. With
  ``size_weighting`` the example counts, capped at ``num_examples_cap`` = 3x by the same
  rule, multiply in: at most 9 / (9 + C - 1) of equal honest clients.

Normalisation layers and buffers (the rule). An upload's weights are the member's whole
``state_dict``: parameters and buffers (BatchNorm's ``running_mean``, ``running_var`` and the
integer ``num_batches_tracked``). Which entry is a parameter and which a buffer, and which
module a buffer belongs to, is read from the server's model (built on the meta device).

* Every parameter gets Gaussianity weights as above, those of normalisation layers
  (BatchNorm/LayerNorm ``weight`` and ``bias``: 1-D, one entry per channel, near 1 or 0)
  included: the distances are shift and scale invariant, so a near-constant tensor is
  measured by the shape of its deviations, like any layer.
* Where the distance is undefined for ANY client's tensor of a layer
  (:func:`fedfusion.strategies.swa.gaussianity.is_degenerate`: fewer than 4 entries, e.g.
  a LayerNorm over 3 features, or constant up to float32 rounding, e.g. a bias still at its
  zero init), the whole layer is the size-weighted average (``r = 1`` for every client).
  Scoring such a tensor 0 would read "undefined" as "Gaussian" and give that client's layer
  weight 0 next to any client whose tensor has a distance.
* A buffer is not a weight and has no Gaussianity weight of its own (running variances are
  positive, counters are counts): it takes the weights ``a_{n,l}`` of the layer it belongs
  to, its module's ``weight`` parameter (``bn.running_mean`` and ``bn.running_var`` are
  averaged with ``bn.weight``'s weights), else the module's first parameter, else (a module
  without parameters, e.g. BatchNorm with ``affine=False``) the size weights
  ``s_n / sum_k s_k``.
* Float buffers are averaged with those weights; integer buffers (``num_batches_tracked``)
  are not averaged: :func:`~fedfusion.strategies.fedavg.weighted_average` takes every
  non-float entry from the client with the largest weight (here: of the buffer's layer).
* The paper's server knows nothing of the clients' data (Table I: "all clients are treated
  equally"), so size weighting is off by default; ``swa-distance=uniform`` sets ``Gd = 1``,
  which is the paper's "simple averaging" baseline (FedAvg with size weighting) in the
  same code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from fedfusion.constraints import OFF_OR_AT_LEAST_ONE
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.screening import capped_weights
from fedfusion.core.state import weighted_average
from fedfusion.strategies.fedavg import FedAvg
from fedfusion.strategies.swa.gaussianity import DISTANCES, gaussianity_distance, is_degenerate
from fedfusion.wire import ClientUpload, NumpyDict

#: the ``swa-distance`` choices
SWA_DISTANCES = (*DISTANCES, "uniform")


def gaussianity_scores(arrays: Sequence[NumpyDict], distance: str, seed: int = 0,
                       names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """``Gd_{n,l}`` (Eq. 6) per tensor name (``names``, default every entry of ``arrays[0]``):
    one value per client, NaN where that client's tensor has no defined distance
    (:func:`~fedfusion.strategies.swa.gaussianity.is_degenerate`); all ones for ``uniform``."""
    if distance not in SWA_DISTANCES:
        raise ValueError(f"unknown distance {distance!r}; choose one of "
                         f"{', '.join(SWA_DISTANCES)}")

    def score(x: np.ndarray) -> float:
        if distance == "uniform":
            return 1.0
        if is_degenerate(x):
            return float("nan")
        return gaussianity_distance(x, distance, seed)

    return {name: np.array([score(a[name]) for a in arrays])
            for name in (arrays[0] if names is None else names)}


def normalised_scores(scores: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``r_{n,l} = Gd_{n,l} / M_l`` (Eq. 7); all ones (the size-weighted average) for a layer
    whose maximum is 0 or whose distance is undefined (NaN) for some client."""
    return {name: gd / gd.max() if not np.isnan(gd).any() and gd.max() > 0
            else np.ones_like(gd, dtype=np.float64)
            for name, gd in scores.items()}


def buffer_owners(model: nn.Module) -> dict[str, str | None]:
    """Every buffer of ``model``'s ``state_dict`` -> the parameter whose layer weights it
    takes: its module's ``weight``, else the module's first parameter, else None (a module
    without parameters). Parameters are not keys."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    owners: dict[str, str | None] = {}
    for name in model.state_dict():
        if name in parameters:
            continue
        prefix, _, _ = name.rpartition(".")
        module = model.get_submodule(prefix)
        own = [f"{prefix}.{p}" if prefix else p
               for p, _ in module.named_parameters(recurse=False)]
        weight = f"{prefix}.weight" if prefix else "weight"
        owners[name] = weight if weight in own else (own[0] if own else None)
    return owners


class EntryWeights(NamedTuple):
    """One member's ``Gd`` per parameter, the capped ``Gd'``, and the weights of every
    state-dict entry."""

    scores: dict[str, np.ndarray]
    capped: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]


def capped_scores(scores: dict[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """``Gd'_{n,l} = min(Gd_{n,l}, k median_{j != n} Gd_{j,l})`` (k = ``factor``, 0 = no
    cap) per layer; a layer whose distance is undefined for some client (NaN) is left as it
    is (it is averaged by size). Where the others' median is exactly 0 (half or more of the
    clients' layers exactly symmetric, k3 = 0) a positive score is capped to 0 too, and the
    layer is averaged plainly (the paper's rule would give that client all of it)."""
    return {name: gd if np.isnan(gd).any() else np.array(capped_weights(gd, factor))
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
    score_cap : float, default 3.0
        Cap each client's ``Gd`` of a layer at this x the other clients' median (0 = no cap,
        the paper's rule; else >= 1).
    weighted_by_key : str, default "num-examples"
        As :class:`FedAvg`: the upload metric that ``size_weighting`` multiplies by.
    """

    name = "swa"
    one_shot_only = False

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 distance: str = "hos",
                 size_weighting: bool = False, score_cap: float = 3.0, **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        if distance not in SWA_DISTANCES:
            raise ValueError(f"unknown distance {distance!r}; choose one of "
                             f"{', '.join(SWA_DISTANCES)}")
        OFF_OR_AT_LEAST_ONE.check("score_cap", score_cap)
        self.distance = distance
        self.size_weighting = size_weighting
        self.score_cap = float(score_cap)
        self._last: dict[str, Any] = {}
        self._owners: dict[str, str | None] | None = None


    def buffer_layers(self) -> dict[str, str | None]:
        """:func:`buffer_owners` of the server's model (built once, on the meta device)."""
        if self._owners is None:
            with torch.device("meta"):
                self._owners = buffer_owners(self.context.model_spec.build())
        return self._owners

    def entry_weights(self, holders: Sequence[ClientUpload], member: int) -> EntryWeights:
        """``Gd_{n,l}`` and ``Gd'_{n,l}`` of every parameter and the weights ``a_{n,l}`` of
        every state-dict entry (a buffer: its layer's; see the module docstring) of member
        ``member``."""
        arrays = [u.weights(member) for u in holders]
        sizes = self.client_weights(holders) if self.size_weighting else None
        owners = self.buffer_layers()
        scores = gaussianity_scores(arrays, self.distance, self.context.seed,
                                    [n for n in arrays[0] if n not in owners])
        capped = capped_scores(scores, self.score_cap)
        weights = layer_weights(capped, sizes)
        by_size = layer_weights({"": np.ones(len(holders))}, sizes)[""]
        for name in arrays[0]:
            if name not in weights:
                owner = owners.get(name)
                weights[name] = weights[owner] if owner in weights else by_size
        return EntryWeights(scores, capped, weights)

    def member_average(self, holders: Sequence[ClientUpload], member: int) -> NumpyDict:
        scores, capped, weights = self.entry_weights(holders, member)
        if member == 0:
            owners = self.buffer_layers()
            self._last = {"clients": [u.client_id for u in holders],
                          "capped": {k: [u.client_id for u, a, b in zip(
                              holders, gd, capped[k], strict=True) if b < a]
                              for k, gd in scores.items() if (capped[k] < gd).any()},
                          "gd": {k: [None if np.isnan(v) else float(v) for v in gd]
                                 for k, gd in scores.items()},
                          "weights": {k: v.tolist() for k, v in weights.items()},
                          "undefined": sorted(k for k, gd in scores.items()
                                              if np.isnan(gd).any()),
                          "buffers": {k: owners.get(k) for k in weights if k not in scores}}
        return weighted_average([u.weights(member) for u in holders], weights)

    def report(self) -> dict[str, Any]:
        """The last fusion's ``Gd`` (None: undefined) of every parameter and the weights of
        every state-dict entry of member 0, per client; the clients whose ``Gd`` the score
        cap lowered, per parameter (``capped``: that fusion and member 0 only); the parameters
        whose distance was undefined for some client (size-weighted average); each buffer's
        layer; ``score_cap``."""
        return {"distance": self.distance, "size_weighting": self.size_weighting,
                "score_cap": self.score_cap,
                **self._last}
