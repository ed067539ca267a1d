"""The client's local objective in the App: cross-entropy plus what the server's train
config asks for (0 = off): FedProx's proximal term to the received global model
(``prox-mu``) and MOON's model-contrastive term (``contrastive-weight``,
``contrastive-temperature``).

The contrastive term needs each member's model of the client's previous round: the App keeps
it in ``context.state``, which Flower persists per node across the rounds of a run
(:func:`previous_models`, :func:`keep_previous`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from torch import nn

from fedfusion.app.config import Settings, knob_of
from fedfusion.contrastive import ContrastiveTerm
from fedfusion.core.state import state_arrays
from fedfusion.training import LossTerm, ProximalTerm
from fedfusion.wire import NumpyDict


@dataclass(frozen=True)
class LocalObjective:
    """The client-side loss terms a strategy asks for in the train config (0 = off)."""

    prox_mu: float = 0.0
    contrastive_weight: float = 0.0
    contrastive_temperature: float = 0.5

    #: train-config key -> field
    KEYS: ClassVar[dict[str, str]] = {
        "prox-mu": "prox_mu", "contrastive-weight": "contrastive_weight",
        "contrastive-temperature": "contrastive_temperature"}

    def __post_init__(self) -> None:
        # each key is checked by the rule of the run-config key of the same name
        rules = {f.name: knob_of(f).check for f in fields(Settings)}
        for key, name in self.KEYS.items():
            rules[name].check(f"train config {key!r}", getattr(self, name))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LocalObjective:
        values = {}
        for key, name in cls.KEYS.items():
            if key in config:
                value = config[key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"train config {key!r} must be a number, got {value!r}")
                values[name] = float(value)
        return cls(**values)


def loss_terms(model: nn.Module, objective: LocalObjective, previous: NumpyDict | None,
               stack: ExitStack) -> list[LossTerm]:
    """The objective's terms for ``model``, which holds the received global weights now.

    The contrastive term is left out without a previous model of the same architecture."""
    terms: list[LossTerm] = []
    if objective.prox_mu > 0:
        terms.append(ProximalTerm(model, objective.prox_mu))
    if objective.contrastive_weight > 0 and previous is not None and same_shapes(
            previous, model.state_dict()):
        terms.append(stack.enter_context(ContrastiveTerm(
            model, model.state_dict(), previous, objective.contrastive_weight,
            objective.contrastive_temperature)))
    return terms


def same_shapes(a: Mapping[str, np.ndarray], b: Mapping[str, torch.Tensor]) -> bool:
    """True where ``a`` and ``b`` hold the same parameter names in the same shapes."""
    return a.keys() == b.keys() and all(tuple(a[k].shape) == tuple(b[k].shape) for k in a)


def previous_key(member: int) -> str:
    """Where ``context.state`` keeps member ``member``'s model of the previous round."""
    return f"fedfusion.previous.m{member}"


def previous_models(state: RecordDict) -> list[NumpyDict]:
    """The members' models of the previous round kept in ``state`` (none in round 1)."""
    previous: list[NumpyDict] = []
    while previous_key(len(previous)) in state:
        previous.append({k: v.numpy() for k, v in state[previous_key(len(previous))].items()})
    return previous


def keep_previous(state: RecordDict, models: Sequence[nn.Module]) -> None:
    """Keep the trained ``models`` in ``state`` for the next round's contrastive term."""
    for m, model in enumerate(models):
        state[previous_key(m)] = ArrayRecord(
            {k: Array(np.ascontiguousarray(v)) for k, v in state_arrays(model).items()})
