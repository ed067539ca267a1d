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

On a GPU, vmapped, a LeNet step is still many small kernels that the CPU launches one by one
through torch.func's dispatch (benchmarks/docs/gpu.md): a full-batch step (gather, forward,
backward, update) is therefore captured once as a CUDA graph and replayed
(:class:`_GraphedStep`; the batch's row indices are its one input). Its first replay is
checked against the same step run eagerly; a capture that fails or disagrees leaves the rest
of the training eager (logged). Partial last batches always run eagerly.

Supported: any model ``torch.func.functional_call`` can run under ``vmap`` without buffers
(no BatchNorm running statistics) and without random layers in training mode (dropout with
``p > 0``), every member on one device, with no loss terms (the App asks for it on GPUs
only). Others return ``None`` and train one by one. A client's data moves to the device once
when it is at most :data:`DEVICE_DATA_BYTES`, else a batch of every member at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fedfusion import cuda_graphs

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
                  seeds: Sequence[int], *, cuda_graphs: bool = True
                  ) -> tuple[float, list[float]] | None:
    """Train ``models`` in place, member m with batch order ``seeds[m]``; returns the wall
    seconds and each member's last-batch loss, or None when :func:`supports` says no or the
    model's forward cannot run under ``vmap`` (an op without a batching rule, data-dependent
    control flow) or the stacked step does not fit in memory: the models are then untouched
    (they are written only at the end) and train one by one. ``cuda_graphs``: on a CUDA
    device with the data there, replay full-batch steps as one CUDA graph (no effect
    elsewhere)."""
    if not supports(models):
        return None
    try:
        return _train(models, x, y, epochs, lr, momentum, batch_size, seeds,
                      use_graphs=cuda_graphs)
    except RuntimeError as error:  # torch.OutOfMemoryError is one too
        log.warning("fedfusion: the %d members cannot train as one vmapped computation "
                    "(%s: %.200s); training them one by one", len(models),
                    type(error).__name__, error)
        return None


def _train(models: Sequence[nn.Module], x: torch.Tensor, y: torch.Tensor, epochs: int,
           lr: float, momentum: float, batch_size: int, seeds: Sequence[int],
           use_graphs: bool) -> tuple[float, list[float]]:
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

    gradient = vmap(grad_and_value(loss_of))
    on_device = x.nbytes <= DEVICE_DATA_BYTES and (
        device.type != "cuda" or x.nbytes <= torch.cuda.mem_get_info(device)[0] // 4)
    xs, ys = (x.to(device), y.to(device)) if on_device else (x, y)

    def step(batch: torch.Tensor) -> torch.Tensor:
        """One SGD step of every member on its rows ``batch[m]``; the members' losses."""
        inputs = xs[batch].to(device, non_blocking=True)
        labels = ys[batch].to(device, non_blocking=True)
        grads, losses = gradient(weights, inputs, labels)
        for name in names:
            velocity[name].mul_(momentum).add_(grads[name])
            weights[name].sub_(velocity[name], alpha=lr)
        return losses

    n = len(y)
    graphed = (_GraphedStep(step, [*weights.values(), *velocity.values()],
                            (len(models), batch_size), device)
               if use_graphs and on_device and _graphable(device)
               and epochs * (n // batch_size) >= _GraphedStep.MIN_FULL_STEPS else None)
    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    losses = torch.full((len(models),), float("nan"))
    template.train()
    start = time.perf_counter()
    for _ in range(epochs):
        orders = torch.stack([torch.randperm(n, generator=g) for g in generators])
        if on_device:
            orders = orders.to(device, non_blocking=True)
        for begin in range(0, n, batch_size):
            batch = orders[:, begin:begin + batch_size]
            full = batch.shape[1] == batch_size
            losses = graphed(batch) if graphed is not None and full else step(batch)
    with torch.no_grad():
        for m, (model, member) in enumerate(zip(models, members, strict=True)):
            for name, parameter in member.items():
                parameter.copy_(weights[name][m])
            model.eval()
    final = [float(v) for v in losses.detach().cpu().tolist()]  # waits for the GPU
    return time.perf_counter() - start, final


def _graphable(device: torch.device) -> bool:
    """Whether steps on ``device`` can be replayed as CUDA graphs: a CUDA device, in a
    process where no capture has failed."""
    return device.type == "cuda" and not cuda_graphs.capture_failed()


class _GraphedStep:
    """A full-batch :func:`_train` step replayed as one CUDA graph (:mod:`fedfusion.cuda_graphs`).
    The step's one input is the batch's row indices, copied into :attr:`index`; its state
    (``state``: the stacked weights and momentum buffers, every tensor the step writes) is
    updated in place, so the graph reads and writes the same memory as the eager step.
    Warm-up steps run eagerly on the side stream the graph is captured on; the first replay
    is checked against the same step run eagerly from the same state, and a capture that
    fails or disagrees leaves every later step eager."""

    #: eager steps before the capture (torch.cuda.graphs' recipe)
    WARMUP = 3
    #: fewer full-batch steps than this in the whole training: no capture (it costs a device
    #: synchronisation and an emptied allocator cache)
    MIN_FULL_STEPS = 16
    #: how far the first replay may be from the eager step, per tensor (the same kernels)
    RTOL, ATOL = 1e-4, 1e-5

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor],
                 state: Sequence[torch.Tensor], shape: tuple[int, int],
                 device: torch.device) -> None:
        self.step, self.state, self.device = step, state, device
        self.index = torch.zeros(shape, dtype=torch.long, device=device)
        self.side = cuda_graphs.side_stream(device)
        self.replay: Callable[[], torch.Tensor] | None = None
        self.warmups_left = self.WARMUP
        self.eager = False  # a capture failed or disagreed

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        self.index.copy_(batch)
        if self.eager or self.warmups_left > 0:
            self.warmups_left -= 1
            return self._eager()
        if self.replay is None:
            return self._capture_and_check()
        return self.replay()

    def _eager(self) -> torch.Tensor:
        return cuda_graphs.on_side_stream(lambda: self.step(self.index), self.device,
                                          self.side)

    def _capture_and_check(self) -> torch.Tensor:
        before = [t.clone() for t in self.state]
        replay = cuda_graphs.try_capture(lambda: self.step(self.index), self.device,
                                         self.side, "the vmapped training step")
        if replay is None:
            self._restore(before)  # a capture runs nothing; one copy makes sure of it
            self.eager = True
            return self._eager()
        losses = replay()
        replayed = [t.clone() for t in self.state]
        self._restore(before)
        eager_losses = self._eager()
        if self._agree([*replayed, losses], [*self.state, eager_losses]):
            self.replay = replay
        else:
            log.warning("fedfusion: the vmapped training step's CUDA graph differs from its "
                        "eager step; its steps stay eager")
            self.eager = True
        return eager_losses

    @classmethod
    def _agree(cls, replayed: Sequence[torch.Tensor], eager: Sequence[torch.Tensor]) -> bool:
        return all(torch.allclose(r, t, rtol=cls.RTOL, atol=cls.ATOL)
                   for r, t in zip(replayed, eager, strict=True))

    def _restore(self, saved: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, value in zip(self.state, saved, strict=True):
                t.copy_(value)
