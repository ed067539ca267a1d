"""Local training: plain mini-batch SGD with momentum, deterministic given a seed.

The loop indexes one in-memory tensor per client instead of going through a DataLoader:
on a CPU core a LeNet step costs a few milliseconds, and the DataLoader's per-batch
collation would be a sizeable share of it.

The objective is the cross-entropy plus optional :data:`LossTerm` s: FedProx's
:class:`ProximalTerm` (here) and MOON's model-contrastive term
(:class:`fedfusion.contrastive.ContrastiveTerm`). Without terms the loop is plain SGD.

:func:`train_local` trains one model with autograd (the reference loop); :func:`train_members`
trains a client's M members one after the other with it, or, when asked
(``accelerate=True`` or ``FEDFUSION_ACCEL=1``), as one computation on the optional stacked
trainer (:mod:`fedfusion.accel.stacked`), ~2x the samples per second per core for LeNet
(``benchmarks/throughput.py``), falling back to :func:`train_local` for models or loss terms
that trainer does not know.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.accel import requested
from fedfusion.constraints import AT_LEAST_ONE, FINITE_POSITIVE, MOMENTUM, NON_NEGATIVE
from fedfusion.device import model_device
from fedfusion.grad_mode import gradients_on
from fedfusion.loss_terms import LossTerm, ProximalTerm
from fedfusion.seeding import seeded

__all__ = ["LossTerm", "ProximalTerm", "TrainConfig", "TrainStats", "train_local",
           "train_members"]


@dataclass(frozen=True)
class TrainConfig:
    """Local SGD's settings, checked here so that every engine (one by one, stacked,
    vmapped) refuses the same values."""

    epochs: int = 20
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 64

    def __post_init__(self) -> None:
        NON_NEGATIVE.check("epochs", self.epochs)
        FINITE_POSITIVE.check("lr", self.lr)
        MOMENTUM.check("momentum", self.momentum)
        AT_LEAST_ONE.check("batch_size", self.batch_size)


@dataclass(frozen=True)
class TrainStats:
    seconds: float
    samples: int
    final_loss: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    seed: int,
    loss_terms: Sequence[LossTerm] = (),
) -> TrainStats:
    """Train ``model`` in place on ``(x, y)`` with SGD; the batch order depends on ``seed`` only.

    Each step minimises ``cross_entropy + sum(term(x_batch) for term in loss_terms)``. The
    model trains on its own device: ``(x, y)`` may stay on the CPU, each batch is moved
    there (the shuffle is drawn on the CPU, so the order is the same on every device).
    Whatever the model draws from torch's global generator (dropout) comes from ``seed`` in
    a fork of it: the caller's generator and grad mode are left as they were."""
    device = model_device(model)
    with gradients_on(), seeded(seed, device):
        return _train_local(model, x, y, config, seed, loss_terms, device)


def _train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: TrainConfig,
                 seed: int, loss_terms: Sequence[LossTerm], device: torch.device) -> TrainStats:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    model.train()
    n = len(y)
    start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(config.epochs):
        order = torch.randperm(n, generator=generator)
        for begin in range(0, n, config.batch_size):
            batch = order[begin : begin + config.batch_size]
            optimizer.zero_grad(set_to_none=True)
            inputs = x[batch].to(device, non_blocking=True)
            loss = F.cross_entropy(model(inputs), y[batch].to(device, non_blocking=True))
            for term in loss_terms:
                loss = loss + term(inputs)
            loss.backward()
            optimizer.step()
    model.eval()
    return TrainStats(
        seconds=time.perf_counter() - start,
        samples=n * config.epochs,
        final_loss=float(loss.detach()),
    )


def train_members(
    models: Sequence[nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    seeds: Sequence[int],
    loss_terms: Sequence[Sequence[LossTerm]] | None = None,
    *,
    accelerate: bool | None = None,
) -> list[TrainStats]:
    """Train every ``models[m]`` in place as ``train_local(models[m], x, y, config, seeds[m],
    loss_terms[m])`` does: the same SGD, the same number of steps, member m's own batch order
    (``seeds[m]``), momentum buffer and loss terms.

    With ``accelerate`` (default: ``FEDFUSION_ACCEL``, else off), members of an architecture
    the stacked engine knows (:mod:`fedfusion.accel.stacked`: chains of
    convolutions, linear layers, ReLU, 2x2 max-pools and flattening, as the model zoo's) train
    as one computation, equal to the one-by-one result up to float summation order; any other
    model, or a loss term other than a :class:`ProximalTerm` on the member itself, trains one
    member after the other with :func:`train_local`. Members whose feature maps are large
    train in chunks of fewer members (:data:`CHUNK_BYTES`). The stacked engine reports one
    wall time per chunk: each member's ``seconds`` is its share, ``chunk total / chunk size``.
    The stacked engine is a CPU engine. Members on a GPU train, when asked, as one vmapped
    computation (:mod:`fedfusion.accel.vmapped`: models without buffers or dropout, no loss
    terms; each member's ``seconds`` is its share of the wall time), else one after the other
    with :func:`train_local` on their device."""
    if len(seeds) != len(models):
        raise ValueError(f"train_members got {len(models)} models and {len(seeds)} seeds")
    terms = [list(t) for t in loss_terms] if loss_terms is not None else [[] for _ in models]
    if len(terms) != len(models):
        raise ValueError(f"train_members got {len(models)} models and {len(terms)} "
                         "lists of loss terms")
    def one_by_one() -> list[TrainStats]:
        return [train_local(model, x, y, config, seed, member_terms)
                for model, seed, member_terms in zip(models, seeds, terms, strict=True)]

    if not requested(accelerate):
        return one_by_one()
    if off_cpu(models):
        return _vmapped(models, x, y, config, seeds, terms) or one_by_one()
    from fedfusion.accel.stacked import compile_members, train_stacked

    for model in models:
        model.train()
    size = _members_per_chunk(models, x, config.batch_size)
    chunks = [slice(begin, begin + size) for begin in range(0, len(models), size)]
    nets = [compile_members(models[chunk], x, terms[chunk]) for chunk in chunks]
    if not nets or any(net is None for net in nets):
        return one_by_one()
    stats: list[TrainStats] = []
    for net, chunk in zip(nets, chunks, strict=True):
        assert net is not None
        stats += _shared_stats(*train_stacked(net, x, y, config.epochs, config.lr,
                                              config.momentum, config.batch_size, seeds[chunk]),
                               samples=len(y) * config.epochs)
    for model in models:
        model.eval()
    return stats


def off_cpu(models: Sequence[nn.Module]) -> bool:
    """Whether any of ``models`` lives off the CPU (on a GPU)."""
    return any(model_device(m).type != "cpu" for m in models)


def _vmapped(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor,
             config: TrainConfig, seeds: Sequence[int],
             terms: Sequence[Sequence[LossTerm]]) -> list[TrainStats] | None:
    """Members on a GPU as one computation (:mod:`fedfusion.accel.vmapped`); None where that
    engine does not apply (loss terms, buffers, dropout, mixed devices)."""
    from fedfusion.accel.vmapped import train_vmapped

    if any(terms):
        return None
    trained = train_vmapped(models, x, y, config.epochs, config.lr, config.momentum,
                            config.batch_size, seeds)
    if trained is None:
        return None
    return _shared_stats(*trained, samples=len(y) * config.epochs)


def _shared_stats(seconds: float, losses: Sequence[float], samples: int) -> list[TrainStats]:
    """One engine run's members: each its share of the wall time and its last loss."""
    return [TrainStats(seconds=seconds / len(losses), samples=samples, final_loss=loss)
            for loss in losses]


#: feature maps (and their gradients) of one stacked chunk of members, per step: above a
#: few tens of MB the chunk's maps leave the caches, and stacking stops paying
#: (benchmarks/docs/throughput.md)
CHUNK_BYTES = 32 * 2**20


def _members_per_chunk(models: Sequence[nn.Module], x: torch.Tensor, batch_size: int) -> int:
    """How many members one stacked computation holds (see :data:`CHUNK_BYTES`)."""
    if not models or len(x) == 0:
        return max(1, len(models))
    sizes: list[int] = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel()))
             for module in models[0].modules() if not list(module.children())]
    was_training = models[0].training
    models[0].eval()  # no side effects (BatchNorm statistics) from this probe
    try:
        with torch.no_grad():
            models[0](x[:1])
    except Exception:  # a model the stacked engine cannot run falls back anyway
        return len(models)
    finally:
        for hook in hooks:
            hook.remove()
        models[0].train(was_training)
    per_member = 2 * 4 * batch_size * sum(sizes)  # float32 maps and their gradients
    return max(1, min(len(models), CHUNK_BYTES // max(per_member, 1)))
