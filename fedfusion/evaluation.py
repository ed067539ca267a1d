"""One evaluation path for every global predictor: accuracy, NLL and ECE.

A predictor returns log-probabilities (see :mod:`fedfusion.predictors`).
ECE uses 15 equal-width confidence bins: sum_b |B_b|/N * |acc(B_b) - conf(B_b)|.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

ECE_BINS = 15


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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
    """Evaluate a predictor (model returning log-probs, ensemble, selector) on (x, y)."""
    return classification_metrics(predict_log_probs(predictor, x, device, batch_size), y)
