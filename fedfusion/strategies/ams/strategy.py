"""AMS, adaptive model selection (Zhang & Zhang, "Investigating Neuron Disturbing in Fusing
Heterogeneous Neural Networks"), one-shot.

The server keeps every client model f^(j) (pre-softmax logits) and predicts per input x:

* AMS-top1 (Algorithm 2): j* = argmax_j max_c f^(j)_c(x), the client with the highest
  maximum logit ("absolute confidence"), and p(y|x) = softmax(f^(j*)(x));
* top-k: p(y|x) = softmax(sum_{j in S_k(x)} f^(j)(x)) over the k clients S_k(x) with the
  highest maximum logits; k = number of models is AMS-full (the logits of all clients
  summed, i.e. fusion in the last layer only, Eq. 2).

Run-config key ``ams-top-k``: 1 = AMS-top1 (default), 0 = all (AMS-full), any k in between.
k larger than the number of models (e.g. after an excluded client) means all of them.

Clients may use different architectures with the same number of classes (paper Table 4,
MLPs of 1..5 hidden layers): the server builds each client's network from its upload's
``model``/``model-kwargs``. The predictor is a
:class:`~fedfusion.strategies.ams.predictor.MaxLogitSelector` (saved and loaded like any predictor).

``calibration="temperature"`` (run-config ``ams-calibration``; not in the paper): each model's
temperature T_j is fitted on the server's validation rows (temperature scaling, Guo et al.
2017: :func:`~fedfusion.core.calibration.fit_temperature`, the labels smoothed by the rule
of succession so that a model right on every row is not taken as certain), its logits
become f_j / T_j and the selection uses each model's calibrated top probability
max_c log softmax(f_j / T_j)_c.
Raw logits are on each client's own scale, and a client that scales its last layer up, or
shifts its logits, wins every input; the calibrated selection is invariant to both. Without
a validation set it falls back to the paper's rule, and the report says so.

Departures: with M > 1 members per client, each member counts as a model of its own (the
selection runs over all N x M members), since the paper has one model per client. Ties in
the maximum logit go to the lower (client, member) index.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from fedfusion.constraints import Constraint
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.calibration import fit_temperature, succession_smoothing
from fedfusion.core.evaluation import predict_log_probs
from fedfusion.core.predictors import Ensemble
from fedfusion.strategies.ams.predictor import MaxLogitSelector
from fedfusion.strategies.ensemble import UniformEnsemble
from fedfusion.wire import ClientUpload

log = logging.getLogger("fedfusion")

#: ``top_k``'s rule, which the App's ``ams-top-k`` shares
TOP_K = Constraint(">= 0 (0 = all clients)", lambda v: v >= 0)
#: how AMS compares the models' confidence: the paper's raw max-logit, or calibrated
CALIBRATIONS = ("none", "temperature")


class AdaptiveModelSelection(UniformEnsemble):
    """Per input, the client model(s) with the highest maximum logit (AMS-top1 / top-k).

    The same models as the uniform ensemble, combined by selection instead of averaging.

    Parameters
    ----------
    top_k : int, default 1
        1 = AMS-top1, k = the sum of the top-k models' logits, 0 = all (AMS-full).
    size : int, default 0
        The members AMS selects among (0 = every member); K > 0 keeps the K members the
        uniform ensemble's ``size`` keeps (picked by greedy ensemble selection of their
        average on the validation set, else member 0 of every client first).
    calibration : {"none", "temperature"}, default "none"
        "none": the paper's raw max-logit; "temperature": each model's logits divided by
        its validation temperature, selected by calibrated top probability (needs the
        validation set; without one, "none").
    """

    name = "ams"

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 top_k: int = 1, calibration: str = "none", **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        TOP_K.check("top_k", top_k)
        if calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")
        self.top_k, self.calibration = top_k, calibration
        #: the models the last fusion's selector holds
        self.num_models = 0
        #: each model's validation temperature in the last fusion (None: raw max-logit)
        self.temperatures: list[float] | None = None

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        ensemble = super().fuse(uploads)
        assert isinstance(ensemble, Ensemble)
        self.num_models = len(ensemble.members)
        self.temperatures = None
        val = self.context.val
        if self.calibration == "temperature":
            if val is not None and len(val):
                logits = [predict_log_probs(m, val.x, self.context.device)
                          for m in ensemble.members]
                smoothing = succession_smoothing(len(val), logits[0].shape[-1])
                self.temperatures = [fit_temperature(f, val.y, smoothing) for f in logits]
            else:
                log.warning("[ams] calibration 'temperature' needs a validation set; "
                            "the paper's raw max-logit is used")
        return MaxLogitSelector(list(ensemble.members), ensemble.specs, self.top_k,
                                self.temperatures)

    def report(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "num_models": self.num_models, "size": self.size,
                "selection": self.selection, "calibration": self.calibration,
                "temperatures": self.temperatures,
                "architectures": sorted({f"{u.model}{u.model_kwargs}" for u in self.uploads})}
