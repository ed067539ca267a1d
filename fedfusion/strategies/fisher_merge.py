"""Fisher merging (Matena & Raffel, NeurIPS 2022), as FedFisher's and FedBEns' baseline.

Elementwise, with H_i the diagonal of client i's GGN SUMMED over its n_i samples (upload
section ``curvature.diag``), i.e. H_i = n_i F_i with F_i the mean (empirical-data) Fisher:

    w = sum_i H_i * w_i / sum_i H_i
      = sum_i p_i F_i * w_i / sum_i p_i F_i,   p_i = n_i / n,  n = sum_i n_i.

Choice of weighting: Matena & Raffel weight model i by lambda_i F_i; we take lambda_i = p_i,
the data-size weighted Fisher, as the FedFisher reference code does for this baseline
(github.com/Divyansh03/FedFisher: ``F_diag * p[i]`` in ``main.py``, merged in
``get_fisher_merge_model``). It is the minimiser of the diagonal quadratic approximation of
the global loss sum_i L_i (the optimum FedFisher (Diag) iterates towards), reduces to FedAvg
when the clients' mean Fishers agree, and does not let a client with few samples pull as hard
as one with many. Mean Fishers (lambda_i = 1) would be the other option, and are not used.

Floor: where the mean Fisher sum_i H_i / n is below ``floor`` (1e-6, the reference's
threshold on sum_i p_i F_i) no client has information about the parameter, and the merge
falls back to the sample-weighted average sum_i p_i w_i (FedAvg) there (also where the sum is
exactly 0, whatever the floor), never 0 / 0.

With M members per client, member index m is merged over the clients that have member m and
the prediction is the ensemble of the M merges (M = 1: the baseline). Departure from the
reference: no 15-bit quantisation of the weights and Fisher before merging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.predictors import Ensemble
from fedfusion.core.state import weighted_average
from fedfusion.curvature import DiagCurvature, curvature_from_arrays
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.sections import curvature_section
from fedfusion.wire import WEIGHTS, ClientUpload

SECTION = curvature_section("diag")


def fisher_merge(
    weights: Sequence[dict[str, np.ndarray]],
    fishers: Sequence[dict[str, np.ndarray]],
    num_examples: Sequence[int],
    floor: float = 1e-6,
) -> tuple[dict[str, np.ndarray], int]:
    """Elementwise sum_i H_i w_i / sum_i H_i (``fishers[i][name]`` = H_i, summed over samples),
    and the FedAvg value where sum_i H_i / sum_i n_i < floor or sum_i H_i = 0 (and for the
    entries without a Fisher: buffers such as BatchNorm's running statistics). Computed in
    float64, returned in the weights' dtype, with the number of entries that fell back."""
    total = float(sum(num_examples))
    fedavg = weighted_average(weights, num_examples)
    merged, fallbacks = {}, 0
    for name, avg in fedavg.items():
        if name not in fishers[0]:  # a buffer (running statistics): the FedAvg rule
            merged[name] = avg
            continue
        h = [np.asarray(f[name], dtype=np.float64) for f in fishers]
        h_sum = sum(h)
        numerator = sum(hi * w[name].astype(np.float64) for hi, w in zip(h, weights, strict=True))
        informed = (h_sum > 0) & (h_sum / total >= floor)
        fallbacks += int((~informed).sum())
        ratio = np.divide(numerator, h_sum, out=np.zeros_like(h_sum), where=informed)
        merged[name] = np.where(informed, ratio, avg).astype(weights[0][name].dtype)
    return merged, fallbacks


class FisherMerge(FusionStrategy):
    """Diagonal-Fisher weighted parameter average, FedAvg where no client has Fisher mass.

    Parameters
    ----------
    floor : float, default 1e-6
        A parameter whose mean Fisher over the clients' examples (sum_i H_i / sum_i n_i) is
        below ``floor`` falls back to the sample-weighted average.
    """

    name = "fisher-merge"
    required_sections = (WEIGHTS, SECTION)
    one_shot_only = False  # one model per member index, like FedAvg

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 floor: float = 1e-6, **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        if not floor >= 0:
            raise ValueError(f"fisher-merge floor must be >= 0, got {floor}")
        self.floor = floor
        self.fallbacks: list[int] = []

    def fisher(self, upload: ClientUpload, member: int) -> dict[str, np.ndarray]:
        """Member's summed GGN diagonal H per parameter (round-off negatives clipped to 0)."""
        spec = self.context.model_spec
        shapes = self.context.param_shapes(spec.name, spec.kwargs)
        curvature = curvature_from_arrays("diag", upload.members[member][SECTION], shapes,
                                          temperature=1.0, prior_var=1.0)
        assert isinstance(curvature, DiagCurvature)
        return {name: h.numpy() for name, h in curvature.diag.items()}

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        spec = self.context.model_spec
        merges, self.fallbacks = [], []
        for m in range(max(u.num_members for u in uploads)):
            holders = [u for u in uploads if u.num_members > m]
            merged, fallbacks = fisher_merge(
                [u.weights(m) for u in holders], [self.fisher(u, m) for u in holders],
                [u.num_examples for u in holders], self.floor)
            merges.append(merged)
            self.fallbacks.append(fallbacks)
        return Ensemble([spec.build(a) for a in merges], [spec] * len(merges))

    def report(self) -> dict[str, Any]:
        return {"floor": self.floor, "fedavg_fallback_entries": self.fallbacks}
