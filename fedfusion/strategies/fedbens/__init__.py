"""FedBEns: the strategy, its mixture objective (Eq. 5), the runs' starts and the batched
server optimiser that maximises the objective."""

from fedfusion.strategies.fedbens.strategy import FedBEns

__all__ = ["FedBEns"]
