"""Normalisation statistics of fused models: what happens to BatchNorm's running mean and
variance (and its ``num_batches_tracked`` counter) when client models are fused.

A BatchNorm layer in eval mode computes ``gamma (x - mu) / sqrt(var + eps) + beta`` with the
running statistics ``mu``, ``var`` it estimated on its client's data, through that client's
weights. A fused network has new weights, so no client's statistics are its own. The rules
(``norm_stats=`` of every strategy):

* ``"average"``: the sample-weighted average of the clients' statistics, the same weights as
  the parameters (FedAvg's ``sum_c n_c mu_c / sum_c n_c``); the integer counter is the
  heaviest client's (:func:`fedfusion.strategies.fedavg.weighted_average`). Needs nothing
  but the uploads.
* ``"recalibrate"``: each fused model (each FedBEns mode, each FedAvg member average) gets
  statistics re-estimated on the server's validation inputs ``x``, as SWA's ``bn_update``
  does (Izmailov et al., 2018): reset, then the cumulative average (``momentum=None``) of the
  batch statistics over ``x`` with only the BatchNorm layers in train mode (dropout and the
  rest stay in eval mode), so that ``mu = mean_n E[x_n]`` and ``var`` the mean of the
  batches' unbiased variances, exactly what the fused weights produce on that data.
  Labels are not used.
* ``"client"``: predictors that keep the client models whole (the uniform ensemble, AMS)
  keep each client's own statistics, which belong to its own weights.

``"auto"`` (the default) is ``"client"`` for those predictors, else the strategy's measured
default (``default_norm_stats``; see docs/library/models.md) when a validation
set is given, else ``"average"``. Models without running statistics (LayerNorm, GroupNorm,
``track_running_stats=False``) are unaffected by the choice.
"""

from __future__ import annotations

import torch
from torch import nn

NORM_STATS = ("auto", "average", "recalibrate", "client")


def running_stat_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The normalisation layers of ``model`` that keep running statistics."""
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def has_running_stats(model: nn.Module) -> bool:
    return bool(running_stat_layers(model))


@torch.no_grad()
def recalibrate(model: nn.Module, x: torch.Tensor, batch_size: int = 256) -> int:
    """Re-estimate the running statistics of ``model``'s BatchNorm layers on the inputs ``x``
    (see the module docstring); returns how many layers were updated. Parameters are not
    touched; the model's train/eval modes and momenta are restored."""
    layers = running_stat_layers(model)
    if not layers or len(x) < 2:  # one row has no spread to estimate (BatchNorm1d refuses it)
        return 0
    modes = {m: m.training for m in model.modules()}
    momenta = [layer.momentum for layer in layers]
    device = next(iter(model.parameters()), layers[0].running_mean).device
    try:
        model.eval()
        for layer in layers:
            layer.reset_running_stats()
            layer.momentum = None  # cumulative moving average over the batches
            layer.train()
        # equal-sized batches (never one of a single row, which BatchNorm1d refuses)
        for batch in torch.tensor_split(x, -(-len(x) // batch_size)):
            model(batch.to(device))
    finally:
        for layer, momentum in zip(layers, momenta, strict=True):
            layer.momentum = momentum
        for module, training in modes.items():
            module.train(training)
    return len(layers)
