"""AMS: per input, the client model(s) with the highest maximum logit."""

from fedfusion.strategies.ams.predictor import MaxLogitSelector, max_logit_log_probs
from fedfusion.strategies.ams.strategy import TOP_K, AdaptiveModelSelection

__all__ = ["TOP_K", "AdaptiveModelSelection", "MaxLogitSelector", "max_logit_log_probs"]
