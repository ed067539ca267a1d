"""FedAvg (McMahan et al., 2017), one-shot or multi-round.

For every member index m: w_m = sum_c n_c w_{c,m} / sum_c n_c over the clients c that
uploaded member m, with n_c the client's number of training examples. With M = 1 this is
plain FedAvg; with M > 1 it averages each initialisation separately and predicts with the
ensemble of the M averages.

Strategies that only change the averaging weights (FedProx, SWA) subclass :class:`FedAvg`
and override :meth:`FedAvg.member_average`; :func:`weighted_average` takes one weight per
client, or per parameter one weight per client (layer-wise averaging).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.predictors import Ensemble
from fedfusion.core.screening import capped_weights
from fedfusion.core.state import weighted_average
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.wire import ClientUpload, NumpyDict, UploadError

log = logging.getLogger("fedfusion")


#: one weight per client, or per parameter name one weight per client
class FedAvg(FusionStrategy):
    """Sample-size weighted parameter average.

    Parameters
    ----------
    weighted_by_key : str, default "num-examples"
        As Flower's FedAvg: the upload metric each client is weighted by ("num-examples", or
        any positive number the client reports in its metrics).
    """

    name = "fedavg"
    one_shot_only = False

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 weighted_by_key: str = "num-examples", **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        self.weighted_by_key = weighted_by_key
        #: clients whose capped metric this fusion has logged (once, not once per member)
        self._logged_caps: set[int] = set()

    def check_upload(self, upload: ClientUpload) -> None:
        """The architecture (as every strategy) and, with a ``weighted_by_key`` metric, its
        value: a client without a usable weight is excluded, not the round."""
        super().check_upload(upload)
        self.client_weight(upload)

    def client_weight(self, upload: ClientUpload) -> float:
        """The client's averaging weight: its ``weighted_by_key`` metric."""
        if self.weighted_by_key == "num-examples":
            return float(upload.num_examples)
        value = upload.metrics.get(self.weighted_by_key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0 < value < math.inf):
            raise UploadError(upload.client_id, f"metric {self.weighted_by_key!r} "
                              f"(weighted_by_key) must be a finite positive number, got "
                              f"{value!r}")
        return float(value)

    def client_weights(self, holders: Sequence[ClientUpload]) -> list[float]:
        """Each holder's :meth:`client_weight`; a metric other than the example count (which
        the screens already capped) is capped by the same rule: at ``num_examples_cap`` x
        the median of the other holders' (:func:`~fedfusion.core.screening.capped_weights`)."""
        weights = [self.client_weight(u) for u in holders]
        if self.weighted_by_key == "num-examples":
            return weights
        capped = capped_weights(weights, self.num_examples_cap)
        for upload, weight, kept in zip(holders, weights, capped, strict=True):
            if kept < weight and upload.client_id not in self._logged_caps:
                self._logged_caps.add(upload.client_id)
                log.warning("[%s] client %d: metric %r = %.4g is above %g x the others' "
                            "median; weighted as %.4g", self.name, upload.client_id,
                            self.weighted_by_key, weight, self.num_examples_cap, kept)
        return capped

    def member_average(self, holders: Sequence[ClientUpload], member: int) -> NumpyDict:
        """The fused weights of member ``member`` from the clients that uploaded it."""
        return weighted_average([u.weights(member) for u in holders],
                                self.client_weights(holders))

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        self._logged_caps.clear()
        num_members = max(u.num_members for u in uploads)
        spec = self.context.model_spec
        averages = []
        for m in range(num_members):
            averages.append(self.member_average([u for u in uploads if u.num_members > m], m))
        return Ensemble([spec.build(a) for a in averages], [spec] * num_members)
