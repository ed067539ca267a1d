"""FENS: one-shot uploads, then an aggregator over their outputs trained federatedly."""

from fedfusion.strategies.fens.strategy import FENS, HOLDOUT_KEY

__all__ = ["FENS", "HOLDOUT_KEY"]
