"""FedProx (Li et al., 2020): FedAvg whose clients minimise ``loss + mu/2 ||w - w_global||^2``.

The server side is FedAvg's (sample-weighted average, one-shot or multi-round). The
strategy sends ``prox-mu`` (run-config key, default 0.01) to the clients in every round's
train config, so the proximal term is the strategy's choice, as in Flower's own FedProx;
the ClientApp adds :class:`fedfusion.training.ProximalTerm` with the received global model
as reference. ``prox-mu = 0`` is FedAvg exactly (the term is not added at all).
"""

from __future__ import annotations

from typing import Any

from fedfusion.strategies.base import FusionContext, FusionStrategy
from fedfusion.strategies.fedavg import FedAvg


class FedProx(FedAvg):
    """FedAvg aggregation, proximal local objective."""

    name = "fedprox"

    def __init__(self, context: FusionContext, num_clients: int, prox_mu: float = 0.01,
                 min_valid_uploads: int = 1):
        super().__init__(context, num_clients, min_valid_uploads)
        if not prox_mu >= 0:
            raise ValueError(f"prox-mu must be >= 0, got {prox_mu}")
        self.client_config["prox-mu"] = float(prox_mu)

    @classmethod
    def from_settings(cls, context: FusionContext, settings: Any) -> FusionStrategy:
        return cls(context, settings.num_clients, settings.prox_mu)
