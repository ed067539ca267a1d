"""Uniform ensemble: p(y|x) = 1/N sum_{c,m} softmax(f_{c,m}(x)) over every uploaded member
of every client, each with the same weight. Architectures may differ between clients."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fedfusion.core.predictors import Ensemble
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.wire import ClientUpload


class UniformEnsemble(FusionStrategy):
    """Average of all client members' softmax outputs.

    Parameters
    ----------
    """

    name = "ensemble"
    same_architecture = False
    member_fusions = ("all", "first")
    keeps_client_models = True
    #: each member keeps its own client's BatchNorm statistics, which belong to its weights
    default_norm_stats = "client"

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        models, specs = [], []
        for upload in uploads:
            models += self.context.member_models(upload)
            specs += [self.context.spec_for(upload)] * upload.num_members
        return Ensemble(models, specs)
