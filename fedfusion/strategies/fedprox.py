"""FedProx (Li et al., 2020): FedAvg whose clients minimise ``loss + mu/2 ||w - w_global||^2``.

The server side is FedAvg's (sample-weighted average, one-shot or multi-round). The
strategy sends ``prox-mu`` (run-config key, default 0.01) to the clients in every round's
train config, so the proximal term is the strategy's choice, as in Flower's own FedProx;
the ClientApp adds :class:`fedfusion.training.ProximalTerm` with the received global model
as reference. ``prox-mu = 0`` is FedAvg exactly (the term is not added at all).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fedfusion.constraints import FINITE_NON_NEGATIVE
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """FedAvg aggregation, proximal local objective.

    Parameters
    ----------
    prox_mu : float, default 0.01
        mu of the proximal term the clients add (sent in every train config).
    weighted_by_key : str, default "num-examples"
        As :class:`FedAvg` (the upload metric each client is weighted by).
    """

    name = "fedprox"

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 prox_mu: float = 0.01, **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        FINITE_NON_NEGATIVE.check("prox_mu", prox_mu)
        self.client_config["prox-mu"] = float(prox_mu)

