"""Train M members of one architecture as ONE computation: stacked parameters, one forward
and one backward pass per step for all M members, each member its own SGD.

:func:`fedfusion.training.train_members` uses this engine when it knows every layer of the
model (:func:`compile_members`) and falls back to one :func:`~fedfusion.training.train_local`
per member otherwise. Each member keeps its own initial weights, its own batch order (its
seed's shuffle), its own momentum buffer and its own loss terms; a step computes, for every
member at once, exactly the gradient that member's own step would (the same mean
cross-entropy over its own batch), up to float summation order.

Why not autograd over PyTorch's layers: on one CPU core a small model's step is limited not
by per-op overhead but by PyTorch's slow kernels at these sizes (``max_pool2d`` and its
scatter backward, oneDNN's weight gradient of a few-channel convolution); grouped
convolutions over channel-stacked members inherit the same kernels, and ``torch.compile`` on
the CPU is slower than eager (benchmarks/docs/throughput.md). Here every layer is written as
a few large, regular operations over all members:

* convolutions run member by member inside one compiled kernel (:mod:`fedfusion.accel.kernels`)
  where that is fastest, else as im2col + one batched GEMM (``torch.bmm``) per pass or as
  PyTorch's own convolution per member (:class:`StackedConv2d`); every buffer is reused from step to
  step (a fresh large buffer page-faults at every step);
* a 2x2 max-pool and the ReLU next to it are one compiled kernel, or, without a C compiler,
  three ``maximum`` of the windows' corners with the first-maximum choice kept as masks; both
  route each gradient to the same position as PyTorch's ``max_pool2d`` (the first maximum in
  row-major window order);
* the backward pass is written by hand (no autograd graph), and a layer's weight gradient can
  be skipped (``weight_grads``, for the curvature fit of :mod:`fedfusion.accel.fast_kron`).

Layout: feature maps are ``[M, C, B, H, W]`` (member, channel, sample, height, width) views,
most of them stored per member as NCHW batches (``[M, B, C, H, W]``); flat features are
``[M, B, F]`` views, stored feature-major (``[M, F, B]``) after a linear layer.

Supported: ``nn.Conv2d`` (groups 1, zero padding, any stride and dilation, with or without
bias), ``nn.Linear``, ``nn.ReLU``, ``nn.MaxPool2d(2)`` (kernel 2, stride 2, no padding or
dilation), ``nn.Flatten()`` and ``nn.Identity`` (also ``F.relu`` / ``torch.flatten(x, 1)``
and their method forms), chained one after the other as ``torch.fx`` traces the model, float32
on the CPU, with no buffers; the loss terms supported are FedProx's
:class:`~fedfusion.training.ProximalTerm` on the member's own parameters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.nn import functional as F

from fedfusion.accel import kernels
from fedfusion.loss_terms import ProximalTerm


class _Workspace:
    """Named buffers reused from step to step (a smaller last batch views the same memory).
    The views handed out are kept too: a step asks for ~6 buffers per layer, and building a
    view each time cost ~7 us apiece."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}
        self._views: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32
            ) -> torch.Tensor:
        key = (name, tuple(shape), dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype:
            flat = torch.empty(numel, dtype=dtype)
            self._flat[name] = flat
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
        view = self._views[key] = flat[:numel].view(key[1])
        return view


class _Layer:
    """One stage of the stacked network. ``forward`` keeps what ``backward`` needs;
    ``backward`` returns the gradient of its input (None when ``needs_input_grad`` is False)
    and writes the gradients of its parameters into ``grads``."""

    #: stacked parameters of this layer, [M, *shape] each, with the member modules' names
    params: list[tuple[str, torch.Tensor]]
    needs_input_grad: bool = True
    #: False: ``backward`` leaves ``grads`` alone (a curvature fit needs the output gradients
    #: of the layers, not the parameters' gradients)
    weight_grads: bool = True

    def __init__(self, name: str, workspace: _Workspace):
        self.name = name
        self.ws = workspace
        self.params = []
        self.grads: list[torch.Tensor] = []

    def buffer(self, what: str, shape: Sequence[int], dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
        return self.ws.get(f"{self.name}/{what}", shape, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError


#: memory order of a per-member NCHW map ``[M, C, B, H, W]`` stored as ``[M, B, C, H, W]``
_PER_MEMBER_NCHW = (0, 2, 1, 3, 4)


def _contiguous_per_member(workspace: _Workspace, name: str, t: torch.Tensor) -> torch.Tensor:
    """``[M, C, B, H, W]`` -> its per-member NCHW storage ``[M, B, C, H, W]``, contiguous (a
    view when it already is, else a copy into a reused buffer)."""
    per_member = t.transpose(1, 2)
    if per_member.is_contiguous():
        return per_member
    return workspace.get(name, per_member.shape).copy_(per_member)


def _per_member_nchw(workspace: _Workspace, name: str, m: int, c: int, b: int, h: int, w: int
                     ) -> torch.Tensor:
    """A ``[M, C, B, H, W]`` buffer stored as ``[M, B, C, H, W]``: each member's maps are one
    contiguous NCHW batch (what PyTorch's convolutions take, and a flatten is then a view)."""
    return workspace.get(name, (m, b, c, h, w)).transpose(1, 2)


def _dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of ``t`` from outermost to innermost in memory."""
    return tuple(sorted(range(t.ndim), key=lambda d: (-t.stride(d), d)))


def _ordered(workspace: _Workspace, name: str, shape: Sequence[int], order: Sequence[int]
             ) -> torch.Tensor:
    """A buffer of ``shape`` laid out in memory in the dim ``order`` (see :func:`_dim_order`),
    so that ops between it and a tensor of that order run on contiguous memory."""
    stored = workspace.get(name, [shape[d] for d in order])
    return stored.permute([order.index(d) for d in range(len(order))])


class StackedConv2d(_Layer):
    """A convolution of all members, by one of three strategies (fixed at the first forward
    pass, from the map size):

    * ``kernel``: the compiled direct convolution of :mod:`fedfusion.accel.kernels` for the forward
      pass, the weight gradient (stride 1, no padding or dilation, all output channels in
      one register block: :func:`fedfusion.accel.kernels.one_block`) and the input gradient where
      its accumulators fit in registers (:func:`fedfusion.accel.kernels.input_grad_block`; else
      PyTorch's), where it beats oneDNN (LeNet's layers);
    * ``gemm``: im2col into a reused buffer + one batched GEMM per pass, for small patches
      (``C_in * kh * kw <= 32``) otherwise;
    * ``native``: PyTorch's own convolution, forward and backward, member by member on its
      contiguous NCHW batch: the fastest for the rest (the CNN's layers).
    The timings behind the choice: benchmarks/docs/throughput.md.
    """

    #: largest patch (C_in * kh * kw) the ``gemm`` strategy is used for
    SMALL_PATCH = 32

    def __init__(self, name: str, workspace: _Workspace, convs: Sequence[nn.Conv2d],
                 use_kernels: bool):
        super().__init__(name, workspace)
        conv = convs[0]
        self.conv = conv
        self.kh, self.kw = conv.kernel_size
        self.sh, self.sw = conv.stride
        self.dh, self.dw = conv.dilation
        self.ph, self.pw = conv.padding  # type: ignore[misc]  # checked to be a tuple
        self.out_channels = conv.out_channels
        self.use_kernels = use_kernels and (
            self.sh, self.sw, self.dh, self.dw, self.ph, self.pw) == (1, 1, 1, 1, 0, 0)
        self.strategy = ""  # decided at the first forward pass
        self.kernels: kernels.ConvKernels | None = None
        self.params.append((f"{name}.weight", _stack([c.weight for c in convs])))
        if conv.bias is not None:
            self.params.append((f"{name}.bias", _stack([c.bias for c in convs])))

    @property
    def weight(self) -> torch.Tensor:
        return self.params[0][1]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.params[1][1] if len(self.params) > 1 else None

    def _choose(self, height: int, width: int) -> str:
        if self.use_kernels and height >= self.kh and width >= self.kw and kernels.one_block(
                self.out_channels, width - self.kw + 1):
            compiled = self.kernels
            if compiled is None or (compiled.h, compiled.w) != (height, width):
                compiled = self.kernels = kernels.conv_kernels(
                    self.conv.in_channels, self.out_channels, height, width, self.kh, self.kw)
            if compiled is not None:
                return "kernel"
        small = self.conv.in_channels * self.kh * self.kw <= self.SMALL_PATCH
        return "gemm" if small else "native"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.in_shape = tuple(h.shape)
        if not self.strategy or (self.strategy == "kernel" and self.kernels is not None and (
                self.kernels.h, self.kernels.w) != tuple(h.shape[-2:])):
            self.strategy = self._choose(*h.shape[-2:])
        if self.strategy == "kernel":
            return self._forward_kernel(h)
        return self._forward_gemm(h) if self.strategy == "gemm" else self._forward_native(h)

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        if self.strategy == "kernel":
            return self._backward_kernel(g)
        return self._backward_gemm(g) if self.strategy == "gemm" else self._backward_native(g)

    # -- kernel: the compiled direct convolution ----------------------------------------------

    def _forward_kernel(self, h: torch.Tensor) -> torch.Tensor:
        assert self.kernels is not None
        m, c, b, height, width = h.shape
        self.inputs = _contiguous_per_member(self.ws, f"{self.name}/inputs", h)
        ho, wo = self.kernels.out_hw
        out = self.buffer("out", (m, b, self.out_channels, ho, wo))
        self.kernels.forward(self.inputs, self.weight, self.bias, out)
        return out.transpose(1, 2)

    def _backward_kernel(self, g: torch.Tensor) -> torch.Tensor | None:
        assert self.kernels is not None
        grads = _contiguous_per_member(self.ws, f"{self.name}/grad_out", g)
        if self.weight_grads:
            self.kernels.weight_grad(self.inputs, grads, self.grads[0])
            if self.bias is not None:
                torch.sum(grads, dim=(1, 3, 4), out=self.grads[1])
        if not self.needs_input_grad:
            return None
        m, c, b, height, width = self.in_shape
        grad_in = _per_member_nchw(self.ws, f"{self.name}/grad_in", m, c, b, height, width)
        if self.kernels.has_input_grad:
            self.kernels.input_grad(grads, self.weight, grad_in.transpose(1, 2))
            return grad_in
        for i in range(m):  # PyTorch's input gradient (see the class doc)
            gx = torch.ops.aten.convolution_backward(
                grads[i], self.inputs[i], self.weight[i], None, [1, 1], [0, 0], [1, 1], False,
                [0, 0], 1, [True, False, False])[0]
            grad_in.transpose(1, 2)[i].copy_(gx)
        return grad_in

    # -- native: PyTorch's convolution per member --------------------------------------------

    def _forward_native(self, h: torch.Tensor) -> torch.Tensor:
        m, c, b, height, width = h.shape
        inputs = h.transpose(1, 2)  # [M, B, C, H, W]
        if not inputs.is_contiguous():
            inputs = self.buffer("inputs", inputs.shape).copy_(inputs)
        self.inputs = inputs
        ho = (height + 2 * self.ph - self.dh * (self.kh - 1) - 1) // self.sh + 1
        wo = (width + 2 * self.pw - self.dw * (self.kw - 1) - 1) // self.sw + 1
        out = self.buffer("out", (m, b, self.out_channels, ho, wo))
        for i in range(m):  # into the stacked buffer directly (a stack of outputs: +20%)
            torch.ops.aten.convolution.out(
                inputs[i], self.weight[i], None if self.bias is None else self.bias[i],
                list(self.conv.stride), [self.ph, self.pw], list(self.conv.dilation), False,
                [0, 0], 1, out=out[i])
        return out.transpose(1, 2)

    def _backward_native(self, g: torch.Tensor) -> torch.Tensor | None:
        m, c, b, height, width = self.in_shape
        grads = g.transpose(1, 2)  # [M, B, O, Ho, Wo]
        mask = [self.needs_input_grad, self.weight_grads,
                self.weight_grads and self.bias is not None]
        if not any(mask):
            return None
        grad_in = (_per_member_nchw(self.ws, f"{self.name}/grad_in", m, c, b, height, width)
                   if self.needs_input_grad else None)
        for i in range(m):
            gx, gw, gb = torch.ops.aten.convolution_backward(
                grads[i], self.inputs[i], self.weight[i], None if self.bias is None else [0],
                self.conv.stride, self.conv.padding, self.conv.dilation, False, [0, 0], 1, mask)
            if self.weight_grads:
                self.grads[0][i].copy_(gw)
                if self.bias is not None:
                    self.grads[1][i].copy_(gb)
            if grad_in is not None:
                grad_in.transpose(1, 2)[i].copy_(gx)
        return grad_in

    # -- gemm: im2col + batched GEMM ------------------------------------------------------------

    def patches(self, h: torch.Tensor) -> torch.Tensor:
        """im2col of ``[M, C, B, H, W]`` maps: ``[M, C * kh * kw, B * Ho * Wo]`` (in PyTorch's
        weight order), in a reused buffer; sets ``out_hw``."""
        m, c, b, height, width = h.shape
        if self.ph or self.pw:
            padded = self.buffer("padded", (m, c, b, height + 2 * self.ph, width + 2 * self.pw))
            padded.zero_()
            padded[..., self.ph:self.ph + height, self.pw:self.pw + width] = h
            h = padded
        hp, wp = h.shape[-2:]
        ho = (hp - self.dh * (self.kh - 1) - 1) // self.sh + 1
        wo = (wp - self.dw * (self.kw - 1) - 1) // self.sw + 1
        self.out_hw = (ho, wo)
        sm, sc, sb, sy, sx = h.stride()
        windows = h.as_strided(
            (m, c, self.kh, self.kw, b, ho, wo),
            (sm, sc, self.dh * sy, self.dw * sx, sb, self.sh * sy, self.sw * sx),
            h.storage_offset())
        cols = self.buffer("cols", windows.shape)
        cols.copy_(windows)
        return cols.view(m, c * self.kh * self.kw, b * ho * wo)

    def _forward_gemm(self, h: torch.Tensor) -> torch.Tensor:
        m, c, b, height, width = h.shape
        self.cols = self.patches(h)
        ho, wo = self.out_hw
        k, n = self.cols.shape[1:]
        out = self.buffer("out", (m, self.out_channels, n))
        weight = self.weight.view(m, self.out_channels, k)
        if self.bias is not None:
            torch.baddbmm(self.bias.unsqueeze(2), weight, self.cols, out=out)
        else:
            torch.bmm(weight, self.cols, out=out)
        return out.view(m, self.out_channels, b, ho, wo)

    def _backward_gemm(self, g: torch.Tensor) -> torch.Tensor | None:
        m, c, b, height, width = self.in_shape
        ho, wo = self.out_hw
        k = self.cols.shape[1]
        g = g.reshape(m, self.out_channels, -1)
        if self.weight_grads:
            torch.bmm(g, self.cols.transpose(1, 2),
                      out=self.grads[0].view(m, self.out_channels, k))
            if self.bias is not None:
                torch.sum(g, dim=2, out=self.grads[1])
        if not self.needs_input_grad:
            return None
        # the patches are no longer needed: their gradient goes into the same buffer
        weight = self.weight.view(m, self.out_channels, k)
        gcols = torch.bmm(weight.transpose(1, 2), g, out=self.cols)
        gcols = gcols.view(m, c, self.kh, self.kw, b, ho, wo)
        hp, wp = height + 2 * self.ph, width + 2 * self.pw
        gx = _per_member_nchw(self.ws, f"{self.name}/grad_in", m, c, b, hp, wp)
        gx.zero_()
        for i in range(self.kh):  # col2im: every kernel offset adds its shifted window
            for j in range(self.kw):
                y0, x0 = i * self.dh, j * self.dw
                gx[..., y0:y0 + self.sh * (ho - 1) + 1:self.sh,
                   x0:x0 + self.sw * (wo - 1) + 1:self.sw].add_(gcols[:, :, i, j])
        if self.ph or self.pw:
            return gx[..., self.ph:self.ph + height, self.pw:self.pw + width]
        return gx


class StackedLinear(_Layer):
    """Batched matmul on ``[M, B, F]``. Outputs and input gradients are stored feature-major
    (``[M, F, B]`` buffers, returned as ``[M, B, F]`` views): every GEMM then reads or writes
    ``[F, B]`` matrices, faster for the MLP's layers than ``[B, F]`` ones."""

    def __init__(self, name: str, workspace: _Workspace, linears: Sequence[nn.Linear]):
        super().__init__(name, workspace)
        self.params.append((f"{name}.weight", _stack([lin.weight for lin in linears])))
        if linears[0].bias is not None:
            self.params.append((f"{name}.bias", _stack([lin.bias for lin in linears])))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.input = h
        weight = self.params[0][1]
        out = self.buffer("out", (h.shape[0], weight.shape[1], h.shape[1]))  # [M, out, B]
        if len(self.params) > 1:
            torch.baddbmm(self.params[1][1].unsqueeze(2), weight, h.transpose(1, 2), out=out)
        else:
            torch.bmm(weight, h.transpose(1, 2), out=out)
        return out.transpose(1, 2)

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        if self.weight_grads:
            torch.bmm(g.transpose(1, 2), self.input, out=self.grads[0])
            if len(self.params) > 1:
                torch.sum(g, dim=1, out=self.grads[1])
        if not self.needs_input_grad:
            return None
        weight = self.params[0][1]
        m, b, features = self.input.shape
        grad_in = self.buffer("grad_in", (m, features, b))
        return torch.bmm(weight.transpose(1, 2), g.transpose(1, 2), out=grad_in).transpose(1, 2)


class _ReLU(_Layer):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # every layer's output is its own buffer, and no layer needs its output for its
        # backward pass, so the ReLU may overwrite it
        self.out = h.relu_()
        return self.out

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        return torch.ops.aten.threshold_backward(g, self.out, 0)


class _MaxPool2x2(_Layer):
    """2x2 max-pool, stride 2, on ``[..., H, W]``, optionally fused with a ReLU (either order:
    ``relu(max(a)) == max(relu(a))``, and a window whose maximum is <= 0 passes no gradient
    in both orders). The gradient goes to the first maximum in row-major window order, as
    PyTorch's ``max_pool2d`` does (ties are common: constant image background).

    The input is first copied corner by corner into four contiguous maps in the input's
    memory order, and every later op runs on contiguous tensors of that one order:
    elementwise ops on stride-2 views, or on operands of different orders, run ~6x slower
    (measured); a copy costs about one such op. The choices are float 0/1 masks: a
    float * bool product first converts the bool tensor."""

    def __init__(self, name: str, workspace: _Workspace, relu: bool, use_kernels: bool):
        super().__init__(name, workspace)
        self.relu = relu
        self._zeroed: tuple[int, tuple[int, ...]] | None = None
        self.kernels = kernels.pool_kernels() if use_kernels else None

    @staticmethod
    def _corners(a: torch.Tensor) -> list[torch.Tensor]:
        """The stride-2 views of the windows' four corners (row-major) of ``[..., H, W]``."""
        h2, w2 = a.shape[-2] // 2 * 2, a.shape[-1] // 2 * 2
        return [a[..., i:h2:2, j:w2:2] for i in (0, 1) for j in (0, 1)]

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        self.in_shape = tuple(a.shape)
        if self.kernels is not None:
            return self._forward_kernel(a)
        self.in_order = _dim_order(a)
        m, c, b, height, width = a.shape
        pooled = (m, c, b, height // 2, width // 2)

        def buffer(name: str) -> torch.Tensor:  # pooled size, in the input's memory order
            return _ordered(self.ws, f"{self.name}/{name}", pooled, self.in_order)

        # four copies, one per corner (a single 7-D copy of all four was 8x slower)
        q00, q01, q10, q11 = (buffer(f"corner{i}").copy_(corner)
                              for i, corner in enumerate(self._corners(a)))
        # s01: the right element of the top pair wins (strictly greater: ties go left);
        # s23 the same for the bottom pair; s: the bottom pair wins over the top pair
        self.s01 = torch.gt(q01, q00, out=buffer("s01"))
        self.s23 = torch.gt(q11, q10, out=buffer("s23"))
        top = torch.maximum(q00, q01, out=buffer("top"))
        bottom = torch.maximum(q10, q11, out=buffer("bottom"))
        self.s = torch.gt(bottom, top, out=buffer("s"))
        out = torch.maximum(top, bottom, out=buffer("out"))
        if self.relu:
            out.relu_()
        self.out = out
        if self.in_order != _PER_MEMBER_NCHW:  # the next layer wants per-member NCHW
            out = _per_member_nchw(self.ws, f"{self.name}/out_nchw", *pooled).copy_(out)
        return out

    def _forward_kernel(self, a: torch.Tensor) -> torch.Tensor:
        assert self.kernels is not None
        m, c, b, height, width = a.shape
        inputs = _contiguous_per_member(self.ws, f"{self.name}/inputs", a)
        out = self.buffer("out", (m, b, c, height // 2, width // 2))
        self.choices = self.buffer("choices", out.shape, torch.int32)
        self.kernels.forward(inputs, out, self.choices, self.relu)
        return out.transpose(1, 2)

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        m, c, b, height, width = self.in_shape
        if self.kernels is not None:
            grads = _contiguous_per_member(self.ws, f"{self.name}/grad_out", g)
            grad_in = self.buffer("grad_in", (m, b, c, height, width))
            self.kernels.backward(grads, self.choices, grad_in)
            return grad_in.transpose(1, 2)
        pooled = (m, c, b, height // 2, width // 2)

        def buffer(name: str) -> torch.Tensor:
            return _ordered(self.ws, f"{self.name}/{name}", pooled, self.in_order)

        if _dim_order(g) != self.in_order:
            g = buffer("g").copy_(g)
        if self.relu:
            g = torch.ops.aten.threshold_backward(g, self.out, 0)
        grad = _ordered(self.ws, f"{self.name}/grad_in", self.in_shape, self.in_order)
        if (height % 2 or width % 2) and self._zeroed != (grad.data_ptr(), grad.shape):
            grad.zero_()  # the last row / column of an odd map is never written
            self._zeroed = (grad.data_ptr(), grad.shape)
        g00, g01, g10, g11 = self._corners(grad)
        bottom = torch.mul(g, self.s, out=buffer("g_bottom"))
        top = torch.sub(g, bottom, out=buffer("g_top"))
        torch.mul(top, self.s01, out=g01)
        torch.sub(top, g01, out=g00)
        torch.mul(bottom, self.s23, out=g11)
        torch.sub(bottom, g11, out=g10)
        return grad


class _Flatten(_Layer):
    """``[M, C, B, H, W]`` -> ``[M, B, C * H * W]`` in PyTorch's (c, h, w) order; a no-op on
    flat features."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.in_shape = tuple(h.shape)
        if h.ndim == 3:
            return h
        m, c, b, height, width = h.shape
        per_member = h.transpose(1, 2)
        if not per_member.is_contiguous():
            per_member = self.buffer("out", per_member.shape).copy_(per_member)
        return per_member.view(m, b, c * height * width)

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        if len(self.in_shape) == 3:
            return g
        m, c, b, height, width = self.in_shape
        return g.view(m, b, c, height, width).transpose(1, 2)


class _Identity(_Layer):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def backward(self, g: torch.Tensor) -> torch.Tensor | None:
        return g


def _stack(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors if t is not None]).contiguous()


# --- planning: which models the engine runs ------------------------------------------------

#: one traced stage: ("conv"|"linear"|"relu"|"pool"|"flatten"|"identity", module name or "")
_Stage = tuple[str, str]


def _stage_of(node: fx.Node, modules: dict[str, nn.Module]) -> _Stage | None:
    """The supported stage a traced node is, or None."""
    if node.op == "call_module":
        module = modules[str(node.target)]
        if len(node.args) != 1 or node.kwargs:
            return None
        if isinstance(module, nn.Conv2d):
            ok = (module.groups == 1 and module.padding_mode == "zeros"
                  and isinstance(module.padding, tuple))
            return ("conv", str(node.target)) if ok else None
        if isinstance(module, nn.Linear):
            return "linear", str(node.target)
        if isinstance(module, nn.ReLU):
            return "relu", ""
        if isinstance(module, nn.MaxPool2d):
            ok = (_pair(module.kernel_size) == (2, 2) and _pair(module.stride) == (2, 2)
                  and _pair(module.padding) == (0, 0) and _pair(module.dilation) == (1, 1)
                  and not module.ceil_mode and not module.return_indices)
            return ("pool", "") if ok else None
        if isinstance(module, nn.Flatten):
            return ("flatten", "") if (module.start_dim, module.end_dim) == (1, -1) else None
        if isinstance(module, nn.Identity):
            return "identity", ""
        return None
    relu_functions: tuple[Callable[..., object], ...] = (F.relu, torch.relu)
    if node.op == "call_function" and node.target in relu_functions:
        return ("relu", "") if len(node.args) == 1 else None
    if node.op == "call_function" and node.target is torch.flatten:
        return ("flatten", "") if tuple(node.args[1:]) == (1,) and not node.kwargs else None
    if node.op == "call_method" and node.target == "relu" and len(node.args) == 1:
        return "relu", ""
    if node.op == "call_method" and node.target == "flatten":
        return ("flatten", "") if tuple(node.args[1:]) == (1,) and not node.kwargs else None
    return None


def _pair(value: int | Sequence[int]) -> tuple[int, ...]:
    return (value, value) if isinstance(value, int) else tuple(value)


def trace_stages(model: nn.Module) -> list[_Stage] | None:
    """The model as a chain of supported stages, or None if it is not one."""
    if any(True for _ in model.buffers()):
        return None
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception:  # models with data-dependent control flow do not trace
        return None
    modules = dict(model.named_modules())
    stages: list[_Stage] = []
    previous: fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                return None  # a second input
            previous = node
            continue
        if node.op == "output":
            return stages if node.args[0] is previous and stages else None
        stage = _stage_of(node, modules)
        if stage is None or node.args[0] is not previous or len(node.users) != 1:
            return None
        stages.append(stage)
        previous = node
    return None


@dataclass
class StackedNetwork:
    """M members of one traced architecture with stacked parameters (see the module doc)."""

    models: list[nn.Module]
    layers: list[_Layer]
    #: per stacked parameter: FedProx weight per member [M] and reference [M, *shape]
    prox: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    workspace: _Workspace = field(default_factory=_Workspace)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for layer in self.layers for _, p in layer.params]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer.forward(h)
        return h

    def backward(self, g: torch.Tensor) -> None:
        for layer in reversed(self.layers):
            if not (layer.params or layer.needs_input_grad):
                break  # layers before the first parameter need no gradient
            result = layer.backward(g)
            if result is None:
                break
            g = result

    def write_back(self) -> None:
        """Copy each member's trained parameters into its module."""
        with torch.no_grad():
            for layer in self.layers:
                for name, stacked in layer.params:
                    for m, model in enumerate(self.models):
                        model.get_parameter(name).copy_(stacked[m])


def compile_members(models: Sequence[nn.Module], x: torch.Tensor,
                    loss_terms: Sequence[Sequence[object]], use_kernels: bool | None = None
                    ) -> StackedNetwork | None:
    """A :class:`StackedNetwork` over ``models``, or None when the engine cannot train them
    faithfully (unknown layer, different architectures, buffers, non-float32 or non-CPU
    tensors, a loss term other than a FedProx term on the member itself). ``use_kernels``:
    whether to use the compiled kernels of :mod:`fedfusion.accel.kernels` where they help (default:
    unless ``FEDFUSION_NO_KERNELS`` is set); without them the engine uses PyTorch ops only."""
    if use_kernels is None:
        use_kernels = not kernels.disabled()
    if not models or x.dtype != torch.float32 or x.device.type != "cpu" or x.ndim not in (2, 4):
        return None
    reference = {k: (v.shape, v.dtype, v.device) for k, v in models[0].state_dict().items()}
    for model in models:
        params = dict(model.named_parameters())
        if type(model) is not type(models[0]) or {
                k: (v.shape, v.dtype, v.device) for k, v in model.state_dict().items()
        } != reference or set(params) != set(reference):
            return None
        if any(p.dtype != torch.float32 or p.device.type != "cpu" or not p.requires_grad
               for p in params.values()):
            return None
    for model, terms in zip(models, loss_terms, strict=True):
        for term in terms:
            if not (type(term) is ProximalTerm and term.params == dict(model.named_parameters())):
                return None
    stages = trace_stages(models[0])
    if stages is None:
        return None
    workspace = _Workspace()
    layers: list[_Layer] = []
    spatial = x.ndim == 4
    index = 0
    while index < len(stages):
        kind, name = stages[index]
        following = stages[index + 1][0] if index + 1 < len(stages) else ""
        label = f"{index}:{kind}"
        if kind == "conv":
            if not spatial:
                return None
            layers.append(StackedConv2d(name, workspace, [m.get_submodule(name) for m in models],
                                  use_kernels))
        elif kind == "linear":
            if spatial:
                return None
            layers.append(StackedLinear(name, workspace, [m.get_submodule(name) for m in models]))
        elif kind in ("relu", "pool") and {kind, following} == {"relu", "pool"}:
            if not spatial:
                return None
            layers.append(_MaxPool2x2(label, workspace, relu=True, use_kernels=use_kernels))
            index += 1
        elif kind == "pool":
            if not spatial:
                return None
            layers.append(_MaxPool2x2(label, workspace, relu=False, use_kernels=use_kernels))
        elif kind == "relu":
            layers.append(_ReLU(label, workspace))
        elif kind == "flatten":
            layers.append(_Flatten(label, workspace))
            spatial = False
        else:
            layers.append(_Identity(label, workspace))
        index += 1
    if spatial:
        return None  # the logits must be [B, classes]
    covered = {name for layer in layers for name, _ in layer.params}
    if covered != set(dict(models[0].named_parameters())):
        return None  # a parameter outside the traced layers (a FedProx term would move it)
    first = next((i for i, layer in enumerate(layers) if layer.params), None)
    if first is None:
        return None
    for i, layer in enumerate(layers):
        layer.needs_input_grad = i > first
        layer.grads = [torch.empty_like(p) for _, p in layer.params]
    net = StackedNetwork(list(models), layers, workspace=workspace)
    if any(loss_terms):
        net.prox = _stacked_prox(net, loss_terms)
    return net


def _stacked_prox(net: StackedNetwork, loss_terms: Sequence[Sequence[object]]
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per stacked parameter: (mu per member, reference per member); the mus of a member's
    several terms add up, as their losses do."""
    result = []
    for layer in net.layers:
        for name, stacked in layer.params:
            mus = torch.zeros(len(net.models))
            reference = torch.zeros_like(stacked)
            weighted = torch.zeros_like(stacked)
            for m, terms in enumerate(loss_terms):
                for term in terms:
                    mus[m] += term.mu  # type: ignore[attr-defined]
                    weighted[m] += term.mu * term.reference[name]  # type: ignore[attr-defined]
                if mus[m] > 0:
                    reference[m] = weighted[m] / mus[m]
            result.append((mus.view(-1, *[1] * (stacked.ndim - 1)), reference))
    return result


def train_stacked(net: StackedNetwork, x: torch.Tensor, y: torch.Tensor, epochs: int,
                  lr: float, momentum: float, batch_size: int, seeds: Sequence[int]
                  ) -> tuple[float, list[float]]:
    """SGD with momentum for every member of ``net`` on ``(x, y)``; member m's batch order is
    ``torch.randperm`` of a generator seeded with ``seeds[m]``, one per epoch, as in
    :func:`fedfusion.training.train_local`. Returns (seconds, each member's last-step loss)."""
    m_count = len(net.models)
    n = len(y)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    params = net.params
    grads = [g for layer in net.layers for g in layer.grads]
    optimizer = _MomentumSGD(params, grads, lr, momentum)
    ws = net.workspace
    sample_shape = tuple(x.shape[1:])
    losses = torch.full((m_count,), float("nan"))
    minus_one = torch.full((m_count, 1, batch_size), -1.0)
    start = time.perf_counter()
    with torch.no_grad():
        for epoch in range(epochs):
            orders = torch.stack([torch.randperm(n, generator=g) for g in generators])
            batches = _member_batches(orders, batch_size)
            batch_targets = _member_batches(y[orders], batch_size)
            for index, (flat_rows, flat_targets) in enumerate(
                    zip(batches, batch_targets, strict=True)):
                b = len(flat_rows) // m_count
                inputs = ws.get("inputs", (m_count * b, *sample_shape))
                torch.index_select(x, 0, flat_rows, out=inputs)
                inputs = inputs.view(m_count, b, *sample_shape)
                h = inputs.transpose(1, 2) if x.ndim == 4 else inputs
                # logits class-major, [M, K, B]: how a last linear layer stores them, and
                # where log_softmax runs 3x faster than over the last dimension
                logits = net.forward(h).transpose(1, 2)
                targets = flat_targets.view(m_count, 1, b)
                log_p = torch.log_softmax(logits, dim=1)
                last = epoch == epochs - 1 and index == len(batches) - 1
                if last:
                    losses = -log_p.gather(1, targets).squeeze(1).mean(1)
                # d mean_b CE / d logits = (softmax - one_hot) / b, for each member
                g = log_p.exp_()
                g.scatter_add_(1, targets, minus_one[..., :b])
                g.div_(b)
                net.backward(g.transpose(1, 2))
                if net.prox is not None:
                    for p, grad, (mu, ref) in zip(params, grads, net.prox, strict=True):
                        diff = p - ref
                        if last:
                            losses += (mu.flatten() / 2 * diff.pow(2).flatten(1).sum(1))
                        grad.add_(diff.mul_(mu))
                optimizer.step()
    seconds = time.perf_counter() - start
    net.write_back()
    return seconds, [float(v) for v in losses]


def _member_batches(orders: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """One epoch's batches from each member's order ``[M, N]`` (or anything indexed like it):
    per step, the rows of all members, member after member (``[M * b]``), contiguous, sliced
    out in two copies per epoch rather than one per step."""
    m_count, n = orders.shape
    full = n // batch_size * batch_size
    batches = list(orders[:, :full].reshape(m_count, -1, batch_size).transpose(0, 1)
                   .reshape(-1, m_count * batch_size).unbind(0))
    if full < n:
        batches.append(orders[:, full:].reshape(-1))
    return batches


class _MomentumSGD:
    """``torch.optim.SGD`` (no dampening, weight decay or Nesterov) on the stacked tensors:
    the same elementwise arithmetic as each member's own optimiser, bit for bit, in one
    compiled pass where :func:`fedfusion.accel.kernels.sgd_kernel` is available. (PyTorch's own
    fused kernel, what ``SGD(fused=True)`` runs, differs in the last bit on tensors of a few
    elements, e.g. LeNet's first layer at M = 1: not used.) ``grads`` are read at each
    :meth:`step`; ``buffers``: momentum buffers to start from (default: the first gradients,
    as PyTorch does)."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], lr: float,
                 momentum: float, buffers: list[torch.Tensor] | None = None):
        self.params, self.grads, self.lr, self.momentum = params, grads, lr, momentum
        self.buffers = buffers
        self._compiled: Callable[[float, float], None] | None = None
        if buffers is not None:
            self._bind()

    def _bind(self) -> None:
        assert self.buffers is not None
        kernel = kernels.sgd_kernel()
        if kernel is not None:
            self._compiled = kernel.bind(self.params, self.grads, self.buffers)

    def step(self) -> None:
        if self.momentum == 0:
            torch._foreach_add_(self.params, self.grads, alpha=-self.lr)
        elif self.buffers is None:
            self.buffers = [g.clone() for g in self.grads]
            torch._foreach_add_(self.params, self.buffers, alpha=-self.lr)
            self._bind()
        elif self._compiled is not None:
            self._compiled(self.lr, self.momentum)
        else:
            kernels.torch_sgd(self.params, self.grads, self.buffers, self.lr, self.momentum)
