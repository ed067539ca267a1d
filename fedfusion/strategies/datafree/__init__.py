"""Data-free distillation: DENSE and Co-Boosting, which train a generator of synthetic inputs
against the clients' ensemble and distil the ensemble into one model on them. The synthesis
they share (generator, sample pool, losses) is :mod:`fedfusion.synthesis`, which the core's
``distil="synthetic"`` uses too."""

from fedfusion.strategies.datafree.co_boosting import CoBoosting
from fedfusion.strategies.datafree.dense import Dense

__all__ = ["CoBoosting", "Dense"]
