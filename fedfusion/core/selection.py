"""Greedy ensemble selection (Caruana et al., ICML 2004) on the server's validation set.

From a pool of N networks, networks are added one at a time, without replacement: at step
t the network i that maximises the validation accuracy of the uniform average

    p_t(y|x) = 1/t (sum_{j in S_{t-1}} softmax(f_j(x)) + softmax(f_i(x)))

joins S_t (ties: the lower validation NLL, then the earlier network in the pool), until
|S| = size. The result is the ensemble a prediction budget of ``size`` forward passes buys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedfusion.core.evaluation import Labelled, predict_log_probs

#: candidates scored at once (bounds the ``[candidates, n, K]`` intermediate)
CANDIDATES_PER_BATCH = 64


def greedy_selection(log_probs: torch.Tensor, labels: torch.Tensor, size: int) -> list[int]:
    """The pool indices chosen, in the order chosen, from ``log_probs`` ``[N, n, K]`` (network,
    validation row, class) and ``labels`` ``[n]``."""
    if log_probs.dim() != 3 or log_probs.shape[1] != len(labels):
        raise ValueError(f"log_probs must be [networks, {len(labels)} rows, classes], got "
                         f"{tuple(log_probs.shape)}")
    if not len(labels):
        raise ValueError("greedy selection needs at least one validation row")
    if not 1 <= size <= log_probs.shape[0]:
        raise ValueError(f"size must be in 1..{log_probs.shape[0]} (the pool), got {size}")
    probs = log_probs.double().exp()
    rows = torch.arange(len(labels))
    total = torch.zeros_like(probs[0])
    chosen: list[int] = []
    for _ in range(size):
        left = [i for i in range(probs.shape[0]) if i not in chosen]
        correct, nll = [], []
        for part in torch.split(torch.tensor(left), CANDIDATES_PER_BATCH):
            mean = (total + probs[part]) / (len(chosen) + 1)  # [part, n, K]
            correct += (mean.argmax(-1) == labels).sum(-1).tolist()  # counts: exact ties
            nll += (-mean[:, rows, labels].clamp_min(1e-300).log().mean(-1)).tolist()
        best = min(range(len(left)), key=lambda j: (-correct[j], nll[j], left[j]))
        chosen.append(left[best])
        total += probs[left[best]]
    return chosen


def select_networks(models: Sequence[nn.Module], val: Labelled, size: int,
                    device: torch.device | str = "cpu") -> list[int]:
    """:func:`greedy_selection` of ``size`` of ``models`` on ``val`` (each network run once)."""
    log_probs = torch.stack([torch.log_softmax(predict_log_probs(m, val.x, device), -1)
                             for m in models])
    return greedy_selection(log_probs, val.y.cpu(), size)
