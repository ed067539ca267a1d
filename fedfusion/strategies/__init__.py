"""Flower strategies of fedfusion, importable into any Flower project.

>>> from fedfusion.strategies import FedAvg, FedBEns, UniformEnsemble
"""

from __future__ import annotations

from fedfusion.strategies.ams import AdaptiveModelSelection
from fedfusion.strategies.base import FusionContext, FusionStrategy
from fedfusion.strategies.dense import Dense
from fedfusion.strategies.ensemble import UniformEnsemble
from fedfusion.strategies.fedavg import FedAvg
from fedfusion.strategies.fedbens import FedBEns
from fedfusion.strategies.fedfisher import FedFisher
from fedfusion.strategies.fedprox import FedProx
from fedfusion.strategies.fisher_merge import FisherMerge
from fedfusion.strategies.otfusion import OTFusion
from fedfusion.strategies.pfnm import PFNM
from fedfusion.strategies.regmean import RegMean
from fedfusion.strategies.swa import StatisticalWeightAggregation

STRATEGIES: dict[str, type[FusionStrategy]] = {
    cls.name: cls for cls in (FedAvg, UniformEnsemble, FedBEns, RegMean, OTFusion, FedFisher,
                             FisherMerge, Dense)
}
STRATEGIES.update({cls.name: cls for cls in (FedProx, StatisticalWeightAggregation)})
STRATEGIES.update({cls.name: cls for cls in (AdaptiveModelSelection, PFNM)})  # issue 6


def available_strategies() -> list[str]:
    return sorted(STRATEGIES)


def build_strategy(name: str, context: FusionContext, settings: object) -> FusionStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; available: {available_strategies()}")
    strategy = STRATEGIES[name].from_settings(context, settings)
    extra = getattr(settings, "extra_sections", "")
    strategy.extra_sections = tuple(s for s in extra.split(",") if s)
    if getattr(settings, "contrastive_weight", 0.0) > 0:  # MOON-style clients, any strategy
        strategy.client_config.update({
            "contrastive-weight": settings.contrastive_weight,
            "contrastive-temperature": settings.contrastive_temperature})
    return strategy


__all__ = [
    "PFNM",
    "STRATEGIES",
    "AdaptiveModelSelection",
    "Dense",
    "FedAvg",
    "FedBEns",
    "FedFisher",
    "FedProx",
    "FisherMerge",
    "FusionContext",
    "FusionStrategy",
    "OTFusion",
    "RegMean",
    "StatisticalWeightAggregation",
    "UniformEnsemble",
    "available_strategies",
    "build_strategy",
]
