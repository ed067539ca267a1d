"""AMS: per input, the client model(s) with the highest maximum logit."""

from fedfusion.strategies.ams.predictor import MaxLogitSelector, max_logit_log_probs
from fedfusion.strategies.ams.strategy import CALIBRATIONS, TOP_K, AdaptiveModelSelection

__all__ = ["CALIBRATIONS", "TOP_K", "AdaptiveModelSelection", "MaxLogitSelector",
           "max_logit_log_probs"]
