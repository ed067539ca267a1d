"""Model-contrastive local loss (MOON, Li et al., 2021), the paper's "SWA w/ contrastive loss".

For a batch, with ``z`` the local model's representation, ``z_glob`` that of the global
model the client received and ``z_prev`` that of the client's own model after its previous
round, and ``sim`` the cosine similarity:

    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau)
                                              + exp(sim(z, z_prev) / tau)) )

averaged over the batch; the client minimises ``cross_entropy + weight * l_con``. The
representation is the input of the model's last ``nn.Linear`` (the layer before the logits:
every model of the zoo ends with one; MOON's projection head is not added), taken with a
forward hook, so the local model's ``z`` comes from the training step's own forward pass.
The global and previous models are frozen copies.

Without a previous local model (a client's first round) ``z_prev`` would be ``z_glob`` and
``l_con`` the constant ``log 2`` with zero gradient: the client then trains without the term.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import TracebackType

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.constraints import FINITE_NON_NEGATIVE, FINITE_POSITIVE


def representation_layer(model: nn.Module) -> nn.Linear:
    """The model's last ``nn.Linear`` (in registration order): its input is the representation."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer; the contrastive loss "
                         "takes the input of the last one as the representation")
    return linears[-1]


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                           temperature: float) -> torch.Tensor:
    """MOON's ``l_con`` of a batch of representations ``[B, D]`` (mean over the batch)."""
    if not z.shape == z_glob.shape == z_prev.shape:
        raise ValueError(f"representation shapes differ: {tuple(z.shape)}, "
                         f"{tuple(z_glob.shape)}, {tuple(z_prev.shape)}")
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                          F.cosine_similarity(z, z_prev, dim=1)], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


class _Capture:
    """Keeps the flattened input of ``module`` from the latest forward pass."""

    def __init__(self, module: nn.Module):
        self.value: torch.Tensor | None = None
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
        self.value = inputs[0].flatten(1)

    def take(self) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError("no forward pass since the last take()")
        value, self.value = self.value, None
        return value


def _frozen(model: nn.Module, state: Mapping[str, np.ndarray | torch.Tensor]) -> nn.Module:
    frozen = copy.deepcopy(model)
    frozen.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    frozen.eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen


class ContrastiveTerm:
    """``weight * l_con`` as a :data:`fedfusion.training.LossTerm` of ``model``.

    ``global_state`` and ``previous_state`` are state dicts of ``model``'s architecture. Use
    as a context manager (or call :meth:`close`) to remove the hook from ``model``."""

    def __init__(self, model: nn.Module, global_state: Mapping[str, np.ndarray | torch.Tensor],
                 previous_state: Mapping[str, np.ndarray | torch.Tensor], weight: float,
                 temperature: float):
        FINITE_NON_NEGATIVE.check("the contrastive weight", weight)
        FINITE_POSITIVE.check("the contrastive temperature", temperature)
        self.weight = weight
        self.temperature = temperature
        self.global_model = _frozen(model, global_state)
        self.previous_model = _frozen(model, previous_state)
        self._local = _Capture(representation_layer(model))
        self._global = _Capture(representation_layer(self.global_model))
        self._previous = _Capture(representation_layer(self.previous_model))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        z = self._local.take()
        with torch.no_grad():
            self.global_model(x)
            self.previous_model(x)
        return self.weight * model_contrastive_loss(z, self._global.take(),
                                                    self._previous.take(), self.temperature)

    def close(self) -> None:
        for capture in (self._local, self._global, self._previous):
            capture.handle.remove()

    def __enter__(self) -> ContrastiveTerm:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
