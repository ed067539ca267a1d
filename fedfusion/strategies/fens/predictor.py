"""FENS' predictor: a trained aggregator over the members' log-probabilities."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.predictors import Ensemble, check_storage
from fedfusion.models import check_int

#: the aggregator's parameters at most (2**26 floats, 256 MB): FENS' own at C = 100 clients,
#: 500 models of 10 classes and hidden 2K = 1,000 holds 5M; a device sized by a hostile
#: server's numbers is refused before anything is allocated
MAX_AGGREGATOR_PARAMETERS = 2**26


class LogitAggregator(nn.Module):
    """FENS' aggregator over K models' log-probabilities ``z`` ``[B, K, C]``, ``p_k = exp z_k``:

        g(z)_c = s * ( log sum_k pi_kc p_kc + (1/K) sum_k a_kc z_kc + b_c + h(z)_c ),
        pi_kc = exp(m_kc) / sum_j exp(m_jc),   h(z) = W_2 relu(W_1 vec(z) + c_1) + c_2.

    The first term is a per-class mixture of the models (how far model k is trusted on class
    c), the second a per-class product of experts (a model that gives class c a low
    probability can veto it, which experts on a few classes need at strong label skew), h
    FENS' shallow network over the concatenated outputs (``hidden = 0`` leaves it out) and
    s = 1/T the temperature :meth:`FENS.calibrate` sets. At initialisation m = a = b = 0,
    W_2 = c_2 = 0 and s = 1, so g(z) = log((1/K) sum_k p_k): training starts from the uniform
    ensemble itself. The 1/K keeps a step of the server's per-parameter optimiser (FedAdam)
    on ``a`` as large, relative to the output, at 100 models as at 5."""

    def __init__(self, num_models: int, num_classes: int, hidden: int = 0):
        sizes = (num_models, num_classes, hidden)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes) or min(
                num_models, num_classes) < 1 or hidden < 0:
            raise ValueError(f"FENS' aggregator needs num_models, num_classes >= 1 and "
                             f"hidden >= 0 (ints), got {sizes}")
        parameters = (2 * num_models * num_classes + num_classes
                      + hidden * (num_models * num_classes + 1) + num_classes * (hidden + 1))
        if parameters > MAX_AGGREGATOR_PARAMETERS:
            raise ValueError(f"FENS' aggregator of {num_models} models x {num_classes} classes "
                             f"with hidden {hidden} has {parameters} parameters, above the cap "
                             f"{MAX_AGGREGATOR_PARAMETERS} (MAX_AGGREGATOR_PARAMETERS)")
        super().__init__()
        self.num_models, self.num_classes, self.hidden_size = num_models, num_classes, hidden
        self.mixture = nn.Parameter(torch.zeros(num_models, num_classes))
        self.weights = nn.Parameter(torch.zeros(num_models, num_classes))
        self.bias = nn.Parameter(torch.zeros(num_classes))
        self.register_buffer("scale", torch.ones(()))
        if hidden:
            self.hidden = nn.Linear(num_models * num_classes, hidden)
            self.out = nn.Linear(hidden, num_classes)
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        logits = (torch.logsumexp(torch.log_softmax(self.mixture, 0) + z, 1)
                  + (z * self.weights).sum(1) / self.num_models + self.bias)
        if self.hidden_size:
            logits = logits + self.out(torch.relu(self.hidden(z.flatten(1))))
        return self.scale * logits


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
        with torch.random.fork_rng(devices=[]):  # a throw-away init: the caller's RNG stays
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
