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
* ``nn.MultiheadAttention`` (one packed projection, self-attention): ``in_proj_weight``
  ``[3d, d]`` is one linear map of the attention's input ``h`` at every token, so it is a
  Linear with positions: ``B = sum_n sum_l g_nl g_nl^T`` (``g = dL / d[q; k; v]``),
  ``A = (1/N) sum_n sum_l h_nl h_nl^T``, ``in_proj_bias`` ``B``; ``out_proj`` likewise with the
  attention output. The inputs and outputs are captured by :mod:`fedfusion.capture`;
* a linear map never applied: zero factors (its GGN is zero); one the loss depends on without
  a captured call: refused, naming it and the ``diag`` structure;
* every other parameter ``theta`` (LayerNorm, Embedding, a learned position ``nn.Parameter``,
  a user's layer): the diagonal of the same Fisher,
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
import warnings

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from fedfusion.capture import LinearInputs, LinearMap, linear_maps, unfused_attention
from fedfusion.device import model_device
from fedfusion.im2col import patch_rows, unsupported_conv

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
    """``({weight or bias of a linear map: (B, A)}, {other parameter: h})`` of ``model`` on
    the inputs ``x``, as described in the module docstring; ``kron=False``: the diagonal
    ``h`` of every parameter (the ``diag`` structure for modules laplace-torch cannot fit).
    ``model`` is left as it was (mode, parameters, buffers, ``.grad``).

    A linear map (:func:`fedfusion.capture.linear_maps`) that the forward pass never applies
    has zero factors (its GGN is exactly zero); one whose parameters the loss depends on
    although no call of it was captured (see :mod:`fedfusion.capture`) raises a ValueError
    naming it: its Kron block cannot be formed, and the server expects one."""
    if len(x) == 0:
        raise ValueError("curvature needs at least one sample")
    maps = linear_maps(model) if kron else {}
    for lmap in maps.values():
        if lmap.kind == "conv":
            check_kron_module(lmap.weight.removesuffix(".weight"), lmap.module)
    kron_names = {n for m in maps.values() for n in (m.weight, m.bias) if n}
    params = dict(model.named_parameters())
    diag_params = {n: p for n, p in params.items() if n not in kron_names}
    sums: dict[str, list[torch.Tensor]] = {}
    capture = LinearInputs(model, maps, keep_outputs=True)
    # the model's device: ``x`` may stay on the CPU, one batch at a time moves there
    device = model_device(model)
    rows = pass_rows(model, x, batch_size)
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    diag = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in diag_params.items()}
    try:
        for start in range(0, len(x), rows):
            batch = x[start:start + rows].to(device)
            targets = _kron_pass(model, maps, capture, params, batch, generator, sums)
            if diag_params:
                with unfused_attention():
                    for name, value in _squared_sample_grads(model, diag_params, batch,
                                                             targets).items():
                        diag[name] += value.double()
    finally:
        model.train(was_training)
    factors: Factors = {}
    for name, lmap in maps.items():
        if name not in sums:  # never applied: the GGN of its parameters is zero
            log.info("Kron curvature: %r is never applied to an input; zero factors", name)
            out_dim = params[name].shape[0]
            sums[name] = [params[name].new_zeros(out_dim, out_dim),
                          params[name].new_zeros(lmap.in_features, lmap.in_features)]
        b, a = sums[name]
        factors[name] = (b, a / len(x))
        if lmap.bias is not None:
            factors[lmap.bias] = (torch.ones(1, 1, dtype=b.dtype, device=b.device), b.clone())
    return factors, {n: h.to(diag_params[n].dtype) for n, h in diag.items()}


def _accumulate_batch(sums: dict[str, list[torch.Tensor]], maps: dict[str, LinearMap],
                      capture: LinearInputs, params: dict[str, nn.Parameter],
                      loss: torch.Tensor) -> None:
    """Back-propagate one batch's sampled loss to every captured output and add each call's
    ``(sum g g^T, sum a a^T [/ L])`` to ``sums``; refuse a linear map the loss depends on
    whose calls were not captured."""
    calls = [(name, call) for name, recorded in capture.calls.items() for call in recorded]
    unseen = [name for name in maps if name not in capture.calls]
    wrt = [call.output for _, call in calls] + [params[name] for name in unseen]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    for name, g in zip(unseen, grads[len(calls):], strict=True):
        if g is not None:
            raise ValueError(
                f"Kron curvature: the loss depends on {name!r} ({maps[name].kind} map) but no "
                "call of it could be captured (its weight is read without calling the module, "
                "or an nn.MultiheadAttention with one packed projection is used for "
                "cross-attention): it has no Kron block; use hessian_structure='diag' "
                "(curvature-structure diag) for this model")
    for (name, call), g in zip(calls, grads[:len(calls)], strict=True):
        if g is not None:
            _accumulate(sums, name, maps[name].module, call.inputs, g.detach())


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
        model(x[:1].to(model_device(model)))
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


def _kron_pass(model: nn.Module, maps: dict[str, LinearMap], capture: LinearInputs,
               params: dict[str, nn.Parameter], batch: torch.Tensor,
               generator: torch.Generator, sums: dict[str, list[torch.Tensor]]
               ) -> torch.Tensor:
    """One forward and backward pass of ``batch``: the sampled labels ``y~`` (one per row,
    drawn from the model's predictive), and each linear map's ``(sum g g^T, sum a a^T)`` of
    the batch added to ``sums``. ``capture``'s hooks are attached for this pass only (so no
    other pass, such as the per-sample gradients' ``vmap``, leaves its tensors in them) and
    what they captured is dropped before returning: nothing of the batch outlives its pass."""
    capture.clear()
    try:
        with torch.enable_grad(), capture.active():
            logits = model(batch)
            probs = torch.softmax(logits.detach().float(), dim=-1)
            targets = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            if maps:
                _accumulate_batch(sums, maps, capture, params, F.cross_entropy(
                    logits, targets, reduction="sum"))
    finally:
        capture.clear()
    return targets


def _patch_gram(module: nn.Conv2d, inputs: torch.Tensor) -> torch.Tensor:
    """``sum p p^T`` of the im2col patches of ``inputs`` (:func:`patch_rows`)."""
    rows = patch_rows(module, inputs)  # [B L, K]
    return rows.T @ rows


def _accumulate(sums: dict[str, list[torch.Tensor]], name: str, module: nn.Module,
                inputs: torch.Tensor, g: torch.Tensor) -> None:
    """Add one call's ``(sum g g^T, sum a a^T [/ L])`` of a linear map to ``sums`` (a Conv2d's
    patches; a Linear's or an attention projection's rows, positions pooled)."""
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
        with warnings.catch_warnings():  # attention kernels have no batching rule (slower)
            warnings.filterwarnings("ignore", message="There is a performance drop")
            # no_grad outside the transform: ``grad`` still differentiates, but its results
            # do not record a graph back to the model's other parameters (which require
            # grad), a graph that would keep the batch's activations alive in every sum
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
