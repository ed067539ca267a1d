"""SWA (statistical weight aggregation): the strategy and the Gaussianity statistic that
weighs each client's layers."""

from fedfusion.strategies.swa.strategy import SWA_DISTANCES, StatisticalWeightAggregation

__all__ = ["SWA_DISTANCES", "StatisticalWeightAggregation"]
