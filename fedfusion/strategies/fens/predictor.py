"""FENS' predictor: a trained aggregator over the members' log-probabilities."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.predictors import Ensemble, check_storage
from fedfusion.models import check_int


class LogitAggregator(nn.Module):
    """FENS' aggregator over K models' log-probabilities ``z`` ``[B, K, C]``:

        g(z) = sum_k a_k * z_k + b + W_2 relu(W_1 vec(z) + c_1) + c_2,

    ``a_k`` a per-class weight vector of model k (the per-model weighting), the second part
    a shallow network over the concatenated outputs (FENS' own aggregator; ``hidden = 0``
    leaves it out). At initialisation ``a_k = 1/K``, ``b = 0`` and ``W_2 = c_2 = 0``: g starts
    as the mean of the models' log-probabilities, so training starts from the ensemble."""

    def __init__(self, num_models: int, num_classes: int, hidden: int = 0):
        super().__init__()
        self.num_models, self.num_classes, self.hidden_size = num_models, num_classes, hidden
        self.weights = nn.Parameter(torch.full((num_models, num_classes), 1.0 / num_models))
        self.bias = nn.Parameter(torch.zeros(num_classes))
        if hidden:
            self.hidden = nn.Linear(num_models * num_classes, hidden)
            self.out = nn.Linear(hidden, num_classes)
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        logits = (z * self.weights).sum(1) + self.bias
        if self.hidden_size:
            logits = logits + self.out(torch.relu(self.hidden(z.flatten(1))))
        return logits


def member_log_probs(models: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``[B, K, C]``: each model's log-softmax output on ``x`` (the aggregator's input)."""
    return torch.stack([torch.log_softmax(m(x), dim=-1) for m in models], dim=1)


class AggregatedEnsemble(Ensemble):
    """FENS' predictor: log_softmax(g(z(x))), g a trained :class:`LogitAggregator` over the
    members' log-probabilities z (every member one forward pass per prediction)."""

    kind = "aggregated"

    def __init__(self, models: Sequence[nn.Module], specs: Sequence[ModelSpec],
                 aggregator: LogitAggregator):
        super().__init__(models, specs)
        if aggregator.num_models != len(models):
            raise ValueError(f"the aggregator takes {aggregator.num_models} models' outputs, "
                             f"the ensemble has {len(models)}")
        self.aggregator = aggregator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.aggregator(member_log_probs(self.members, x)), dim=-1)

    def to_payload(self) -> dict[str, Any]:
        return {**super().to_payload(), "hidden": self.aggregator.hidden_size,
                "aggregator": {k: v.detach().cpu()
                               for k, v in self.aggregator.state_dict().items()}}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], model_fn: ModelFn | None = None
                     ) -> AggregatedEnsemble:
        ensemble = Ensemble.from_payload(payload, model_fn)
        aggregator = LogitAggregator(len(ensemble.members), ensemble.specs[0].num_classes,
                                     int(payload["hidden"]))
        aggregator.load_state_dict(payload["aggregator"])
        return cls(list(ensemble.members), ensemble.specs, aggregator)

    @classmethod
    def check_payload(cls, where: str, payload: Mapping[str, Any]) -> None:
        """The head: its width an int, its state the shapes it implies."""
        num_models = len(payload["specs"])
        hidden = check_int(where, "hidden", payload.get("hidden"), 0, 2**20)
        num_classes = payload["specs"][0]["num_classes"]
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in
                        LogitAggregator(num_models, num_classes, hidden).state_dict().items()}
        state = payload.get("aggregator")
        if not isinstance(state, dict) or set(state) != set(expected) or not all(
                isinstance(state[k], torch.Tensor) and tuple(state[k].shape) == shape
                and state[k].is_floating_point() for k, shape in expected.items()):
            raise ValueError(f"{where}: 'aggregator' must hold the float tensors {expected} of "
                             f"a head over {num_models} models, {num_classes} classes, hidden "
                             f"{hidden}")
        for name, tensor in state.items():
            check_storage(f"{where}: aggregator[{name!r}]", tensor)
