"""Upload section ``gram``: per layer, the Gram matrix of the layer's inputs (for RegMean).

For every linear map of a model (:func:`fedfusion.capture.linear_maps`: ``nn.Linear``,
``nn.Conv2d``, the packed in-projection of ``nn.MultiheadAttention``) the client computes,
over its training samples x_1..x_N,

* Linear ``W [out, in]``: G = X^T X = sum_n a_n a_n^T, ``[in, in]``, where a_n is the input
  the layer sees for sample n (inputs with extra leading dimensions count every position);
* Conv2d ``W [out, c, kh, kw]``: the layer is a linear map of its unfolded input patches
  (:func:`torch.nn.functional.unfold` with the layer's kernel, dilation, padding and
  stride), so G = sum_n sum_p u_{n,p} u_{n,p}^T over the samples and the spatial positions
  p, ``[c*kh*kw, c*kh*kw]``, ordered as ``W.reshape(out, -1)`` is (channel-major).
* ``nn.MultiheadAttention`` (one packed projection, self-attention): its ``in_proj_weight``
  ``[3d, d]`` is one linear map of the attention's input h, so G = sum_n sum_l h_nl h_nl^T
  over samples and tokens, ``[d, d]``; its ``out_proj`` (a Linear the attention never calls)
  has the Gram of the attention output. Both are captured by :mod:`fedfusion.capture`, with
  PyTorch's fused attention fast path off.
* A layer WITH a bias is the linear map ``[W | b]`` of the inputs augmented with a constant
  1, so its Gram is that of ``[a, 1]``: ``[in+1, in+1]`` (the last row/column is the
  bias's), and it covers both the weight and the bias.
* A layer no call of which is captured (never applied, or its weight read without calling
  it) has a zero Gram; RegMean keeps the sample-weighted average for a layer whose Gram sum is
  zero.

The array is stored under the weight's parameter name (``"classifier.0.weight"``), summed
(not averaged) over samples: per batch in the inputs' precision, over batches in float64;
shipped as float32, symmetrised.
Grouped convolutions and non-zero padding modes are refused (their unfolded patches are not
what the weight multiplies).

Which parameters are linear-map weights is a property of the MODULES, not of the shapes:
an ``nn.Embedding`` weight is 2-D like a Linear weight, and BatchNorm/LayerNorm parameters
are 1-D. So the layers are read from the model's module types (:func:`gram_layers`,
:func:`model_gram_sizes`) wherever the model is at hand: on the client (:func:`layer_grams`)
and in RegMean, which builds the server's model on the meta device.

:func:`validate_grams` is the server-side check. The Gram layers it expects, best first:

* ``sizes`` given (:func:`model_gram_sizes` of the model; RegMean checks every upload so):
  exactly one array per Linear/Conv2d weight, of the module's size;
* else, a layout that knows the module types (:func:`layout_gram_sizes`: a ``{name: shape}``
  mapping with a ``kron`` attribute naming the parameters of Linear/Conv2d modules, as
  :class:`fedfusion.core.state.StateLayout`, which the server builds from the model): the same,
  exact;
* else (a plain ``{name: shape}`` mapping) the SHAPE RULE, :func:`expected_gram_sizes`: every
  array must be named after a 2-D or 4-D ``*weight`` parameter and have the size that
  parameter would give as a Linear/Conv2d weight; whether every Linear/Conv2d layer has a
  Gram cannot be told from shapes, so completeness is left to the module-level check.

Every array present must be symmetric and positive semi-definite up to float32 rounding.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from fedfusion.capture import LinearInputs, LinearMap, linear_maps
from fedfusion.im2col import patch_rows, unsupported_conv
from fedfusion.sections.base import MAX_ABS_GRAM, Section
from fedfusion.sections.options import SectionOptions
from fedfusion.sections.weights import check_array_names

log = logging.getLogger("fedfusion")

#: relative asymmetry ``max|G - G^T| / max diag(G)`` above which a Gram is refused
SYMMETRY_TOL = 1e-5
#: a Gram is "clearly non-PSD" when ``G + PSD_TOL * max diag(G) * I`` has no Cholesky factor,
#: i.e. it has an eigenvalue below ``-PSD_TOL * max diag(G)``. float32 rounding moves the
#: eigenvalues by at most ``n * 2^-24 * max diag(G)`` (|G_ij| <= max diag for a PSD matrix),
#: about 1e-4 * max diag for n = 1600, so 1e-3 never refuses an honest Gram.
PSD_TOL = 1e-3


def gram_layers(model: nn.Module) -> dict[str, LinearMap]:
    """The linear maps whose weights get a Gram (:func:`fedfusion.capture.linear_maps`:
    Linear, Conv2d, the packed in-projection of ``nn.MultiheadAttention``), keyed by the
    weight's parameter name."""
    return linear_maps(model)


def gram_size(layer: LinearMap) -> int:
    """Side of the Gram of a linear map: the columns of its weight's matrix view (Linear
    ``in_features``, Conv2d ``in_channels / groups * kh * kw``, attention ``embed_dim``), + 1
    with a bias (the constant input)."""
    return layer.in_features + (1 if layer.bias is not None else 0)


def model_gram_sizes(model: nn.Module) -> dict[str, int]:
    """Gram side per linear-map weight of ``model``, from its module types (works on the
    meta device)."""
    return {name: gram_size(layer) for name, layer in gram_layers(model).items()}


def layer_inputs(module: nn.Module, inputs: torch.Tensor, bias: bool | None = None
                 ) -> torch.Tensor:
    """The rows the layer's weight multiplies: ``[rows, in (+1 with a bias)]``, in the
    inputs' dtype: a Conv2d's im2col patches, else the inputs' last dimension (extra leading
    dimensions, e.g. a sequence's positions, count as more rows). ``bias``: whether to append
    the constant 1 (default: whether ``module`` has a ``bias``)."""
    if isinstance(module, nn.Conv2d):
        if unsupported_conv(module):
            raise ValueError(f"gram: conv layer {module} (groups / padding mode / string "
                             "padding) is not supported")
        rows = patch_rows(module, inputs)  # [B L, c*k*k]
    else:
        rows = inputs.reshape(-1, inputs.shape[-1])
    if bias is None:
        bias = getattr(module, "bias", None) is not None
    if bias:
        rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)],
                         dim=1)
    return rows


def forward_with_hooks(model: nn.Module, x: torch.Tensor, hooks: Mapping[nn.Module, Callable],
                       batch_size: int) -> None:
    """Run ``model`` over ``x`` in batches with forward ``hooks`` attached to the given
    modules; the hooks are removed afterwards, also on error."""
    device = next(model.parameters()).device
    handles = [module.register_forward_hook(hook) for module, hook in hooks.items()]
    try:
        for start in range(0, len(x), batch_size):
            model(x[start:start + batch_size].to(device))
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def layer_grams(model: nn.Module, x: torch.Tensor, batch_size: int = 512
                ) -> dict[str, np.ndarray]:
    """Per linear-map weight, the Gram of the layer's (unfolded, bias-augmented) inputs
    summed over all samples of ``x``; float32 arrays keyed by the weight's name.

    The inputs are captured by :class:`fedfusion.capture.LinearInputs` (attention
    projections included, PyTorch's fused attention fast path off). A layer no call of which
    was captured (unused, or read without calling it) gets a zero Gram: RegMean then keeps
    its sample-weighted average (see :meth:`fedfusion.strategies.regmean.LayerSums.solve`)."""
    layers = gram_layers(model)
    if not layers:
        raise ValueError("gram: the model has no Linear, Conv2d or attention layer")
    if len(x) == 0:
        raise ValueError("gram: no samples")
    sums: dict[str, torch.Tensor] = {}
    capture = LinearInputs(model, layers)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(x), batch_size):
            capture.clear()
            with capture.active():
                model(x[start:start + batch_size].to(device))
            for name, calls in capture.calls.items():
                layer = layers[name]
                for call in calls:
                    rows = layer_inputs(layer.module, call.inputs, layer.bias is not None)
                    # one batch's sum in the inputs' precision (float32: 2-3x faster than a
                    # float64 GEMM, ~1e-6 relative over a batch), the running sum in float64
                    gram = (rows.T @ rows).double()
                    sums[name] = sums[name] + gram if name in sums else gram
    finally:
        model.train(was_training)
    for name in sorted(set(layers) - set(sums)):
        log.info("gram: no input of %r was captured; a zero Gram (RegMean averages it)", name)
        size = gram_size(layers[name])
        sums[name] = torch.zeros(size, size, dtype=torch.float64)
    return {name: (0.5 * (g + g.T)).cpu().numpy().astype(np.float32)
            for name, g in sums.items()}


def expected_gram_sizes(param_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """The shape rule: the Gram side each parameter WOULD have as a Linear/Conv2d weight,
    from the parameter shapes alone.

    Every 2-D ``*weight`` is taken for a Linear weight ``[out, in]`` and every 4-D one for a
    Conv2d weight ``[out, c, kh, kw]``; a ``*bias`` next to it adds the constant input. For a
    real Linear/Conv2d layer this is :func:`model_gram_sizes`' size; but other modules have
    2-D weights too (``nn.Embedding``), so these are the names a Gram MAY have, not the ones
    it must: see :func:`validate_grams`.
    """
    sizes = {}
    for name, shape in param_shapes.items():
        if not name.endswith("weight") or len(shape) not in (2, 4):
            continue
        bias = name[: -len("weight")] + "bias"
        sizes[name] = math.prod(shape[1:]) + (1 if bias in param_shapes else 0)
    return sizes


def layout_gram_sizes(param_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int] | None:
    """Gram side per Linear/Conv2d weight when ``param_shapes`` says which parameters belong
    to Linear/Conv2d modules (its ``kron`` attribute, as a
    :class:`fedfusion.core.state.StateLayout`'s); None for a plain ``{name: shape}`` mapping."""
    kron = getattr(param_shapes, "kron", None)
    if kron is None:
        return None
    return {name: size for name, size in expected_gram_sizes(param_shapes).items()
            if name in kron}


def check_gram_names(arrays: Mapping[str, object], sizes: Mapping[str, int],
                     complete: bool = True) -> None:
    """Names and shapes only (nothing computed on the values): every array is named after a
    layer of ``sizes`` and is ``[size, size]``; with ``complete`` every layer has one. Raises
    ValueError naming the array."""
    if complete:
        check_array_names(arrays, sizes, "missing Gram(s) for layer(s)",
                          " (no Linear/Conv2d weight of that name)")
    else:
        check_array_names(arrays, [n for n in sizes if n in arrays], extra_hint=(
            " (no parameter of that name could be a Linear/Conv2d weight)"))
    for name in arrays:
        shape = tuple(getattr(arrays[name], "shape", ()))
        if shape != (sizes[name], sizes[name]):
            raise ValueError(f"array {name!r} has shape {shape}, expected "
                             f"{(sizes[name], sizes[name])}")


def validate_grams(arrays: Mapping[str, np.ndarray],
                   param_shapes: Mapping[str, tuple[int, ...]],
                   sizes: Mapping[str, int] | None = None) -> None:
    """Raise ValueError naming the array for a missing layer, an unexpected array, a wrong
    shape, a non-symmetric or a clearly non-PSD Gram (see :data:`PSD_TOL`).

    ``sizes`` (:func:`model_gram_sizes` of the model), or a ``param_shapes`` layout that
    knows the module types (:func:`layout_gram_sizes`), makes the names exact; with plain
    shapes the shape rule :func:`expected_gram_sizes` bounds them and a missing layer cannot
    be told (see the module docstring)."""
    if sizes is None:
        sizes = layout_gram_sizes(param_shapes)
    if sizes is None:
        check_gram_names(arrays, expected_gram_sizes(param_shapes), complete=False)
    else:
        check_gram_names(arrays, sizes)
    for name in arrays:
        gram = np.asarray(arrays[name], dtype=np.float64)
        size = gram.shape[0]
        scale = max(float(np.max(np.abs(np.diag(gram)))), np.finfo(np.float64).tiny)
        asymmetry = float(np.max(np.abs(gram - gram.T)))
        if asymmetry > SYMMETRY_TOL * scale:
            raise ValueError(f"array {name!r} is not symmetric (max |G - G^T| = {asymmetry:.3g},"
                             f" max diag {scale:.3g})")
        # torch, not numpy: numpy's OpenBLAS was seen spinning forever here inside a Flower
        # simulation process (see fedfusion.app.launch)
        shifted = torch.from_numpy(gram + PSD_TOL * scale * np.eye(size))
        if int(torch.linalg.cholesky_ex(shifted).info) != 0:
            raise ValueError(f"array {name!r} is not positive semi-definite (an eigenvalue "
                             f"below -{PSD_TOL:g} * max diag)")


def build_grams(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: SectionOptions,
                built: Mapping[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The section's builder: :func:`layer_grams` of the member on the client's inputs."""
    return layer_grams(model, x)


GRAM_SECTION = Section(build_grams, validate_grams, MAX_ABS_GRAM)
