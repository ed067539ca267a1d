"""OTFusion (Singh & Jaggi, NeurIPS 2020): align the clients' neurons, then average.

Hidden neurons of a network can be permuted without changing its function, so clients
trained apart may hold the "same" neuron at different indices and a plain average mixes
unrelated units. OTFusion aligns every client model to a reference model, layer by layer,
with optimal transport between the two layers' neurons, and then averages the aligned
models: here w = sum_c n_c w~_c / sum_c n_c, with n_c the client's number of examples.
Integer buffers (BatchNorm's ``num_batches_tracked``) are neither permuted nor averaged: the
fused model takes the reference's.

**Which channels move together** is read off the module graph, traced with
:func:`torch.fx.symbolic_trace` (:func:`alignment_structure`), never off parameter names.
Every Linear/Conv2d opens a *permutation group*: its output channels (weight rows, bias).
A group is carried through what acts on each channel alone, and re-indexing it there is
exact because every such op f commutes with a channel permutation T, f(T x) = T f_T(x),
where f_T has its per-channel parameters permuted by T:

* element-wise activations, dropout, per-channel pooling (max/avg/adaptive, global mean over
  the spatial dims): no parameters, f_T = f;
* BatchNorm1d/2d, y_c = gamma_c (x_c - mu_c) / sqrt(var_c + eps) + beta_c per channel c:
  gamma, beta, running mean mu and running variance var are permuted with the channel
  (a Linear's channels are its output's last dimension, so BatchNorm1d after a Linear is
  taken to see [batch, features]; its ``num_features`` must match the Linear's width);
* LayerNorm over the features of a Linear output (or over [C, H, W] of a conv output): the
  mean and variance over all features are permutation invariant, so only its gamma, beta are
  permuted (row-wise by their leading channel dimension);
* flatten after a conv: the [C, H, W] features come in channel-major blocks of H * W, so T
  acts as T (x) I_block on them (and on a BatchNorm1d/LayerNorm over them);
* residual connections: T_x x + T_y y = T (x + y) only if T_x = T_y = T, so the groups of
  the two summands of an addition (``+``, ``torch.add``, ``x += y``; also ``-``, ``*``) are
  merged into one (union-find). An identity shortcut ties a block's output to its input's
  group, so a ResNet stage is one group: the stem conv and every block's last conv (and a
  1x1 projection shortcut) all get the same permutation.

A group is never permuted when its channels reach the model's output (the output layer, as
in the paper) or come from the model's input (a residual block on the raw input). Anything
else that touches a permutable group is refused with a ValueError naming the
first module or operation it cannot align and suggesting FedAvg or the ensemble: grouped
convolutions, modules with parameters of unknown role (custom layers, GroupNorm, Conv1d, a
parameter used directly in ``forward``), modules called twice (shared weights), ops that mix
channels (cat, slicing, softmax, matmul, views other than flattening; attention) and models
``torch.fx`` cannot trace (data-dependent control flow). Correct refusal beats a wrong
alignment, and it comes before anything trains: the strategy's constructor, and each client
before its training, trace the model (:mod:`fedfusion.core.model_check`, requirement
``"alignable"``).

Per permutation group g, in the graph order of its first producer (layer by layer for a
sequential chain), of client model B against the reference A:

1. Input side: every layer's weights are re-indexed along their INPUT dimension by the map
   T_h of the group h feeding them as soon as h is aligned, W_B <- W_B (T_h (x) I_block)^T
   (I_block: the spatial size after a conv -> linear flatten, else 1); a bias is left as is.
2. Cost between A's channel i and B's channel j:

   * ``weights`` (default): ||[w_A,p,i | b_A,p,i]_p - [w_B,p,j | b_B,p,j]_p||_2, the Euclidean
     distance of the incoming weight vectors (conv: the flattened [c, kh, kw] filter), bias
     appended, concatenated over the group's producers p, i.e. sqrt(sum_p d_p(i, j)^2). A
     producer whose input group is aligned only after g (through a residual cycle: a block's
     last conv reads the block's own intermediate group, which reads g) is left out, as its
     rows are not yet in the reference's input indices; the group's first producer in the
     graph always takes part (its input was produced, and aligned, before it).
   * ``activations`` (``otfusion_mode = "activations"`` and a server validation set): the
     Euclidean distance of the channels' pre-activation outputs on (at most
     :data:`ACTIVATION_SAMPLES`) validation inputs, over samples and spatial positions,
     concatenated over all the group's producers.
3. Exact OT with uniform neuron masses 1/n on both sides. The transportation polytope with
   equal uniform marginals is (1/n times) the Birkhoff polytope, whose vertices are the
   permutation matrices, so an optimal plan is a permutation and the linear assignment
   problem solves the OT problem exactly: :func:`scipy.optimize.linear_sum_assignment`
   (O(n^3), no new dependency; POT's ``ot.emd`` would return the same plan up to ties).
4. Output side: with the barycentric map T_g = n * plan (rows sum to 1; a permutation matrix
   here), W_B <- T_g W_B and b_B <- T_g b_B for every producer, theta_B <- T_g theta_B
   (block-wise) for every channel-wise parameter of g (BatchNorm/LayerNorm above), and T_g is
   applied on the input side of every layer g feeds (step 1).

The maps are applied as matrices (any row-stochastic ``T``, so a non-permutation plan would
also work for equal widths); with a permutation matrix in float64 the result is a bit-exact
re-indexing, so a neuron-permuted copy of the reference fuses back to it exactly. For a
sequential Linear/Conv2d chain every group is one layer and the steps are the paper's.

The reference is the client with the most examples (lowest client id on ties): the average
is dominated by it anyway, and a large client is the least likely to be a poorly trained
anchor. The official code aligns to a chosen target model, typically the last one; we also
do not use its activation-normalisation or "geometric ensembling" extras. Members (M > 1 per
client) are fused index by index, as FedAvg does, into an ensemble. With fedfusion's common
server initialisation the weight-based alignment is often the identity for every group, and
OTFusion then equals FedAvg exactly (see ``moved_neurons`` in the report).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.predictors import Ensemble
from fedfusion.core.state import weighted_average
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.strategies.alignment.graph import Structure, alignment_problem, structure_of
from fedfusion.strategies.alignment.transport import (
    StateDict,
    activation_cost,
    align,
    layer_activations,
    weight_cost,
)
from fedfusion.wire import ClientUpload

log = logging.getLogger("fedfusion")

MODES = ("weights", "activations")
#: validation inputs used for activation-based alignment
ACTIVATION_SAMPLES = 500


class OTFusion(FusionStrategy):
    """Align every client's neurons to the reference client by exact OT, then average.

    The permutation groups come from the traced module graph (BatchNorm, LayerNorm and
    residual connections included); a model with anything else is refused before anything
    trains (:mod:`fedfusion.core.model_check`).

    Parameters
    ----------
    mode : {"weights", "activations"}, default "weights"
        Align neurons by their weights, or by their activations on the validation inputs.
    """

    name = "otfusion"
    model_requirements = ("alignable",)
    requirement_checks = {"alignable": lambda model, name, x, first, strategy:
                          alignment_problem(model)}

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 mode: str = "weights", **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._report: dict[str, Any] = {}
        self._structures: dict[ModelSpec, Structure] = {}

    @property
    def effective_mode(self) -> str:
        """``activations`` only where the server has validation inputs."""
        has_val = self.context.val is not None and len(self.context.val) > 0
        return "activations" if self.mode == "activations" and has_val else "weights"

    @property
    def structure(self) -> Structure:
        """The permutation groups of the server's architecture (traced once)."""
        spec = self.context.model_spec
        if spec not in self._structures:
            self._structures[spec] = structure_of(spec)
        return self._structures[spec]

    @staticmethod
    def reference_of(uploads: Sequence[ClientUpload]) -> ClientUpload:
        """The client with the most examples, the lowest client id on ties."""
        return min(uploads, key=lambda u: (-u.num_examples, u.client_id))

    def fuse_member(self, uploads: Sequence[ClientUpload], member: int
                    ) -> tuple[StateDict, dict[str, Any]]:
        """Align member ``member`` of every client holding it to the reference's, average;
        integer buffers are the reference's."""
        structure = self.structure
        device = self.context.device
        holders = [u for u in uploads if u.num_members > member]
        reference = self.reference_of(holders)
        ref_weights = reference.weights(member)
        by_activations = self.effective_mode == "activations"
        if by_activations:
            ref_acts = self.activations(ref_weights, structure)
        aligned, moved = [], {}
        for upload in holders:
            if upload is reference:
                aligned.append(ref_weights)
                continue
            weights = upload.weights(member)
            cost = (activation_cost(ref_acts, self.activations(weights, structure))
                    if by_activations else weight_cost(ref_weights, structure, device))
            weights, maps = align(weights, structure, cost, device)
            aligned.append(weights)
            moved[str(upload.client_id)] = [
                int((t != torch.eye(len(t), dtype=t.dtype, device=t.device)).any(1).sum())
                for t in maps]
        fused = weighted_average(aligned, [u.num_examples for u in holders])
        fused.update({key: np.array(value, copy=True) for key, value in ref_weights.items()
                      if not np.issubdtype(np.asarray(value).dtype, np.floating)})
        return fused, {"reference_client": reference.client_id, "moved_neurons": moved}

    def activations(self, weights: Mapping[str, np.ndarray], structure: Structure
                    ) -> list[torch.Tensor]:
        """The groups' activations of the model ``weights`` on the validation inputs."""
        assert self.context.val is not None
        model = self.context.model_spec.build(weights).to(self.context.device)
        return layer_activations(model, self.context.val.x[:ACTIVATION_SAMPLES], structure)

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        spec = self.context.model_spec
        num_members = max(u.num_members for u in uploads)
        states, reports = [], []
        for m in range(num_members):
            state, info = self.fuse_member(uploads, m)
            states.append(state)
            reports.append(info)
        if self.mode != self.effective_mode:
            log.warning("[otfusion] no server validation set: weight-based alignment")
        self._report = {"mode": self.effective_mode, "members": reports,
                        "hidden_layers": self.structure.num_groups,
                        "groups": self.structure.describe()}
        return Ensemble([spec.build(s) for s in states], [spec] * num_members)

    def report(self) -> dict[str, Any]:
        return dict(self._report)
