"""OTFusion (Singh & Jaggi, NeurIPS 2020): align the clients' neurons, then average.

Hidden neurons of a network can be permuted without changing its function, so clients
trained apart may hold the "same" neuron at different indices and a plain average mixes
unrelated units. OTFusion aligns every client model to a reference model, layer by layer,
with optimal transport between the two layers' neurons, and then averages the aligned
models: here w = sum_c n_c w~_c / sum_c n_c, with n_c the client's number of examples.

Per hidden layer l (never the output layer) of client model B against the reference A:

1. Input side: B's layer-l weights are first re-indexed along their INPUT dimension by the
   map T_{l-1} of the previous layer, W_B <- W_B T_{l-1}^T (after a conv -> linear flatten the
   fc inputs come in channel-major blocks of the spatial size, so T_{l-1} acts block-wise,
   i.e. as T_{l-1} (x) I_spatial); a bias is left as is.
2. Cost between A's neuron i and B's neuron j:

   * ``weights`` (default): ||[w_A,i | b_A,i] - [w_B,j | b_B,j]||_2, the Euclidean distance of
     the incoming weight vectors (conv: the flattened [c, kh, kw] filter), bias appended;
   * ``activations`` (``otfusion_mode = "activations"`` and a server validation set): the
     Euclidean distance of the neurons' pre-activation outputs on (at most
     :data:`ACTIVATION_SAMPLES`) validation inputs, over samples and spatial positions.
3. Exact OT with uniform neuron masses 1/n on both sides. The transportation polytope with
   equal uniform marginals is (1/n times) the Birkhoff polytope, whose vertices are the
   permutation matrices, so an optimal plan is a permutation and the linear assignment
   problem solves the OT problem exactly: :func:`scipy.optimize.linear_sum_assignment`
   (O(n^3), no new dependency; POT's ``ot.emd`` would return the same plan up to ties).
4. Output side: with the barycentric map T_l = n * plan (rows sum to 1; a permutation matrix
   here), W_B <- T_l W_B and b_B <- T_l b_B, and T_l is passed on to layer l+1.

The maps are applied as matrices (any row-stochastic ``T``, so a non-permutation plan would
also work for equal widths); with a permutation matrix in float64 the result is a bit-exact
re-indexing, so a neuron-permuted copy of the reference fuses back to it exactly.

Assumptions: the model is a sequential chain of Linear/Conv2d layers in the order of its
``state_dict`` (every parameter is such a layer's ``weight`` or ``bias``), with
element-wise activations and per-channel pooling between them (LeNet, CNN, MLP of any
depth, ConvNet). The reference is the client with the most examples (lowest client id on
ties): the average is dominated by it anyway, and a large client is the least likely to be
a poorly trained anchor. The official code aligns to a chosen target model, typically the
last one; we also do not use its activation-normalisation or "geometric ensembling" extras.
Members (M > 1 per client) are fused index by index, as FedAvg does, into an ensemble.
With fedfusion's common server initialisation the weight-based alignment is often the
identity for every layer, and OTFusion then equals FedAvg exactly (see ``moved_neurons`` in
the report).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from fedfusion.architecture import ModelFn, ModelSpec
from fedfusion.gram import forward_with_hooks, gram_layers
from fedfusion.payload import ClientUpload
from fedfusion.predictors import Ensemble
from fedfusion.strategies.base import FusionStrategy
from fedfusion.strategies.fedavg import weighted_average

log = logging.getLogger("fedfusion")

MODES = ("weights", "activations")
#: validation inputs used for activation-based alignment
ACTIVATION_SAMPLES = 500

StateDict = dict[str, np.ndarray]
#: cost(layer index, aligned-input weight of B [out, ...], bias of B or None) -> [out_A, out_B]
CostFn = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class Layer:
    """One Linear/Conv2d layer of the chain; ``block`` input features per previous neuron."""

    weight: str
    bias: str | None
    shape: tuple[int, ...]
    block: int

    @property
    def width(self) -> int:
        return self.shape[0]


def layer_chain(param_shapes: Mapping[str, tuple[int, ...]]) -> list[Layer]:
    """The sequential chain of Linear (2-D) / Conv2d (4-D) layers, in ``state_dict`` order.

    Raises ValueError for a parameter that is neither a layer weight nor its bias, and for a
    layer whose input size does not follow from the previous layer's width.
    """
    weights = [n for n, s in param_shapes.items() if n.endswith("weight") and len(s) in (2, 4)]
    chain: list[Layer] = []
    for name in weights:
        shape = tuple(param_shapes[name])
        bias = name[: -len("weight")] + "bias"
        has_bias = bias in param_shapes
        if has_bias and tuple(param_shapes[bias]) != shape[:1]:
            raise ValueError(f"otfusion: bias {bias!r} has shape {param_shapes[bias]}, "
                             f"expected {shape[:1]}")
        block = 1
        if chain:
            prev = chain[-1]
            conv_to_linear = len(prev.shape) == 4 and len(shape) == 2
            if len(prev.shape) == 2 and len(shape) == 4:
                raise ValueError(f"otfusion: conv layer {name!r} after a linear layer")
            if conv_to_linear and shape[1] % prev.width == 0:
                block = shape[1] // prev.width
            elif shape[1] != prev.width:
                raise ValueError(f"otfusion: {name!r} takes {shape[1]} inputs, but the previous "
                                 f"layer {prev.weight!r} has {prev.width} neurons")
        chain.append(Layer(name, bias if has_bias else None, shape, block))
    covered = {n for layer in chain for n in (layer.weight, layer.bias) if n}
    stray = sorted(set(param_shapes) - covered)
    if stray:
        raise ValueError(f"otfusion: parameter(s) {stray} are not Linear/Conv2d weights or "
                         "biases; only sequential Linear/Conv2d chains are supported")
    if not chain:
        raise ValueError("otfusion: the model has no Linear/Conv2d layer")
    return chain


def transport_map(cost: torch.Tensor) -> torch.Tensor:
    """Barycentric map n * P of the exact OT plan P between two layers of n neurons each with
    uniform masses 1/n: a permutation matrix (see the module docstring); ``[n_A, n_B]``."""
    if cost.shape[0] != cost.shape[1]:
        raise ValueError(f"otfusion: layers of different widths {tuple(cost.shape)}")
    rows, cols = linear_sum_assignment(cost.detach().cpu().numpy())
    plan = torch.zeros_like(cost)
    index = torch.as_tensor(np.stack([rows, cols]), device=cost.device)
    plan[index[0], index[1]] = 1.0
    return plan


def map_inputs(weight: torch.Tensor, t_prev: torch.Tensor, block: int) -> torch.Tensor:
    """W <- W (T (x) I_block)^T along the input dimension (dim 1) of a [out, in, ...] weight."""
    out, n_in = weight.shape[:2]
    grouped = weight.reshape(out, n_in // block, block, *weight.shape[2:])
    return torch.einsum("ij,ojb...->oib...", t_prev, grouped).reshape(weight.shape)


def map_outputs(tensor: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """W <- T W along the output dimension (dim 0)."""
    return (t @ tensor.reshape(tensor.shape[0], -1)).reshape(tensor.shape)


def align(model: Mapping[str, np.ndarray], chain: Sequence[Layer], cost: CostFn,
          device: torch.device | str = "cpu") -> tuple[StateDict, list[torch.Tensor]]:
    """Align ``model`` layer by layer (``cost`` compares to the reference); returns the
    aligned state dict (input dtypes) and the map T_l of every hidden layer."""
    aligned = dict(model)
    maps: list[torch.Tensor] = []
    t_prev: torch.Tensor | None = None
    for index, layer in enumerate(chain):
        w = torch.from_numpy(np.asarray(model[layer.weight])).to(device, torch.float64)
        b = (torch.from_numpy(np.asarray(model[layer.bias])).to(device, torch.float64)
             if layer.bias else None)
        if t_prev is not None:
            w = map_inputs(w, t_prev, layer.block)
        if index < len(chain) - 1:  # never permute the output layer
            t_prev = transport_map(cost(index, w, b))
            maps.append(t_prev)
            w = map_outputs(w, t_prev)
            b = map_outputs(b, t_prev) if b is not None else None
        aligned[layer.weight] = w.cpu().numpy().astype(model[layer.weight].dtype)
        if layer.bias and b is not None:
            aligned[layer.bias] = b.cpu().numpy().astype(model[layer.bias].dtype)
    return aligned, maps


def _rows(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    rows = w.reshape(w.shape[0], -1)
    return torch.cat([rows, b[:, None]], dim=1) if b is not None else rows


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def weight_cost(reference: Mapping[str, np.ndarray], chain: Sequence[Layer],
                device: torch.device | str = "cpu") -> CostFn:
    """Distance between the reference's and the (input-aligned) model's incoming weights."""
    def cost(index: int, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        layer = chain[index]
        ref_w = torch.from_numpy(np.asarray(reference[layer.weight])).to(device, torch.float64)
        ref_b = (torch.from_numpy(np.asarray(reference[layer.bias])).to(device, torch.float64)
                 if layer.bias else None)
        return _distance(_rows(ref_w, ref_b), _rows(w, b))
    return cost


@torch.no_grad()
def layer_activations(model: nn.Module, x: torch.Tensor, chain: Sequence[Layer],
                      batch_size: int = 500) -> list[torch.Tensor]:
    """Per layer of the chain, the pre-activation outputs ``[neurons, samples * positions]``
    (float64) of ``model`` on ``x``."""
    modules = gram_layers(model)
    outputs: dict[str, list[torch.Tensor]] = {layer.weight: [] for layer in chain}
    hooks = {}
    for layer in chain:
        def hook(module: nn.Module, args: Any, out: torch.Tensor, key: str = layer.weight
                 ) -> None:
            outputs[key].append(out.transpose(0, 1).reshape(out.shape[1], -1).double())
        hooks[modules[layer.weight]] = hook
    forward_with_hooks(model, x, hooks, batch_size)
    return [torch.cat(outputs[layer.weight], dim=1) for layer in chain]


def activation_cost(reference_acts: Sequence[torch.Tensor], model_acts: Sequence[torch.Tensor]
                    ) -> CostFn:
    """Distance between the neurons' activations of the reference and of the model (the
    model's own, unaligned indices: input re-indexing does not change a layer's outputs)."""
    def cost(index: int, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return _distance(reference_acts[index], model_acts[index])
    return cost


class OTFusion(FusionStrategy):
    """Align every client's neurons to the reference client by exact OT, then average.

    Parameters
    ----------
    mode : {"weights", "activations"}, default "weights"
        Align neurons by their weights, or by their activations on the validation inputs.
    """

    name = "otfusion"

    config_keys = {"mode": "otfusion-mode"}

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 mode: str = "weights", **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        if mode not in MODES:
            raise ValueError(f"otfusion-mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._report: dict[str, Any] = {}


    @property
    def effective_mode(self) -> str:
        """``activations`` only where the server has validation inputs."""
        has_val = self.context.val is not None and len(self.context.val) > 0
        return "activations" if self.mode == "activations" and has_val else "weights"

    @staticmethod
    def reference_of(uploads: Sequence[ClientUpload]) -> ClientUpload:
        """The client with the most examples, the lowest client id on ties."""
        return min(uploads, key=lambda u: (-u.num_examples, u.client_id))

    def fuse_member(self, uploads: Sequence[ClientUpload], member: int
                    ) -> tuple[StateDict, dict[str, Any]]:
        """Align member ``member`` of every client holding it to the reference's, average."""
        spec = self.context.model_spec
        chain = layer_chain(self.context.param_shapes(spec.name, spec.kwargs))
        device = self.context.device
        holders = [u for u in uploads if u.num_members > member]
        reference = self.reference_of(holders)
        ref_weights = reference.weights(member)
        by_activations = self.effective_mode == "activations"
        if by_activations:
            ref_acts = self.activations(ref_weights, chain)
        aligned, moved = [], {}
        for upload in holders:
            if upload is reference:
                aligned.append(ref_weights)
                continue
            weights = upload.weights(member)
            cost = (activation_cost(ref_acts, self.activations(weights, chain))
                    if by_activations else weight_cost(ref_weights, chain, device))
            weights, maps = align(weights, chain, cost, device)
            aligned.append(weights)
            moved[str(upload.client_id)] = [
                int((t != torch.eye(len(t), dtype=t.dtype, device=t.device)).any(1).sum())
                for t in maps]
        fused = weighted_average(aligned, [u.num_examples for u in holders])
        return fused, {"reference_client": reference.client_id, "moved_neurons": moved}

    def activations(self, weights: Mapping[str, np.ndarray], chain: Sequence[Layer]
                    ) -> list[torch.Tensor]:
        """The chain's activations of the model ``weights`` on the validation inputs."""
        assert self.context.val is not None
        model = self.context.model_spec.build(weights).to(self.context.device)
        return layer_activations(model, self.context.val.x[:ACTIVATION_SAMPLES], chain)

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
                        "hidden_layers": max(0, len(layer_chain(
                            self.context.param_shapes(spec.name, spec.kwargs))) - 1)}
        return Ensemble([spec.build(s) for s in states], [spec] * num_members)

    def report(self) -> dict[str, Any]:
        return dict(self._report)

