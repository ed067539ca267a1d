"""Uniform ensemble: p(y|x) = 1/N sum_{c,m} softmax(f_{c,m}(x)) over every uploaded member
of every client, each with the same weight; or, with ``size`` = K, over the K members that
greedy ensemble selection picks on the server's validation set
(:mod:`fedfusion.core.selection`). Architectures may differ between clients."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from fedfusion.constraints import Constraint
from fedfusion.core.predictors import Ensemble
from fedfusion.core.selection import select_networks
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.wire import ClientUpload

#: the rule of ``size``, which the App's key for it shares
SIZE = Constraint(">= 0 (0 = every member)", lambda v: v >= 0)

log = logging.getLogger("fedfusion")


class UniformEnsemble(FusionStrategy):
    """Average of the client members' softmax outputs.

    Parameters
    ----------
    size : int, default 0
        K, the members the prediction runs (0 = every member). With a validation set, the K
        that greedy ensemble selection picks on it; without one, the first K in the order
        member 0 of every client, then member 1, and so on.
    """

    name = "ensemble"
    same_architecture = False
    member_fusions = ("all", "first")
    keeps_client_models = True
    #: each member keeps its own client's BatchNorm statistics, which belong to its weights
    default_norm_stats = "client"

    def __init__(self, model_fn: Any, *, size: int = 0, **kwargs: Any) -> None:
        super().__init__(model_fn, **kwargs)
        SIZE.check("size", size)
        self.size = size
        #: how the last fusion chose its members: "all", "validation" or "order"
        self.selection = "all"

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        models, specs, member_index = [], [], []
        for upload in uploads:
            member_index += range(upload.num_members)
            models += self.context.member_models(upload)
            specs += [self.context.spec_for(upload)] * upload.num_members
        keep = list(range(len(models)))
        self.selection = "all"
        if self.size and self.size < len(models):
            val = self.context.val
            if val is not None and len(val):
                keep = select_networks(models, val, self.size, self.context.device)
                self.selection = "validation"
            else:  # member 0 of every client first, then member 1, ...
                keep = sorted(keep, key=lambda i: member_index[i])[: self.size]
                self.selection = "order"
            log.info("[ensemble] %d of %d members kept (%s)", self.size, len(models),
                     self.selection)
        return Ensemble([models[i] for i in keep], [specs[i] for i in keep])

    def report(self) -> dict[str, Any]:
        return {"size": self.size, "selection": self.selection}
