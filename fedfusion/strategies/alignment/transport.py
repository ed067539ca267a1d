"""Optimal transport between two models' neurons, group by group of a
:class:`~fedfusion.strategies.alignment.graph.Structure`.

Per permutation group the cost between the reference's channel i and the model's channel j
is the distance of their incoming weights (:func:`weight_cost`) or of their activations on
validation inputs (:func:`activation_cost`); with uniform masses on equal widths the exact
OT plan is a permutation (:func:`transport_map`), and :func:`align` applies it on the output
side of the group's producers and channel-wise parameters and on the input side of the
layers it feeds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from fedfusion.sections.gram import forward_with_hooks
from fedfusion.strategies.alignment.graph import Structure

StateDict = dict[str, np.ndarray]
#: weight and bias (or None) of a layer, float64, input dimension already aligned
LayerWeights = tuple[torch.Tensor, torch.Tensor | None]
#: cost(group index, {producer module: its weights}) -> [channels_A, channels_B]
CostFn = Callable[[int, Mapping[str, LayerWeights]], torch.Tensor]


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
    """W <- T W along dim 0, block-wise: the tensor is read as [n, -1], so a channel-wise
    vector over flattened [C, H, W] features moves in blocks of H * W."""
    return (t @ tensor.reshape(t.shape[1], -1)).reshape(tensor.shape)


def _to64(state: Mapping[str, np.ndarray], key: str, device: torch.device | str
          ) -> torch.Tensor:
    return torch.from_numpy(np.asarray(state[key])).to(device, torch.float64)


def align(model: Mapping[str, np.ndarray], structure: Structure, cost: CostFn,
          device: torch.device | str = "cpu") -> tuple[StateDict, list[torch.Tensor]]:
    """Align ``model`` group by group (``cost`` compares to the reference); returns the
    aligned state dict (input dtypes; keys outside ``structure.keys`` as given) and the map
    T_g of every group."""
    tensors = {key: _to64(model, key, device) for key in structure.keys}
    maps: list[torch.Tensor] = []
    for group in range(structure.num_groups):
        ready = {layer.module: (tensors[layer.weight],
                                tensors[layer.bias] if layer.bias else None)
                 for layer in structure.producers(group)
                 if layer.input is None or layer.input < group}
        t = transport_map(cost(group, ready))
        maps.append(t)
        for key in structure.permuted_keys(group):
            tensors[key] = map_outputs(tensors[key], t)
        for layer in structure.consumers(group):
            tensors[layer.weight] = map_inputs(tensors[layer.weight], t, layer.block)
    aligned = dict(model)
    for key, tensor in tensors.items():
        aligned[key] = tensor.cpu().numpy().astype(model[key].dtype)
    return aligned, maps


def _rows(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    rows = w.reshape(w.shape[0], -1)
    return torch.cat([rows, b[:, None]], dim=1) if b is not None else rows


def _concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Features side by side (dim 1); one part as is, so a chain's costs are unchanged."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=1)


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def weight_cost(reference: Mapping[str, np.ndarray], structure: Structure,
                device: torch.device | str = "cpu") -> CostFn:
    """Distance between the reference's and the (input-aligned) model's incoming weights,
    concatenated over the producers the cost is given."""
    layers = {layer.module: layer for layer in structure.layers}

    def cost(group: int, producers: Mapping[str, LayerWeights]) -> torch.Tensor:
        ours, theirs = [], []
        for module, (w, b) in producers.items():
            layer = layers[module]
            ours.append(_rows(_to64(reference, layer.weight, device),
                              _to64(reference, layer.bias, device) if layer.bias else None))
            theirs.append(_rows(w, b))
        return _distance(_concat(ours), _concat(theirs))
    return cost


@torch.no_grad()
def layer_activations(model: nn.Module, x: torch.Tensor, structure: Structure,
                      batch_size: int = 500) -> list[torch.Tensor]:
    """Per group, its producers' pre-activation outputs ``[channels, samples * positions]``
    (float64) of ``model`` on ``x``, concatenated over the producers."""
    modules = dict(model.named_modules())
    producers = [layer for layer in structure.layers if layer.output is not None]
    outputs: dict[str, list[torch.Tensor]] = {layer.module: [] for layer in producers}
    hooks = {}
    for layer in producers:
        channel = 1 if isinstance(modules[layer.module], nn.Conv2d) else -1

        def hook(module: nn.Module, args: Any, out: torch.Tensor, key: str = layer.module,
                 dim: int = channel) -> None:
            outputs[key].append(out.movedim(dim, 0).reshape(out.shape[dim], -1).double())
        hooks[modules[layer.module]] = hook
    forward_with_hooks(model, x, hooks, batch_size)
    return [_concat([torch.cat(outputs[layer.module], dim=1)
                     for layer in structure.producers(g)])
            for g in range(structure.num_groups)]


def activation_cost(reference_acts: Sequence[torch.Tensor], model_acts: Sequence[torch.Tensor]
                    ) -> CostFn:
    """Distance between the channels' activations of the reference and of the model (the
    model's own, unaligned indices: input re-indexing does not change a layer's outputs)."""
    def cost(group: int, producers: Mapping[str, LayerWeights]) -> torch.Tensor:
        return _distance(reference_acts[group], model_acts[group])
    return cost
