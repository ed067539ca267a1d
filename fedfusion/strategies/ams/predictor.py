"""AMS' predictor: per input, the members with the highest maximum logit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedfusion.constraints import Constraint
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.calibration import TEMPERATURE_BOUNDS
from fedfusion.core.predictors import MAX_PREDICTOR_MEMBERS, Ensemble
from fedfusion.models import check_int


def max_logit_log_probs(logits: torch.Tensor, top_k: int = 1,
                        temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """AMS (Zhang & Zhang): per input, log_softmax of the sum of the logit vectors of the
    ``top_k`` models with the highest maximum logit ("absolute confidence").

    ``logits`` is ``[N models, B, K]``. ``top_k = 1`` is AMS-top1 (the selected model's
    log-softmax, Algorithm 2); ``top_k = 0`` or ``>= N`` sums all N (AMS-full). Ties go to
    the lower model index, so the result is deterministic.

    With ``temperatures`` (``[N]``, each model's validation temperature T_j), each model's
    logits are f_j / T_j and its confidence is its calibrated top probability
    max_c log softmax(f_j / T_j)_c instead of the raw max-logit: invariant to a model's
    logits being scaled (T_j scales with them) or shifted by a per-input constant.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [models, batch, classes], got {tuple(logits.shape)}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    k = logits.shape[0] if top_k == 0 else min(top_k, logits.shape[0])
    if temperatures is None:
        confidence = logits.max(dim=-1).values  # [N, B]
    else:
        logits = logits / temperatures.to(logits)[:, None, None]
        confidence = torch.log_softmax(logits, dim=-1).max(dim=-1).values
    order = torch.sort(confidence, dim=0, descending=True, stable=True).indices[:k]  # [k, B]
    chosen = torch.gather(logits, 0, order[..., None].expand(-1, -1, logits.shape[-1]))
    return torch.log_softmax(chosen.sum(dim=0), dim=-1)


#: a member's temperature: what :func:`~fedfusion.core.calibration.fit_temperature` returns
TEMPERATURE = Constraint(f"in [{TEMPERATURE_BOUNDS[0]:g}, {TEMPERATURE_BOUNDS[1]:g}]",
                         lambda v: TEMPERATURE_BOUNDS[0] <= v <= TEMPERATURE_BOUNDS[1])


class MaxLogitSelector(Ensemble):
    """AMS predictor: per input, the members with the highest max-logit, or with the
    highest calibrated top probability given each member's temperature (see
    :func:`max_logit_log_probs`); members may have different architectures."""

    kind = "max-logit"
    #: the kind saved with temperatures: a version that does not know them refuses the file
    #: instead of predicting with the raw rule
    calibrated_kind = "max-logit-calibrated"

    def __init__(self, models: Sequence[nn.Module], specs: Sequence[ModelSpec], top_k: int = 1,
                 temperatures: Sequence[float] | None = None):
        super().__init__(models, specs)
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = all members), got {top_k}")
        self.top_k = int(top_k)
        if temperatures is not None:
            if len(temperatures) != len(self.members):
                raise ValueError(f"{len(temperatures)} temperatures for {len(self.members)} "
                                 "members")
            for t in temperatures:
                TEMPERATURE.check("a temperature", t)
        #: each member's temperature T_j, or None for the raw max-logit rule
        self.temperatures = None if temperatures is None else [float(t) for t in temperatures]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        temperatures = None if self.temperatures is None else torch.tensor(self.temperatures)
        return max_logit_log_probs(torch.stack([m(x) for m in self.members]), self.top_k,
                                   temperatures)

    def to_payload(self) -> dict[str, Any]:
        kind = self.kind if self.temperatures is None else self.calibrated_kind
        return {**super().to_payload(), "kind": kind, "top_k": self.top_k,
                "temperatures": self.temperatures}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], model_fn: ModelFn | None = None
                     ) -> MaxLogitSelector:
        ensemble = Ensemble.from_payload(payload, model_fn)
        return cls(list(ensemble.members), ensemble.specs, int(payload["top_k"]),
                   payload.get("temperatures"))

    @classmethod
    def check_payload(cls, where: str, payload: Mapping[str, Any]) -> None:
        check_int(where, "top_k", payload.get("top_k"), 0, MAX_PREDICTOR_MEMBERS)
        temperatures = payload.get("temperatures")
        if payload.get("kind") != cls.calibrated_kind:
            if temperatures is not None:
                raise ValueError(f"{where}: 'temperatures' belong to kind "
                                 f"{cls.calibrated_kind!r}, not {payload.get('kind')!r}")
            return
        members = len(payload.get("states") or [])
        if (not isinstance(temperatures, list) or len(temperatures) != members
                or not all(type(t) is float and TEMPERATURE.ok(t) for t in temperatures)):
            raise ValueError(f"{where}: 'temperatures' must be a list of one float per member "
                             f"({members}), each {TEMPERATURE.rule}")
