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
before its training, trace the model (:mod:`fedfusion.model_check`, requirement
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
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import fx, nn

from fedfusion.architecture import ModelFn, ModelSpec
from fedfusion.predictors import Ensemble
from fedfusion.sections.gram import forward_with_hooks
from fedfusion.state import weighted_average
from fedfusion.strategies.base import FusionStrategy
from fedfusion.wire import ClientUpload

log = logging.getLogger("fedfusion")

MODES = ("weights", "activations")
#: validation inputs used for activation-based alignment
ACTIVATION_SAMPLES = 500
#: what a refusal suggests instead
ALTERNATIVE = "fuse this model with FedAvg (strategy 'fedavg') or the ensemble ('ensemble')"

StateDict = dict[str, np.ndarray]
#: weight and bias (or None) of a layer, float64, input dimension already aligned
LayerWeights = tuple[torch.Tensor, torch.Tensor | None]
#: cost(group index, {producer module: its weights}) -> [channels_A, channels_B]
CostFn = Callable[[int, Mapping[str, LayerWeights]], torch.Tensor]


# ---------------------------------------------------------------- the sequential chain (PFNM)
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
    """The sequential chain of Linear (2-D) / Conv2d (4-D) layers, in ``state_dict`` order
    (PFNM's model; OTFusion reads the traced graph instead, :func:`alignment_structure`).

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


# ------------------------------------------------------------ the structure of the module graph
@dataclass(frozen=True)
class AlignedLayer:
    """A Linear/Conv2d module of the traced graph and the permutation groups it touches."""

    module: str
    weight: str
    bias: str | None
    #: group of its output channels (weight rows, bias); None: never permuted
    output: int | None
    #: group of its input channels (weight dim 1); None: not permuted
    input: int | None
    #: input features per input channel: the spatial size after a conv -> linear flatten
    block: int


@dataclass(frozen=True)
class Structure:
    """What :func:`align` permutes: the layers, and the channel-wise parameters of each group
    (``(state key, group)``, permuted along dim 0, block-wise). Groups are numbered in the
    graph order of their first producer, the order they are aligned in."""

    layers: tuple[AlignedLayer, ...]
    channelwise: tuple[tuple[str, int], ...]
    num_groups: int

    def producers(self, group: int) -> list[AlignedLayer]:
        return [layer for layer in self.layers if layer.output == group]

    def consumers(self, group: int) -> list[AlignedLayer]:
        return [layer for layer in self.layers if layer.input == group]

    def permuted_keys(self, group: int) -> list[str]:
        """State keys re-indexed along dim 0 by the group's map: producer rows and biases,
        channel-wise parameters."""
        rows = [key for layer in self.producers(group) for key in (layer.weight, layer.bias)
                if key]
        return rows + [key for key, g in self.channelwise if g == group]

    @property
    def keys(self) -> list[str]:
        """Every state key :func:`align` may rewrite."""
        layer_keys = [key for layer in self.layers for key in (layer.weight, layer.bias) if key]
        return layer_keys + [key for key, _ in self.channelwise]

    def describe(self) -> list[list[str]]:
        """The producer modules of every group, in alignment order."""
        return [[layer.module for layer in self.producers(g)] for g in range(self.num_groups)]


#: channel dimension: 1 of [N, C, H, W] ("conv"), the last ("linear"), or channel-major
#: blocks of a flattened conv output ("flat")
Layout = Literal["conv", "linear", "flat"]


@dataclass(frozen=True)
class Channels:
    """A tensor whose channel dimension carries permutation group ``group``; ``layout`` None
    for a model input (whose group is never permuted)."""

    group: int
    layout: Layout | None


@dataclass(frozen=True)
class Opaque:
    """A tensor of unknown channel layout, computed from the groups ``depends``."""

    depends: frozenset[int]


#: what the analysis knows of a graph value; None: not a tensor (a size, a number)
Tag = Channels | Opaque | None

ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
                       nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish,
                       nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Identity, nn.Dropout,
                       nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout)
POOL_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
ELEMENTWISE_FUNCTIONS = frozenset({
    torch.relu, F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish,
    F.hardtanh, F.hardswish, F.hardsigmoid, F.softplus, F.softsign, torch.sigmoid, F.sigmoid,
    torch.tanh, F.tanh, F.dropout, F.dropout1d, F.dropout2d, F.alpha_dropout, torch.abs,
    torch.neg, operator.neg, operator.pos})
ELEMENTWISE_METHODS = frozenset({"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_",
                                 "abs", "neg", "contiguous", "clone", "detach", "float"})
POOL_FUNCTIONS = frozenset({F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d,
                            F.adaptive_max_pool2d})
BINARY_FUNCTIONS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                              operator.iadd, operator.isub, operator.imul, operator.itruediv,
                              torch.add, torch.sub, torch.mul, torch.div})
BINARY_METHODS = frozenset({"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"})
#: methods / attributes whose result is a size, not a tensor
SIZE_METHODS = frozenset({"size", "dim", "numel"})
SIZE_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device"})


@dataclass(frozen=True)
class _Problem:
    """Something OTFusion cannot align; fatal when ``groups`` is None or one of them is
    permuted (a group that is never permuted may pass through anything)."""

    where: str
    reason: str
    groups: frozenset[int] | None


def _argument(node: fx.Node, position: int, name: str, default: Any) -> Any:
    """Argument ``name`` of a call, given by position or keyword."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _is_batch_size(value: Any) -> bool:
    """``x.size(0)`` or ``x.shape[0]``: the batch size of some tensor."""
    if not isinstance(value, fx.Node):
        return False
    if value.op == "call_method" and value.target == "size":
        return _argument(value, 1, "dim", None) == 0
    if value.op == "call_function" and value.target is operator.getitem:
        source, index = value.args
        return index == 0 and isinstance(source, fx.Node) and (
            (source.op == "call_function" and source.target is getattr
             and source.args[1] == "shape")
            or (source.op == "call_method" and source.target == "size" and len(source.args) == 1))
    return False


class _GraphAnalysis:
    """One pass over the traced graph in execution order: tags every value (:data:`Tag`),
    merges the groups of added tensors (union-find), records the layers, the channel-wise
    parameters and every problem; :meth:`structure` then refuses or numbers the groups."""

    def __init__(self, model: nn.Module, traced: fx.GraphModule) -> None:
        self.model = model
        self.traced = traced  # holds the attributes ``get_attr`` reads (constants included)
        self.modules = dict(model.named_modules())
        self.parent: list[int] = []
        self.width: list[int | None] = []
        self.fixed: list[bool] = []
        self.tags: dict[fx.Node, Tag] = {}
        self.problems: list[_Problem] = []
        #: (module name, module, input tag, output group), in graph order
        self.layers: list[tuple[str, nn.Linear | nn.Conv2d, Tag, int]] = []
        self.channelwise: list[tuple[str, int]] = []
        self.called: set[str] = set()

    # -------------------------------------------------------------------- groups
    def new_group(self, width: int | None, fixed: bool) -> int:
        self.parent.append(len(self.parent))
        self.width.append(width)
        self.fixed.append(fixed)
        return len(self.parent) - 1

    def find(self, group: int) -> int:
        while self.parent[group] != group:
            self.parent[group] = self.parent[self.parent[group]]
            group = self.parent[group]
        return group

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a
            self.fixed[a] = self.fixed[a] or self.fixed[b]
            self.width[a] = self.width[a] if self.width[a] is not None else self.width[b]

    def width_of(self, group: int) -> int | None:
        return self.width[self.find(group)]

    def permuted(self, group: int) -> bool:
        return not self.fixed[self.find(group)]

    # -------------------------------------------------------------------- tags
    def tag(self, value: Any) -> Tag:
        return self.tags.get(value) if isinstance(value, fx.Node) else None

    def depends(self, values: Iterable[Any]) -> frozenset[int]:
        """The groups the tensors among ``values`` (nested in tuples/lists/dicts) carry."""
        found: set[int] = set()

        def visit(node: fx.Node) -> fx.Node:
            tag = self.tags.get(node)
            if isinstance(tag, Channels):
                found.add(tag.group)
            elif isinstance(tag, Opaque):
                found.update(tag.depends)
            return node
        fx.node.map_arg(tuple(values), visit)
        return frozenset(found)

    def problem(self, where: str, reason: str, groups: Iterable[int] | None = None) -> None:
        self.problems.append(_Problem(where, reason,
                                      None if groups is None else frozenset(groups)))

    def unknown(self, where: str, node: fx.Node, reason: str) -> Tag:
        """An op the analysis cannot follow: fine on groups that are never permuted."""
        depends = self.depends([*node.args, *node.kwargs.values()])
        if depends:
            self.problem(where, reason, depends)
        return Opaque(depends)

    # -------------------------------------------------------------------- the pass
    def run(self, graph: fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "placeholder":
                self.tags[node] = Channels(self.new_group(None, fixed=True), None)
            elif node.op == "get_attr":
                self.tags[node] = self.attribute(node)
            elif node.op == "call_module":
                self.tags[node] = self.call_module(node)
            elif node.op in ("call_function", "call_method"):
                self.tags[node] = self.call_function(node)
            elif node.op == "output":
                for group in self.depends(node.args):
                    self.fixed[self.find(group)] = True

    def attribute(self, node: fx.Node) -> Tag:
        """A tensor attribute read in ``forward``: a parameter there is a custom layer."""
        target = str(node.target)
        owner = target.rpartition(".")[0]
        value: Any = self.traced
        for part in target.split("."):
            value = getattr(value, part)
        if isinstance(value, nn.Parameter):
            module = self.modules.get(owner, self.model)
            self.problem(f"module {owner!r} ({type(module).__name__})",
                         f"its forward uses the parameter {target!r} directly (a custom "
                         "layer: OTFusion does not know which channels it indexes)")
        return Opaque(frozenset())

    def call_module(self, node: fx.Node) -> Tag:
        name = str(node.target)
        module = self.modules[name]
        where = f"module {name!r} ({type(module).__name__})"
        x = self.tag(node.args[0] if node.args else next(iter(node.kwargs.values()), None))
        has_state = bool(module.state_dict())
        if has_state and name in self.called:
            self.problem(where, "it is called more than once (shared weights)")
        self.called.add(name)
        if x is None:
            return self.unknown(where, node, "it is not called on a tensor")
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            self.problem(where, f"a grouped convolution (groups={module.groups}) ties "
                         "channels to their group")
        if isinstance(module, nn.Linear | nn.Conv2d):
            return self.layer(where, name, module, x)
        if isinstance(module, nn.BatchNorm2d):
            return self.normalisation(where, name, module, x, {"conv": module.num_features})
        if isinstance(module, nn.BatchNorm1d):
            return self.normalisation(where, name, module, x, {"linear": module.num_features,
                                                               "flat": module.num_features})
        if isinstance(module, nn.LayerNorm):
            shape = tuple(module.normalized_shape)
            accepts: dict[Layout, int] = ({"linear": shape[0], "flat": shape[0]}
                                          if len(shape) == 1 else
                                          {"conv": shape[0]} if len(shape) == 3 else {})
            return self.normalisation(where, name, module, x, accepts)
        if isinstance(module, ELEMENTWISE_MODULES) or (isinstance(module, nn.PReLU)
                                                       and module.num_parameters == 1):
            return x
        if isinstance(module, POOL_MODULES) and not getattr(module, "return_indices", False):
            return self.pool(where, node, x)
        if isinstance(module, nn.Flatten):
            return self.flatten(where, node, x, module.start_dim, module.end_dim)
        if has_state:
            self.problem(where, "OTFusion does not know how to permute its parameters")
        return self.unknown(where, node, "OTFusion cannot follow the channels through it")

    def call_function(self, node: fx.Node) -> Tag:
        target = node.target
        method = node.op == "call_method"
        label = str(target) if method else getattr(target, "__name__", str(target))
        stack = node.meta.get("nn_module_stack")
        inside = ""
        source = _argument(node, 0, "input", None)
        if stack:
            path, cls = list(stack.values())[-1]
            inside = f" in module {path!r} ({getattr(cls, '__name__', cls)})"
        elif isinstance(source, fx.Node) and source.op == "call_module":
            # an op of the model's own forward: name the module whose output it reads
            inside = (f", on the output of module {source.target!r} "
                      f"({type(self.modules[str(source.target)]).__name__})")
        where = f"{'method' if method else 'function'} {label!r} (node {node.name!r}{inside})"
        x = self.tag(source)
        if method and target in SIZE_METHODS or (
                target is getattr and node.args[1] in SIZE_ATTRIBUTES):
            return None
        if target is operator.getitem and x is None:
            return None  # x.shape[0]
        if target in BINARY_METHODS if method else target in BINARY_FUNCTIONS:
            return self.binary(where, node)
        if x is None:  # what follows maps a tensor argument
            return self.unknown(where, node, "OTFusion cannot follow the channels through it")
        if (target in ELEMENTWISE_METHODS if method else target in ELEMENTWISE_FUNCTIONS):
            return x
        if not method and target in POOL_FUNCTIONS and not node.kwargs.get("return_indices"):
            return self.pool(where, node, x)
        if target == "flatten" or target is torch.flatten:
            return self.flatten(where, node, x, _argument(node, 1, "start_dim", 0),
                                _argument(node, 2, "end_dim", -1))
        if target in ("view", "reshape") or target is torch.reshape:
            shape = node.args[1:] if method else (_argument(node, 1, "shape", ()),)
            if len(shape) == 1 and isinstance(shape[0], tuple | list):
                shape = tuple(shape[0])
            if len(shape) == 2 and ((shape[1] == -1 and _is_batch_size(shape[0]))
                                    or (shape[0] == -1 and isinstance(shape[1], int))):
                return self.flatten(where, node, x, 1, -1)
        if target == "mean" or target is torch.mean:
            return self.mean(where, node, x, _argument(node, 1, "dim", None),
                             _argument(node, 2, "keepdim", False))
        return self.unknown(where, node, "OTFusion cannot follow the channels through it")

    # -------------------------------------------------------------------- op kinds
    def layer(self, where: str, name: str, module: nn.Linear | nn.Conv2d, x: Tag) -> Tag:
        """A producer: opens a group of its output channels; its input side is checked."""
        linear = isinstance(module, nn.Linear)
        n_in = module.in_features if linear else module.in_channels
        n_out = module.out_features if linear else module.out_channels
        if isinstance(x, Channels) and x.layout is not None:
            width = self.width_of(x.group)
            reason = None
            if linear and x.layout == "conv":
                reason = "a Linear over the last (spatial) dimension of a convolution output"
            elif not linear and x.layout != "conv":
                reason = f"a Conv2d over the {x.layout} features of a Linear / flatten"
            elif width is not None and (n_in % width if x.layout == "flat" else n_in != width):
                reason = f"it takes {n_in} input channels, its input carries {width}"
            if reason:
                self.problem(where, reason, [x.group])
        output = self.new_group(n_out, fixed=False)
        self.layers.append((name, module, x, output))
        return Channels(output, "linear" if linear else "conv")

    def normalisation(self, where: str, name: str, module: nn.Module, x: Tag,
                      accepts: Mapping[Layout, int]) -> Tag:
        """A channel-wise module: its floating-point state (gamma, beta, running mean and
        variance) is permuted with its input's group; ``accepts`` maps the layouts it can
        normalise channel-wise to its per-channel parameters' leading size."""
        if not isinstance(x, Channels) or x.layout is None:
            return x
        width = self.width_of(x.group)
        size = accepts.get(x.layout)
        if size is None:
            self.problem(where, f"it does not normalise the channels of a {x.layout} tensor "
                         "one by one", [x.group])
            return Opaque(frozenset([x.group]))
        if width is not None and (size % width if x.layout == "flat" else size != width):
            self.problem(where, f"it normalises {size} features, its input carries {width} "
                         "channels", [x.group])
        self.channelwise += [(f"{name}.{key}", x.group)
                             for key, value in module.state_dict().items()
                             if value.is_floating_point()]
        return x

    def pool(self, where: str, node: fx.Node, x: Tag) -> Tag:
        if isinstance(x, Channels) and x.layout not in ("conv", None):
            return self.unknown(where, node, f"2-D pooling of a {x.layout} tensor")
        return x

    def flatten(self, where: str, node: fx.Node, x: Tag, start: Any, end: Any) -> Tag:
        """``[N, C, H, W] -> [N, C*H*W]``, channel-major blocks (a no-op on [N, F])."""
        if start != 1 or end != -1:
            return self.unknown(where, node, "only flattening all but the batch dimension "
                                "keeps the channels in blocks")
        return Channels(x.group, "flat") if isinstance(x, Channels) and x.layout == "conv" else x

    def mean(self, where: str, node: fx.Node, x: Tag, dims: Any, keepdim: Any) -> Tag:
        """A global average over the spatial dimensions of [N, C, H, W]."""
        spatial = (isinstance(dims, tuple | list)
                   and sorted(d % 4 for d in dims if isinstance(d, int)) == [2, 3])
        if isinstance(x, Channels) and x.layout == "conv" and spatial:
            return x if keepdim else Channels(x.group, "linear")
        return self.unknown(where, node, "a mean over other than the spatial dimensions")

    def binary(self, where: str, node: fx.Node) -> Tag:
        """x + y (-, *, /): a number leaves x's channels; two tensors must share the channel
        permutation, so their groups are merged."""
        operands = (_argument(node, 0, "input", None), _argument(node, 1, "other", None))
        tensors = [t for t in map(self.tag, operands) if t is not None]
        if len(tensors) < 2:
            return tensors[0] if tensors else None
        a, b = tensors
        if not (isinstance(a, Channels) and isinstance(b, Channels)):
            return self.unknown(where, node, "it combines channels with a tensor of unknown "
                                "channel order")
        width_a, width_b = self.width_of(a.group), self.width_of(b.group)
        if (a.layout and b.layout and a.layout != b.layout) or (
                width_a and width_b and width_a != width_b):
            return self.unknown(where, node, f"it combines {width_a} {a.layout} channels "
                                f"with {width_b} {b.layout} channels")
        self.union(a.group, b.group)
        return Channels(a.group, a.layout or b.layout)

    # -------------------------------------------------------------------- result
    def structure(self) -> Structure:
        """The structure, or a ValueError naming the first problem on a permuted group."""
        for p in self.problems:
            if p.groups is None or any(self.permuted(g) for g in p.groups):
                raise ValueError(f"otfusion cannot align {p.where}: {p.reason}; {ALTERNATIVE} "
                                 "instead")
        order: dict[int, int] = {}
        for *_, output in self.layers:
            if self.permuted(output):
                order.setdefault(self.find(output), len(order))

        def index(group: int) -> int | None:
            return order.get(self.find(group))

        layers = []
        for name, module, x, output in self.layers:
            source = index(x.group) if isinstance(x, Channels) else None
            width = self.width_of(x.group) if isinstance(x, Channels) else None
            block = 1
            if source is not None and width and x.layout == "flat":
                block = (module.in_features if isinstance(module, nn.Linear)
                         else module.in_channels) // width
            layers.append(AlignedLayer(
                name, f"{name}.weight", f"{name}.bias" if module.bias is not None else None,
                index(output), source, block))
        if not layers:
            raise ValueError(f"otfusion cannot align {type(self.model).__name__}: it has no "
                             f"Linear/Conv2d layer; {ALTERNATIVE} instead")
        channelwise = tuple((key, g) for key, group in self.channelwise
                            if (g := index(group)) is not None)
        return Structure(tuple(layers), channelwise, len(order))


def alignment_problem(model: nn.Module) -> str | None:
    """Why OTFusion cannot align ``model`` (:func:`alignment_structure`'s error), or None."""
    try:
        alignment_structure(model)
    except ValueError as exc:
        return str(exc)
    return None


def alignment_structure(model: nn.Module) -> Structure:
    """The permutation groups of ``model`` (module docstring), from its traced graph; build
    it on the meta device, only the structure is read. Raises ValueError naming the first
    module or operation OTFusion cannot align, and for a model ``torch.fx`` cannot trace."""
    try:
        traced = fx.symbolic_trace(model)
    except Exception as exc:  # noqa: BLE001 (tracing runs the user's forward)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(
            f"otfusion cannot align {type(model).__name__}: torch.fx cannot trace its forward "
            f"({type(exc).__name__}: {first}), so the channel structure is unknown; "
            f"{ALTERNATIVE} instead") from exc
    analysis = _GraphAnalysis(model, traced)
    analysis.run(traced.graph)
    return analysis.structure()


def structure_of(spec: ModelSpec) -> Structure:
    """:func:`alignment_structure` of ``spec``'s network, built on the meta device (on the CPU
    for a factory that cannot build there)."""
    try:
        with torch.device("meta"):
            model = spec.build()
    except Exception:  # noqa: BLE001 (a user factory; the CPU build raises what is wrong)
        model = spec.build()
    return alignment_structure(model)


# --------------------------------------------------------------------------- alignment
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


class OTFusion(FusionStrategy):
    """Align every client's neurons to the reference client by exact OT, then average.

    The permutation groups come from the traced module graph (BatchNorm, LayerNorm and
    residual connections included); a model with anything else is refused before anything
    trains (:mod:`fedfusion.model_check`).

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
