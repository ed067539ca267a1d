"""Kron curvature of any architecture: K-FAC blocks for ``nn.Linear`` / ``nn.Conv2d``, a
diagonal block for every other parameter (BatchNorm, LayerNorm, GroupNorm, Embedding, a
user's own layer), in plain PyTorch.

laplace-torch's Kron backends only know Linear and Conv2d modules (ASDL ignores a BatchNorm
and then fails on a tensor-size mismatch; Curvlinops and BackPack refuse). Here both kinds of
block come from the same Monte-Carlo Fisher as laplace-torch's default ``asdl_mc``: per batch,
labels ``y~_n ~ Categorical(softmax(f(x_n)))`` drawn from a generator seeded with ``seed``
(the caller's global RNG is not touched), and the summed NLL ``L = sum_n -log p(y~_n | x_n)``
of the network in eval mode (normalisation layers use their running statistics, so samples
are independent, as at prediction time). Then, summed over the client's ``N`` samples:

* ``nn.Linear`` (input ``a_n``, output gradient ``g_n = dL / d out_n``; extra leading
  dimensions count as more positions): ``B = sum_n g_n g_n^T``, ``A = (1/N) sum_n a_n a_n^T``
  for the weight; the bias gets ``B`` alone (laplace-torch's ``Kron`` layout: separate blocks
  for weight and bias, ``H_W = B (x) A``);
* ``nn.Conv2d`` (im2col patches ``p_nl`` at the ``L`` output positions, output gradients
  ``G_n`` ``[out, L]``): ``B = sum_n G_n G_n^T``, ``A = (1 / (N L)) sum_n sum_l p_nl p_nl^T``;
  the bias as above;
* every other parameter ``theta``: the diagonal of the same Fisher,
  ``h = sum_n (d -log p(y~_n | x_n) / d theta)^2``, from per-sample gradients
  (``torch.func.vmap`` over ``torch.func.grad``; a module that cannot be vmapped is
  differentiated one sample at a time, slower but the same numbers).

Memory: the data go through the network in passes of at most ``batch_size`` rows, and
fewer where one pass would hold more than :data:`PASS_BYTES` of activations (the rows per
pass from one row's module outputs, :func:`pass_rows`): the fit's memory is bounded by that
pass, whatever ``N`` (a convolution's im2col patches, ``k*k`` times its input, are built
:data:`PATCH_BYTES` at a time). Every quantity above is a sum over rows and the labels are drawn row
after row from one generator (CPU ``torch.multinomial`` draws one uniform per row), so the
factors do not depend on the pass size beyond float rounding.

So for a network of Linear/Conv2d layers only this is the MC K-FAC of ``asdl_mc`` (other
random draws); :class:`~fedfusion.curvature.kron.KronCurvature` stores the diagonal blocks
next to the Kron ones (``"<param>/ggn_diag"``) and the mixture objective evaluates both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from fedfusion.im2col import patch_rows, unsupported_conv
from fedfusion.state import KRON_MODULES

log = logging.getLogger("fedfusion")

Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]

#: the activations one pass of :func:`hybrid_kron_fit` may produce (the module outputs of its
#: rows); autograd keeps tensors of that order for the backward and the per-sample gradients
#: of the diagonal blocks as many again
PASS_BYTES = 48 << 20
#: the im2col patches of a convolution's input built at once for its input factor ``A``
PATCH_BYTES = 16 << 20


def check_kron_module(name: str, module: nn.Module) -> None:
    """Raise a ValueError naming a Linear/Conv2d the Kron factors below cannot describe."""
    if isinstance(module, nn.Conv2d) and unsupported_conv(module):
        raise ValueError(
            f"Kron curvature: conv layer {name!r} ({module}) has groups, a padding mode or "
            "string padding the K-FAC patches do not describe; use hessian_structure='diag' "
            "(curvature-structure diag) for this model")


def _gram_over_samples(per_sample: torch.Tensor) -> torch.Tensor:
    """``sum_b M_b M_b^T`` of ``[B, O, L]`` matrices: one batched GEMM where its ``[B, O, O]``
    result is small, else one GEMM over the flattened ``[O, B L]``."""
    if per_sample.shape[0] * per_sample.shape[1] ** 2 <= 1 << 24:
        return torch.bmm(per_sample, per_sample.transpose(1, 2)).sum(0)
    flat = per_sample.transpose(0, 1).reshape(per_sample.shape[1], -1)
    return flat @ flat.T


def hybrid_kron_fit(model: nn.Module, x: torch.Tensor, seed: int | None = 0,
                    batch_size: int = 256, kron: bool = True
                    ) -> tuple[Factors, dict[str, torch.Tensor]]:
    """``({weight or bias of a Linear/Conv2d: (B, A)}, {other parameter: h})`` of ``model``
    on the inputs ``x``, as described in the module docstring; ``kron=False``: the diagonal
    ``h`` of every parameter (the ``diag`` structure for modules laplace-torch cannot fit).
    ``model`` is left as it was (mode, parameters, buffers, ``.grad``)."""
    if len(x) == 0:
        raise ValueError("curvature needs at least one sample")
    modules = {name: m for name, m in model.named_modules()
               if kron and isinstance(m, KRON_MODULES)}
    for name, module in modules.items():
        check_kron_module(name, module)
    kron_names = {f"{name}.{p}" if name else p
                  for name, m in modules.items() for p, _ in m.named_parameters(recurse=False)}
    diag_params = {n: p for n, p in model.named_parameters() if n not in kron_names}
    sums: dict[str, list[torch.Tensor]] = {}
    rows = pass_rows(model, x, batch_size)
    generator = torch.Generator(device=x.device)
    if seed is not None:
        generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    diag = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in diag_params.items()}
    try:
        for start in range(0, len(x), rows):
            batch = x[start:start + rows]
            targets = _kron_pass(model, modules, batch, generator, sums)
            if diag_params:
                for name, value in _squared_sample_grads(model, diag_params, batch,
                                                         targets).items():
                    diag[name] += value.double()
    finally:
        model.train(was_training)
    unused = sorted(set(modules) - set(sums))
    if unused:
        raise ValueError(f"Kron curvature: layer(s) {unused} saw no input (unused layers); "
                         "remove them from the model")
    factors: Factors = {}
    for name, module in modules.items():
        b, a = sums[name]
        prefix = f"{name}." if name else ""
        factors[f"{prefix}weight"] = (b, a / len(x))
        if module.bias is not None:
            factors[f"{prefix}bias"] = (torch.ones(1, 1, dtype=b.dtype, device=b.device),
                                        b.clone())
    return factors, {n: h.to(diag_params[n].dtype) for n, h in diag.items()}


@torch.no_grad()
def row_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of every module's output (leaves and containers alike, as hooks and autograd
    see them) for one row: a forward pass of ``x``'s first row in eval mode."""
    sizes: list[int] = []

    def count(_module: nn.Module, _args: tuple[torch.Tensor, ...], out: object) -> None:
        if isinstance(out, torch.Tensor):
            sizes.append(out.numel() * out.element_size())

    handles = [m.register_forward_hook(count) for m in model.modules()]
    was_training = model.training
    model.eval()
    try:
        model(x[:1])
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return sum(sizes)


def pass_rows(model: nn.Module, x: torch.Tensor, batch_size: int,
              budget: int | None = None) -> int:
    """Rows per pass of :func:`hybrid_kron_fit`: ``batch_size``, or fewer so that one
    pass's module outputs (:func:`row_bytes` per row) stay within ``budget`` bytes (default
    :data:`PASS_BYTES`, read at call time); at least 1."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    budget = PASS_BYTES if budget is None else budget
    return max(1, min(batch_size, budget // max(1, row_bytes(model, x))))


def _kron_pass(model: nn.Module, modules: dict[str, nn.Module], batch: torch.Tensor,
               generator: torch.Generator, sums: dict[str, list[torch.Tensor]]
               ) -> torch.Tensor:
    """One forward and backward pass of ``batch``: the sampled labels ``y~`` (one per row,
    drawn from the model's predictive), and each Linear/Conv2d layer's ``(sum g g^T,
    sum a a^T)`` of the batch added to ``sums``. The layers' inputs and outputs are captured
    by forward hooks attached for this pass only (so no other pass, such as the per-sample
    gradients' ``vmap``, leaves its tensors in them), and every captured tensor is dropped
    before returning: nothing of the batch outlives its pass."""
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., torch.Tensor]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
                 ) -> torch.Tensor:
            inputs[name] = args[0].detach()
            outputs[name] = out
            # the network goes on with a copy: an in-place op after the layer (ReLU(inplace))
            # must not turn the kept output into another tensor of the graph
            return out.clone()
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in modules.items()]
    try:
        with torch.enable_grad():
            logits = model(batch)
            probs = torch.softmax(logits.detach().float(), dim=-1)
            targets = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            live = [n for n in modules if n in outputs]
            if live:
                grads = torch.autograd.grad(F.cross_entropy(logits, targets, reduction="sum"),
                                            [outputs[n] for n in live], allow_unused=True)
                for name, g in zip(live, grads, strict=True):
                    if g is not None:
                        _accumulate(sums, name, modules[name], inputs[name], g.detach())
    finally:
        for handle in handles:
            handle.remove()
    return targets


def _patch_gram(module: nn.Conv2d, inputs: torch.Tensor) -> torch.Tensor:
    """``sum p p^T`` of the im2col patches of ``inputs`` (:func:`patch_rows`)."""
    rows = patch_rows(module, inputs)  # [B L, K]
    return rows.T @ rows


def _accumulate(sums: dict[str, list[torch.Tensor]], name: str, module: nn.Module,
                inputs: torch.Tensor, g: torch.Tensor) -> None:
    """Add one batch's ``(sum g g^T, sum a a^T [/ L])`` of a Linear/Conv2d to ``sums``."""
    if isinstance(module, nn.Conv2d):
        if inputs.ndim == 3:  # an unbatched [C, H, W] input
            inputs, g = inputs.unsqueeze(0), g.unsqueeze(0)
        b = _gram_over_samples(g.reshape(g.shape[0], g.shape[1], -1))  # g: [B, O, Ho, Wo]
        # the im2col patches are k*k times the layer's input: built a few samples at a time
        positions = g.shape[2] * g.shape[3]
        sample_bytes = positions * module.weight[0].numel() * inputs.element_size()
        step = max(1, PATCH_BYTES // sample_bytes)
        a = sum(_patch_gram(module, inputs[i:i + step]) for i in range(0, len(inputs), step))
        a = a / positions
    else:
        g2, a2 = g.reshape(-1, g.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
        b, a = g2.T @ g2, a2.T @ a2
    if name in sums:
        sums[name][0] += b
        sums[name][1] += a
    else:
        sums[name] = [b, a]


def _squared_sample_grads(model: nn.Module, params: dict[str, nn.Parameter], x: torch.Tensor,
                          targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sum_n (d -log p(y_n | x_n) / d theta)^2`` for the parameters ``params`` over the batch,
    by vmap over per-sample gradients, or one sample at a time where vmap cannot run."""
    detached = {n: p.detach() for n, p in params.items()}

    def sample_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, ti: torch.Tensor
                    ) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(out, ti.unsqueeze(0), reduction="sum")

    try:
        # no_grad outside the transform: ``grad`` still differentiates, but its results do
        # not record a graph back to the model's other parameters (which require grad), a
        # graph that would keep the batch's activations alive in every sum they enter
        with torch.no_grad():
            per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(detached, x, targets)
            return {n: (g * g).sum(0) for n, g in per_sample.items()}
    except (RuntimeError, NotImplementedError) as exc:  # an op without a vmap rule
        log.info("hybrid Kron: per-sample gradients one sample at a time (vmap: %s)",
                 str(exc).splitlines()[0][:120])
    sums = {n: torch.zeros_like(p) for n, p in detached.items()}
    for xi, ti in zip(x, targets, strict=True):
        p = {n: v.clone().requires_grad_(True) for n, v in detached.items()}
        with torch.enable_grad():
            grads = torch.autograd.grad(sample_loss(p, xi, ti), list(p.values()),
                                        allow_unused=True)
        for n, g in zip(p, grads, strict=True):
            if g is not None:
                sums[n] += g * g
    return sums
