"""Global predictors: what a strategy hands to evaluation and saves for inference.

Every predictor is an ``nn.Module`` mapping inputs to LOG-probabilities ``[B, K]``, so one
evaluation path serves a single model, an ensemble, or a per-input selector. A predictor is
saved as plain tensors plus a JSON-able spec (``torch.load(weights_only=True)`` loads it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.models import build_model


class ModelSpec:
    """How to rebuild one member network: registry name, kwargs, input shape, classes."""

    def __init__(
        self,
        name: str,
        input_shape: Sequence[int],
        num_classes: int,
        kwargs: Mapping[str, Any] | None = None,
    ):
        self.name = name
        self.input_shape = tuple(int(v) for v in input_shape)
        self.num_classes = int(num_classes)
        self.kwargs = dict(kwargs or {})

    def build(self, state: Mapping[str, np.ndarray | torch.Tensor] | None = None) -> nn.Module:
        model = build_model(self.name, self.input_shape, self.num_classes, **self.kwargs)
        if state is not None:
            model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        return model.eval()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "kwargs": self.kwargs,
        }

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> ModelSpec:
        return cls(spec["name"], spec["input_shape"], spec["num_classes"], spec.get("kwargs"))


class Ensemble(nn.Module):
    """p(y|x) = 1/M sum_m softmax(f_m(x)); a single model is an ensemble of one."""

    kind = "ensemble"

    def __init__(self, models: Sequence[nn.Module], specs: Sequence[ModelSpec]):
        super().__init__()
        if len(models) != len(specs) or not models:
            raise ValueError("an ensemble needs one spec per model and at least one model")
        self.members = nn.ModuleList(models)
        self.specs = list(specs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_probs = torch.stack([torch.log_softmax(m(x), dim=-1) for m in self.members])
        return torch.logsumexp(log_probs, dim=0) - math.log(len(self.members))

    def to_payload(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "specs": [s.to_dict() for s in self.specs],
            "states": [{k: v.detach().cpu() for k, v in m.state_dict().items()}
                       for m in self.members],
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Ensemble:
        specs = [ModelSpec.from_dict(s) for s in payload["specs"]]
        return cls([s.build(st) for s, st in zip(specs, payload["states"], strict=True)], specs)


PREDICTOR_KINDS: dict[str, type] = {Ensemble.kind: Ensemble}


def save_predictor(predictor: nn.Module, path: str | Path) -> Path:
    """Save any registered predictor (plain tensors and lists; no code is pickled)."""
    path = Path(path)
    torch.save(predictor.to_payload(), path)  # type: ignore[operator]
    return path


def load_predictor(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Load a saved predictor for inference: ``load_predictor(p)(x)`` gives log-probabilities."""
    payload = torch.load(Path(path), map_location=device, weights_only=True)
    kind = payload.get("kind")
    if kind not in PREDICTOR_KINDS:
        raise ValueError(f"{path}: unknown predictor kind {kind!r}")
    return PREDICTOR_KINDS[kind].from_payload(payload).to(device).eval()
