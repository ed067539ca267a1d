"""Extra terms of the local training objective, beside the cross-entropy.

A :data:`LossTerm` is called with the batch inputs right after the model's forward pass on
them; FedProx's :class:`ProximalTerm` is here, MOON's model-contrastive term is
:class:`fedfusion.contrastive.ContrastiveTerm`. Both trainers (:mod:`fedfusion.training` and
the optional stacked one, :mod:`fedfusion.accel.stacked`) import them from this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from fedfusion.constraints import FINITE_NON_NEGATIVE

#: an extra loss added to every step's cross-entropy, called with the batch inputs right
#: after the model's forward pass on them (so a hook may reuse that pass's activations)
LossTerm = Callable[[torch.Tensor], torch.Tensor]


class ProximalTerm:
    """FedProx (Li et al., 2020): ``mu / 2 * ||w - w_ref||^2`` over the model's parameters.

    ``reference`` (parameter name -> tensor) defaults to a copy of the model's parameters
    when the term is built, i.e. the global model the client just received."""

    def __init__(self, model: nn.Module, mu: float,
                 reference: Mapping[str, torch.Tensor] | None = None):
        FINITE_NON_NEGATIVE.check("the proximal mu", mu)
        self.mu = mu
        self.params = dict(model.named_parameters())
        if reference is None:
            reference = {k: p.detach().clone() for k, p in self.params.items()}
        missing = sorted(set(self.params) - set(reference))
        if missing:
            raise ValueError(f"the proximal reference lacks parameters {missing}")
        # on each parameter's device: a GPU client's term never mixes devices
        self.reference = {k: torch.as_tensor(reference[k], device=p.device).detach()
                          for k, p in self.params.items()}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.mu / 2 * sum((p - self.reference[k]).pow(2).sum()
                                 for k, p in self.params.items())
