"""The default Kron fit (laplace-torch's ``AsdlGGN(stochastic=True)``, i.e. ``asdl_mc``) on the
stacked trainer's layers, without laplace-torch: the same factors, 2-3x faster.

laplace-torch + ASDL spend most of a LeNet fit outside the factors themselves: PyTorch's
``max_pool2d`` forward and backward, weight gradients nobody uses (the backward pass runs
through the parameters), oneDNN's slow gradient of the first convolution. Here one forward
and one backward pass per batch run on :mod:`fedfusion.accel.stacked`'s layers (compiled kernels,
no weight gradients), and the K-FAC factors are the same GEMMs ASDL computes:

* per batch of ``batch_size`` rows (in order, as laplace-torch's loader takes them), labels
  drawn from the model's predictive, ``Categorical(softmax(logits)).sample()``, from the global
  RNG seeded with ``seed`` exactly as :func:`fedfusion.curvature.fit.fit_laplace` leaves it
  when ASDL draws (``torch.manual_seed(seed)``, then the two int64 draws torch's DataLoader and
  laplace-torch's ``fit`` take first): the same draws, so the same MC estimate;
* output gradients ``g`` of the summed NLL of those labels (``softmax - one_hot``);
* ``Linear``: ``A += a^T a`` over the batch, ``B += g^T g``; ``Conv2d``: ``A += P P^T / L`` with
  ``P`` the im2col patches (``L`` output positions), ``B += G G^T`` over samples and positions;
* laplace-torch's ``Kron`` scaling: ``B`` summed over batches, ``A`` summed and divided by
  ``N``; a bias gets its module's ``B`` as its single factor.

The tests compare the factors with laplace-torch's on trained models (relative 1e-5).
Models the stacked trainer does not know return None: :func:`fit_curvature` then runs
laplace-torch.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from fedfusion.accel.stacked import (
    StackedConv2d,
    StackedLinear,
    StackedNetwork,
    compile_members,
    trace_stages,
)
from fedfusion.seeding import seeded

#: int64 draws laplace-torch 0.3's ``fit`` (a DataLoader iterator's base seed, twice) takes
#: from the global RNG before ASDL's first label draw (checked by the tests)
_DRAWS_BEFORE_FIRST_BATCH = 2


def supports(model: nn.Module) -> bool:
    """Whether :func:`kron_mc_factors` can fit ``model`` (a chain the stacked trainer knows,
    float32 parameters on the CPU) for image or flat inputs; the actual fit decides finally."""
    params = list(model.parameters())
    return bool(params) and all(p.dtype == torch.float32 and p.device.type == "cpu"
                                for p in params) and trace_stages(model) is not None


def kron_mc_factors(model: nn.Module, x: torch.Tensor, seed: int | None,
                    batch_size: int = 256) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """``{parameter name: (B, A)}`` of the MC-Fisher K-FAC of ``model`` on the inputs ``x``
    (laplace-torch's ``asdl_mc`` Kron factors, see the module doc), or None when the stacked
    trainer cannot run ``model``. The global RNG is left as it was."""
    if len(x) == 0:
        return None
    net = compile_members([model], x, [[]])
    if net is None:
        return None
    for layer in net.layers:
        layer.weight_grads = False
    with seeded(seed), torch.no_grad():
        for _ in range(_DRAWS_BEFORE_FIRST_BATCH):
            torch.empty((), dtype=torch.int64).random_()
        sums = _accumulate(net, x, batch_size)
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in net.layers:
        if not layer.params:
            continue
        b, a = sums[layer.name]
        factors[layer.params[0][0]] = (b, a / len(x))
        if len(layer.params) > 1:  # the bias: its module's B alone (laplace-torch's Kron)
            factors[layer.params[1][0]] = (torch.ones(1, 1, dtype=b.dtype), b.clone())
    return factors


#: per input tensor of the last fits: (weak reference, version, batch size, its Gram matrix);
#: the first layer's A factor depends on the data alone, the same for every member a client
#: fits (:func:`_data_gram`)
_DATA_GRAMS: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}


def _data_gram(x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``sum_n x_n x_n^T`` over the flattened rows of ``x``, batch by batch in the fit's order
    (so bitwise what each member's fit would sum), computed once per tensor and version."""
    entry = _DATA_GRAMS.get(id(x))
    if entry is not None and entry[0]() is x and entry[1:3] == (x._version, batch_size):
        return entry[3]
    flat = x.reshape(len(x), -1)
    gram = torch.zeros(flat.shape[1], flat.shape[1], dtype=flat.dtype)
    for begin in range(0, len(x), batch_size):
        rows = flat[begin:begin + batch_size]
        gram.add_(rows.T @ rows)
    for key in [k for k, v in _DATA_GRAMS.items() if v[0]() is None]:
        del _DATA_GRAMS[key]  # tensors gone
    _DATA_GRAMS[id(x)] = (weakref.ref(x), x._version, batch_size, gram)
    return gram


#: largest layer input (C * H * W floats) whose Gram matrix over samples the fit accumulates
#: instead of the patches' (a [CHW, CHW] float32 Gram: 16 MB at this size)
GRAM_MAX_FEATURES = 2048


def _uses_input_gram(layer: StackedConv2d, c: int, h: int, w: int) -> bool:
    """Whether a convolution's A factor comes cheaper from the Gram of its whole inputs.

    ``A = sum_n sum_l p_nl p_nl^T`` (patches ``p``) is a windowed sum of the entries of the
    input Gram ``G = sum_n x_n x_n^T``, so one ``[CHW, CHW]`` GEMM per batch replaces the
    ``[K, K]`` one over ``L`` times more columns (and the im2col copy). Fewer FLOPs for
    LeNet's two layers (614k / 746k against 360k / 1.44M multiply-adds per sample), and a
    square GEMM runs at ~2x the FLOP rate of the skinny one here; used where it costs fewer
    than twice the direct FLOPs and the Gram stays small (:data:`GRAM_MAX_FEATURES`)."""
    features = c * h * w
    if (layer.ph, layer.pw) != (0, 0) or features > GRAM_MAX_FEATURES:
        return False
    ho = (h - layer.dh * (layer.kh - 1) - 1) // layer.sh + 1
    wo = (w - layer.dw * (layer.kw - 1) - 1) // layer.sw + 1
    patch = c * layer.kh * layer.kw
    return features**2 < 2 * patch**2 * ho * wo


def _patch_index(layer: StackedConv2d, c: int, h: int, w: int) -> torch.Tensor:
    """``[K, L]``: the flat input index (``c * H * W + y * W + x``) of patch element ``k``
    (PyTorch's weight order) at output position ``l``."""
    ho = (h - layer.dh * (layer.kh - 1) - 1) // layer.sh + 1
    wo = (w - layer.dw * (layer.kw - 1) - 1) // layer.sw + 1
    ch = torch.arange(c).view(c, 1, 1, 1, 1)
    ki = torch.arange(layer.kh).view(1, -1, 1, 1, 1)
    kj = torch.arange(layer.kw).view(1, 1, -1, 1, 1)
    i = torch.arange(ho).view(1, 1, 1, -1, 1)
    j = torch.arange(wo).view(1, 1, 1, 1, -1)
    index = ch * h * w + (i * layer.sh + ki * layer.dh) * w + (j * layer.sw + kj * layer.dw)
    return index.reshape(c * layer.kh * layer.kw, ho * wo)


def _accumulate(net: StackedNetwork, x: torch.Tensor, batch_size: int
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per parameterised layer: (sum of batch B factors, sum of batch A factors)."""
    sums: dict[str, list[torch.Tensor]] = {}
    grams: dict[str, tuple[int, int, int]] = {}  # layer -> input (C, H, W) of a Gram sum
    first = next(i for i, layer in enumerate(net.layers) if layer.params)
    first_layer = net.layers[first]
    # the first layer sees the data itself (only flattening before it): its input Gram is
    # the data's, shared by every member fitted on this x
    data_only = all(type(layer).__name__ in ("_Flatten", "_Identity")
                    for layer in net.layers[:first]) and (
        isinstance(first_layer, StackedLinear) or (
            isinstance(first_layer, StackedConv2d) and x.ndim == 4
            and _uses_input_gram(first_layer, *x.shape[1:])))
    if data_only and isinstance(first_layer, StackedConv2d):
        grams[first_layer.name] = tuple(x.shape[1:])  # type: ignore[assignment]
    for begin in range(0, len(x), batch_size):
        inputs = x[begin:begin + batch_size].unsqueeze(0)
        h = inputs.transpose(1, 2) if x.ndim == 4 else inputs
        logits = net.forward(h)[0]
        probs = torch.softmax(logits, dim=-1)
        targets = torch.distributions.Categorical(probs).sample()
        grad = probs.clone()
        grad[torch.arange(len(targets)), targets] -= 1.0  # d sum NLL / d logits
        g: torch.Tensor | None = grad.unsqueeze(0)
        for index in range(len(net.layers) - 1, first - 1, -1):
            layer = net.layers[index]
            assert g is not None
            if layer.params:
                b, a = _batch_factors(layer, g, grams, skip_a=data_only and index == first)
                if layer.name in sums:
                    sums[layer.name][0].add_(b)
                    if a is not None:
                        sums[layer.name][1].add_(a)
                else:
                    sums[layer.name] = [b, a if a is not None else torch.empty(0)]
            if index > first:
                g = layer.backward(g)
    if data_only:
        sums[first_layer.name][1] = _data_gram(x, batch_size).clone()
    for layer in net.layers:
        if layer.name in grams:  # the input Gram -> the patches' Gram, divided by L
            assert isinstance(layer, StackedConv2d)
            gram = sums[layer.name][1].double()
            index = _patch_index(layer, *grams[layer.name])
            a = gram[index[:, None, :], index[None, :, :]].sum(-1) / index.shape[1]
            sums[layer.name][1] = a.float()
    return {name: (b, a) for name, (b, a) in sums.items()}


def _batch_factors(layer: object, g: torch.Tensor, grams: dict[str, tuple[int, int, int]],
                   skip_a: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, A) of one batch for a layer of one member, from its saved input and the gradient
    ``g`` of its output (before its backward pass overwrites any buffer). A convolution
    listed in ``grams`` returns its input Gram in place of A; ``skip_a``: A is not needed."""
    if isinstance(layer, StackedLinear):
        grads = g[0]  # [B, out]
        if skip_a:
            return grads.T @ grads, None
        a = layer.input[0]  # [B, in]
        return grads.T @ grads, a.T @ a
    assert isinstance(layer, StackedConv2d)
    per_member = g.transpose(1, 2)[0]  # [B, O, Ho, Wo]
    per_sample = per_member.reshape(per_member.shape[0], per_member.shape[1], -1)
    b_factor = torch.bmm(per_sample, per_sample.transpose(1, 2)).sum(0)  # sum_n G_n G_n^T
    if skip_a:
        return b_factor, None
    if layer.strategy != "gemm":
        inputs = layer.inputs[0]  # [B, C, H, W], contiguous
        c, h, w = inputs.shape[1:]
        if layer.name in grams or _uses_input_gram(layer, c, h, w):
            grams[layer.name] = (c, h, w)
            flat = inputs.reshape(inputs.shape[0], -1)
            return b_factor, flat.T @ flat
        patches = layer.patches(layer.inputs.transpose(1, 2))[0]  # [C kh kw, B L]
    else:
        patches = layer.cols[0]
    positions = patches.shape[1] // g.shape[2]
    return b_factor, (patches @ patches.T).div_(positions)
