"""One evaluation path for every global predictor: accuracy, NLL and ECE.

A predictor returns log-probabilities (see :mod:`fedfusion.core.predictors`).
ECE uses 15 equal-width confidence bins: sum_b |B_b|/N * |acc(B_b) - conf(B_b)|.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ECE_BINS = 15


@dataclass(frozen=True)
class Labelled:
    """Inputs and labels of one data set: ``x`` ``[N, ...]`` (float32, or integer / bool for
    token ids and masks), ``y`` int64 ``[N]``
    (the App's :class:`~fedfusion.datasets.ImageData` is one)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


#: labelled data as users hold it: ``(x, y)`` tensors or arrays, an object with ``.x`` and
#: ``.y`` (:class:`Labelled`), or an iterable of ``(x, y)`` batches (a ``DataLoader``)
LabelledData = Any


def as_labelled(data: LabelledData, what: str = "data") -> Labelled:
    """``data`` as one :class:`Labelled` (int64 labels; float inputs as float32, integer and
    bool inputs (token ids, masks) in their own dtype)."""
    if isinstance(data, Labelled):
        return data
    if hasattr(data, "x") and hasattr(data, "y"):
        x, y = data.x, data.y
    elif isinstance(data, tuple | list) and len(data) == 2:
        x, y = data
    elif isinstance(data, Iterable) and not isinstance(data, str | bytes | torch.Tensor):
        batches = list(data)
        if not batches or not all(isinstance(b, tuple | list) and len(b) == 2 for b in batches):
            raise TypeError(f"{what}: an iterable of data must yield (x, y) batches, as a "
                            "DataLoader over a labelled dataset does")
        x = torch.cat([torch.as_tensor(b[0]) for b in batches])
        y = torch.cat([torch.as_tensor(b[1]) for b in batches])
    else:
        raise TypeError(f"{what} must be (x, y) tensors, an object with .x and .y, or a "
                        f"DataLoader of (x, y) batches; got {type(data).__name__}")
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.is_complex():
        raise TypeError(f"{what}: inputs must be real (floating point, integer or bool), got "
                        f"{x.dtype}")
    if y.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8) or y.dim() != 1:
        raise TypeError(f"{what}: labels must be a 1-d integer tensor, got {y.dtype} "
                        f"{tuple(y.shape)}")
    if len(x) != len(y):
        raise ValueError(f"{what}: {len(x)} inputs but {len(y)} labels")
    # float inputs in float32 (the networks' precision); integer inputs (token ids, indices)
    # and bool masks keep their dtype: the model's first layer (an Embedding, a mask) reads them
    return Labelled((x.float() if x.is_floating_point() else x).contiguous(), y.long())


@torch.no_grad()
def predict_log_probs(
    predictor: nn.Module,
    x: torch.Tensor,
    device: torch.device | str = "cpu",
    batch_size: int = 2000,
) -> torch.Tensor:
    predictor = predictor.to(device).eval()
    chunks = [predictor(x[i : i + batch_size].to(device)).float().cpu()
              for i in range(0, len(x), batch_size)]
    return torch.cat(chunks) if chunks else torch.empty(0)


def classification_metrics(log_probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Accuracy, mean NLL and 15-bin ECE of log-probabilities against labels."""
    if len(y) == 0:
        return {"accuracy": float("nan"), "nll": float("nan"), "ece": float("nan")}
    confidence, prediction = log_probs.exp().max(dim=1)
    correct = (prediction == y).float()
    bins = torch.clamp((confidence * ECE_BINS).long(), max=ECE_BINS - 1)
    ece = torch.zeros(())
    for b in range(ECE_BINS):
        mask = bins == b
        if mask.any():
            ece += mask.float().mean() * (correct[mask].mean() - confidence[mask].mean()).abs()
    return {
        "accuracy": float(correct.mean()),
        "nll": float(F.nll_loss(log_probs, y)),
        "ece": float(ece),
    }


def evaluate(
    predictor: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device | str = "cpu",
    batch_size: int = 2000,
) -> dict[str, float]:
    """Evaluate a predictor (model returning log-probs, ensemble, selector) on (x, y)
    (tensors, NumPy arrays or lists: :func:`as_labelled`)."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        data = as_labelled((x, y), "evaluation data")  # NumPy arrays, lists
        x, y = data.x, data.y
    return classification_metrics(predict_log_probs(predictor, x, device, batch_size), y)
