"""Flower strategies of fedfusion, importable into any Flower project.

>>> from fedfusion.strategies import FedAvg, FedBEns, UniformEnsemble
"""

from __future__ import annotations

from fedfusion.core.fusion import Fusion
from fedfusion.flower.strategy import FusionResult, FusionStrategy
from fedfusion.strategies.ams import AdaptiveModelSelection
from fedfusion.strategies.datafree.co_boosting import CoBoosting
from fedfusion.strategies.datafree.dense import Dense
from fedfusion.strategies.ensemble import UniformEnsemble
from fedfusion.strategies.fedavg import FedAvg
from fedfusion.strategies.fedbens import FedBEns
from fedfusion.strategies.fedfisher import FedFisher
from fedfusion.strategies.fedprox import FedProx
from fedfusion.strategies.fens import FENS
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
STRATEGIES.update({cls.name: cls for cls in (AdaptiveModelSelection, PFNM)})
STRATEGIES[FENS.name] = FENS
STRATEGIES.update({CoBoosting.name: CoBoosting})


def available_strategies() -> list[str]:
    return sorted(STRATEGIES)


__all__ = [
    "FENS",
    "PFNM",
    "STRATEGIES",
    "AdaptiveModelSelection",
    "CoBoosting",
    "Dense",
    "FedAvg",
    "FedBEns",
    "FedFisher",
    "FedProx",
    "Fusion",
    "FisherMerge",
    "FusionResult",
    "FusionStrategy",
    "OTFusion",
    "RegMean",
    "StatisticalWeightAggregation",
    "UniformEnsemble",
    "available_strategies",
]
