"""The fusion core, without Flower: the :class:`~fedfusion.core.fusion.Fusion` pipeline
(validate -> screen -> fuse -> normalisation statistics -> checks), screening, the model
spec and state layout, the model check, predictors and their evaluation. Nothing here
imports ``flwr``."""
