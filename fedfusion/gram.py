"""Upload section ``gram``: per layer, the Gram matrix of the layer's inputs (for RegMean).

For every ``nn.Linear`` and ``nn.Conv2d`` module of a model the client computes, over its
training samples x_1..x_N,

* Linear ``W [out, in]``: G = X^T X = sum_n a_n a_n^T, ``[in, in]``, where a_n is the input
  the layer sees for sample n (inputs with extra leading dimensions count every position);
* Conv2d ``W [out, c, kh, kw]``: the layer is a linear map of its unfolded input patches
  (:func:`torch.nn.functional.unfold` with the layer's kernel, dilation, padding and
  stride), so G = sum_n sum_p u_{n,p} u_{n,p}^T over the samples and the spatial positions
  p, ``[c*kh*kw, c*kh*kw]``, ordered as ``W.reshape(out, -1)`` is (channel-major).
* A layer WITH a bias is the linear map ``[W | b]`` of the inputs augmented with a constant
  1, so its Gram is that of ``[a, 1]``: ``[in+1, in+1]`` (the last row/column is the
  bias's), and it covers both the weight and the bias.

The array is stored under the weight's parameter name (``"classifier.0.weight"``), summed
(not averaged) over samples: per batch in the inputs' precision, over batches in float64;
shipped as float32, symmetrised.
Grouped convolutions and non-zero padding modes are refused (their unfolded patches are not
what the weight multiplies).

:func:`validate_grams` is the server-side check: one array per Linear/Conv2d weight of the
right size, symmetric, and positive semi-definite up to float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.payload import check_array_names

#: relative asymmetry ``max|G - G^T| / max diag(G)`` above which a Gram is refused
SYMMETRY_TOL = 1e-5
#: a Gram is "clearly non-PSD" when ``G + PSD_TOL * max diag(G) * I`` has no Cholesky factor,
#: i.e. it has an eigenvalue below ``-PSD_TOL * max diag(G)``. float32 rounding moves the
#: eigenvalues by at most ``n * 2^-24 * max diag(G)`` (|G_ij| <= max diag for a PSD matrix),
#: about 1e-4 * max diag for n = 1600, so 1e-3 never refuses an honest Gram.
PSD_TOL = 1e-3


def gram_layers(model: nn.Module) -> dict[str, nn.Linear | nn.Conv2d]:
    """The modules whose weights get a Gram, keyed by the weight's parameter name."""
    return {f"{name}.weight" if name else "weight": module
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear | nn.Conv2d)}


def layer_inputs(module: nn.Linear | nn.Conv2d, inputs: torch.Tensor) -> torch.Tensor:
    """The rows the layer's weight multiplies: ``[rows, in (+1 with a bias)]``, in the
    inputs' dtype."""
    if isinstance(module, nn.Conv2d):
        if module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding,
                                                                              str):
            raise ValueError(f"gram: conv layer {module} (groups / padding mode / string "
                             "padding) is not supported")
        patches = F.unfold(inputs, module.kernel_size, dilation=module.dilation,
                           padding=module.padding, stride=module.stride)  # [B, c*k*k, L]
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    else:
        rows = inputs.reshape(-1, inputs.shape[-1])
    if module.bias is not None:
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
    """Per Linear/Conv2d weight, the Gram of the layer's (unfolded, bias-augmented) inputs
    summed over all samples of ``x``; float32 arrays keyed by the weight's name."""
    layers = gram_layers(model)
    if not layers:
        raise ValueError("gram: the model has no Linear or Conv2d layer")
    sums: dict[str, torch.Tensor] = {}

    def hook_for(name: str):  # noqa: ANN202 (a torch forward hook)
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
                 ) -> None:
            rows = layer_inputs(module, args[0])  # type: ignore[arg-type]
            # one batch's sum in the inputs' precision (float32: 2-3x faster than a float64
            # GEMM, ~1e-6 relative over a batch), the running sum over batches in float64
            gram = (rows.T @ rows).double()
            sums[name] = sums[name] + gram if name in sums else gram
        return hook

    was_training = model.training
    model.eval()
    try:
        forward_with_hooks(model, x, {m: hook_for(n) for n, m in layers.items()}, batch_size)
    finally:
        model.train(was_training)
    missing = sorted(set(layers) - set(sums))
    if missing:
        raise ValueError(f"gram: layer(s) {missing} saw no input (empty x or unused layer)")
    return {name: (0.5 * (g + g.T)).cpu().numpy().astype(np.float32)
            for name, g in sums.items()}


def expected_gram_sizes(param_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Gram side length per weight, from the parameter shapes alone.

    Assumes every 2-D ``*.weight`` is a Linear weight ``[out, in]`` and every 4-D one a
    Conv2d weight ``[out, c, kh, kw]``; a ``*.bias`` next to it adds the constant input.
    """
    sizes = {}
    for name, shape in param_shapes.items():
        if not name.endswith("weight") or len(shape) not in (2, 4):
            continue
        bias = name[: -len("weight")] + "bias"
        sizes[name] = math.prod(shape[1:]) + (1 if bias in param_shapes else 0)
    return sizes


def validate_grams(arrays: Mapping[str, np.ndarray],
                   param_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ValueError naming the array for a missing layer, an unexpected array, a wrong
    shape, a non-symmetric or a clearly non-PSD Gram (see :data:`PSD_TOL`)."""
    sizes = expected_gram_sizes(param_shapes)
    check_array_names(arrays, sizes, "missing Gram(s) for layer(s)",
                      " (no Linear/Conv2d weight of that name)")
    for name, size in sizes.items():
        gram = np.asarray(arrays[name], dtype=np.float64)
        if gram.shape != (size, size):
            raise ValueError(f"array {name!r} has shape {gram.shape}, expected {(size, size)}")
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
