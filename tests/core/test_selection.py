"""Greedy ensemble selection against a brute-force reference, and its refusals."""

from __future__ import annotations

import math

import pytest
import torch

from fedfusion.core.evaluation import Labelled
from fedfusion.core.selection import greedy_selection, select_networks


def brute_force_step(probs: list[list[list[float]]], labels: list[int], chosen: list[int]
                     ) -> int:
    """The next network by plain loops: most correct rows of the average, then the lowest
    NLL, then the lowest index."""
    best = None
    for i in range(len(probs)):
        if i in chosen:
            continue
        members = chosen + [i]
        correct, nll = 0, 0.0
        for row, label in enumerate(labels):
            mean = [sum(probs[j][row][k] for j in members) / len(members)
                    for k in range(len(probs[0][0]))]
            correct += max(range(len(mean)), key=lambda k: (mean[k], -k)) == label
            nll -= math.log(mean[label]) / len(labels)
        key = (-correct, nll, i)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2]


@pytest.mark.parametrize("seed", range(4))
def test_each_step_is_the_brute_force_best(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(2 * torch.randn(7, 30, 4, generator=gen, dtype=torch.float64),
                                  -1)
    labels = torch.randint(0, 4, (30,), generator=gen)
    probs, ys = log_probs.exp().tolist(), labels.tolist()
    chosen: list[int] = []
    for _ in range(7):
        chosen.append(brute_force_step(probs, ys, chosen))
    for size in range(1, 8):
        assert greedy_selection(log_probs, labels, size) == chosen[:size]
    assert sorted(chosen) == list(range(7))


def test_ties_fall_to_the_lower_nll_then_the_earlier_network() -> None:
    labels = torch.tensor([0, 1])
    probs = torch.tensor([[[0.6, 0.4], [0.4, 0.6]],  # both right, less sure
                          [[0.9, 0.1], [0.1, 0.9]],  # both right, surer: lower NLL
                          [[0.9, 0.1], [0.1, 0.9]],  # the same again: the earlier one wins
                          [[0.1, 0.9], [0.9, 0.1]]])  # both wrong
    assert greedy_selection(probs.log(), labels, 1) == [1]
    assert greedy_selection(probs.log(), labels, 2) == [1, 2]


def test_a_diverse_network_beats_a_better_copy() -> None:
    """What the selection is for: after the best network, the one that fixes its mistakes
    joins, not a copy that repeats them (the average of 0 and 2 is right on 3 rows of 3)."""
    labels = torch.tensor([0, 0, 1])
    probs = torch.tensor([[[0.9, 0.1], [0.9, 0.1], [0.6, 0.4]],
                          [[0.9, 0.1], [0.9, 0.1], [0.6, 0.4]],
                          [[0.45, 0.55], [0.3, 0.7], [0.1, 0.9]]])
    assert greedy_selection(probs.log(), labels, 2) == [0, 2]


def test_select_networks_runs_each_model_on_the_validation_inputs() -> None:
    x = torch.eye(3)
    models = [torch.nn.Linear(3, 3, bias=False) for _ in range(4)]
    with torch.no_grad():
        for i, m in enumerate(models):
            m.weight.copy_(torch.roll(torch.eye(3), i % 3, 0) * 5)
    val = Labelled(x, torch.tensor([1, 2, 0]))  # network 1 (and 4 % 3 = 1) is right
    assert select_networks(models, val, 1) == [1]
    assert sorted(select_networks(models, val, 4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("size, shape, rows, match", [
    (0, (3, 5, 2), 5, "size must be in 1..3"),
    (4, (3, 5, 2), 5, "size must be in 1..3"),
    (1, (3, 5), 5, "networks, 5 rows, classes"),
    (1, (3, 4, 2), 5, "networks, 5 rows, classes"),
    (1, (3, 0, 2), 0, "at least one validation row"),
])
def test_bad_arguments_are_refused(size: int, shape: tuple[int, ...], rows: int,
                                   match: str) -> None:
    with pytest.raises(ValueError, match=match):
        greedy_selection(torch.zeros(shape), torch.zeros(rows, dtype=torch.long), size)
