"""FedAvg (McMahan et al., 2017), one-shot or multi-round.

For every member index m: w_m = sum_c n_c w_{c,m} / sum_c n_c over the clients c that
uploaded member m, with n_c the client's number of training examples. With M = 1 this is
plain FedAvg; with M > 1 it averages each initialisation separately and predicts with the
ensemble of the M averages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from fedfusion.payload import ClientUpload
from fedfusion.predictors import Ensemble
from fedfusion.strategies.base import FusionStrategy


def weighted_average(arrays: Sequence[dict[str, np.ndarray]], weights: Sequence[float]
                     ) -> dict[str, np.ndarray]:
    """sum_i weights_i * arrays_i / sum_i weights_i, parameter by parameter (in float64)."""
    total = float(sum(weights))
    return {
        name: (sum(w * a[name].astype(np.float64) for a, w in zip(arrays, weights, strict=True))
               / total).astype(arrays[0][name].dtype)
        for name in arrays[0]
    }


class FedAvg(FusionStrategy):
    """Sample-size weighted parameter average."""

    name = "fedavg"
    one_shot_only = False

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        num_members = max(u.num_members for u in uploads)
        spec = self.context.model_spec
        averages = []
        for m in range(num_members):
            holders = [u for u in uploads if u.num_members > m]
            averages.append(weighted_average([u.weights(m) for u in holders],
                                             [u.num_examples for u in holders]))
        return Ensemble([spec.build(a) for a in averages], [spec] * num_members)
