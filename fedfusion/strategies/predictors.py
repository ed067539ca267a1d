"""Every predictor kind a strategy saves, for :func:`load_predictor` (which rebuilds a
saved predictor by its ``kind`` without importing code from the file)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from fedfusion.core.architecture import ModelFn
from fedfusion.core.predictors import Ensemble, read_predictor
from fedfusion.strategies.ams.predictor import MaxLogitSelector
from fedfusion.strategies.fens.predictor import AggregatedEnsemble

#: kind -> predictor class: the uniform ensemble (every model-merging strategy's single model
#: is an ensemble of one), AMS' selector and FENS' aggregated ensemble
PREDICTOR_KINDS: Mapping[str, type[Ensemble]] = {
    **{cls.kind: cls for cls in (Ensemble, MaxLogitSelector, AggregatedEnsemble)},
    MaxLogitSelector.calibrated_kind: MaxLogitSelector}


def load_predictor(path: str | Path, device: str | torch.device = "cpu",
                   model_fn: ModelFn | None = None) -> Ensemble:
    """Load a saved predictor for inference: ``load_predictor(p)(x)`` gives log-probabilities.
    A predictor of a user's ``model_fn`` (not the zoo) needs that ``model_fn`` back. The file
    is untrusted and checked field by field before anything is built
    (:func:`fedfusion.core.predictors.read_predictor`)."""
    return read_predictor(path, PREDICTOR_KINDS, device, model_fn)
