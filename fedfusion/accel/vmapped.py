"""Train M members of one architecture as ONE computation on a GPU: ``torch.func.vmap`` over
their stacked parameters, one forward and one backward launch sequence per step for all M.

On a GPU a small model's step is bound by kernel launches, not arithmetic: LeNet at batch
64 leaves the card idle between launches, so M members trained one after the other cost M
times the launches of one. Vmapped, the M members' convolutions become one grouped
convolution and their linear layers one batched product, so a step costs about what one
member's step costs. (:mod:`fedfusion.accel.stacked` is the CPU engine; it is limited by
slow CPU kernels instead, and runs its own hand-written layers.)

Each member keeps what :func:`fedfusion.training.train_local` gives it: its initial weights,
its own batch order (its seed's shuffle, drawn on the CPU), its own momentum buffer, and
PyTorch's SGD update (``buf = momentum * buf + grad``, ``w -= lr * buf``; the first ``buf`` is
the gradient itself). Each member's gradient is that of its own mean cross-entropy over its
own batch, equal to the one-by-one result up to float summation order.

Supported: any model ``torch.func.functional_call`` can run under ``vmap`` without buffers
(no BatchNorm running statistics) and without random layers in training mode (dropout with
``p > 0``), every member on one device, with no loss terms (the App asks for it on GPUs
only). Others return ``None`` and train one by one. A client's data moves to the device once
when it is at most :data:`DEVICE_DATA_BYTES`, else a batch of every member at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger("fedfusion")

#: the layers that draw random numbers in training mode (refused: vmap would need its own
#: randomness, so a member would no longer match its one-by-one training)
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
           nn.FeatureAlphaDropout)
#: a client's training inputs up to this size (and a quarter of the GPU's free memory) are
#: copied to the GPU once, not per step
DEVICE_DATA_BYTES = 2**30


def supports(models: Sequence[nn.Module]) -> bool:
    """Whether :func:`train_vmapped` can train ``models`` together: one architecture (the
    same parameter names and shapes, all trainable), no buffers, no active dropout, all on one
    device (the engine runs on the CPU too, where :mod:`fedfusion.accel.stacked` is faster)."""
    if not models or any(type(m) is not type(models[0]) for m in models):
        return False  # the first member's forward runs for all of them
    shapes = [[(n, p.shape) for n, p in m.named_parameters()] for m in models]
    if any(s != shapes[0] for s in shapes) or not shapes[0]:
        return False
    parameters = [p for m in models for p in m.parameters()]
    if len({p.device for p in parameters}) != 1:
        return False
    if len({id(p) for p in parameters}) != len(parameters):
        return False  # members sharing a tensor: trained one by one, each step moves it
    if not all(p.requires_grad for p in parameters):
        return False  # frozen parameters: SGD leaves them, this engine would not
    for module in models[0].modules():
        if isinstance(module, DROPOUT) and module.p > 0:
            return False
        if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            return False
    return not any(True for m in models for _ in m.buffers())


def train_vmapped(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor,
                  epochs: int, lr: float, momentum: float, batch_size: int,
                  seeds: Sequence[int]) -> tuple[float, list[float]] | None:
    """Train ``models`` in place, member m with batch order ``seeds[m]``; returns the wall
    seconds and each member's last-batch loss, or None when :func:`supports` says no or the
    model's forward cannot run under ``vmap`` (an op without a batching rule, data-dependent
    control flow) or the stacked step does not fit in memory: the models are then untouched
    (they are written only at the end) and train one by one."""
    if not supports(models):
        return None
    try:
        return _train(models, x, y, epochs, lr, momentum, batch_size, seeds)
    except RuntimeError as error:  # torch.OutOfMemoryError is one too
        log.warning("fedfusion: the %d members cannot train as one vmapped computation "
                    "(%s: %.200s); training them one by one", len(models),
                    type(error).__name__, error)
        return None


def _train(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, epochs: int,
           lr: float, momentum: float, batch_size: int,
           seeds: Sequence[int]) -> tuple[float, list[float]]:
    device = next(models[0].parameters()).device  # one device: supports() checked
    template = models[0]
    members = [dict(m.named_parameters()) for m in models]
    names = list(members[0])
    weights = {name: torch.stack([member[name].detach() for member in members])
               for name in names}
    velocity = {name: torch.zeros_like(w) for name, w in weights.items()}

    def loss_of(params: dict[str, torch.Tensor], inputs: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        # attention's math kernel has vmap rules; the fused (flash, efficient) ones do not
        with sdpa_kernel(SDPBackend.MATH):
            return F.cross_entropy(functional_call(template, params, (inputs,)), labels)

    step = vmap(grad_and_value(loss_of))
    on_device = x.nbytes <= DEVICE_DATA_BYTES and (
        device.type != "cuda" or x.nbytes <= torch.cuda.mem_get_info(device)[0] // 4)
    xs, ys = (x.to(device), y.to(device)) if on_device else (x, y)
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    n = len(y)
    losses = torch.full((len(models),), float("nan"))
    template.train()
    start = time.perf_counter()
    for _ in range(epochs):
        orders = torch.stack([torch.randperm(n, generator=g) for g in generators])
        if on_device:
            orders = orders.to(device, non_blocking=True)
        for begin in range(0, n, batch_size):
            batch = orders[:, begin:begin + batch_size]
            inputs = xs[batch].to(device, non_blocking=True)
            labels = ys[batch].to(device, non_blocking=True)
            grads, losses = step(weights, inputs, labels)
            for name in names:
                velocity[name].mul_(momentum).add_(grads[name])
                weights[name].sub_(velocity[name], alpha=lr)
    with torch.no_grad():
        for m, (model, member) in enumerate(zip(models, members, strict=True)):
            for name, parameter in member.items():
                parameter.copy_(weights[name][m])
            model.eval()
    final = [float(v) for v in losses.detach().cpu().tolist()]  # waits for the GPU
    return time.perf_counter() - start, final
