"""The linear maps of a network and the inputs they see: what K-FAC's input factor
(:mod:`fedfusion.curvature.hybrid`) and RegMean's Gram matrices (:mod:`fedfusion.sections.gram`) are
built from.

A *linear map* is a weight ``W`` (and its bias ``b``) that multiplies a captured input ``a``:
``out = W a (+ b)`` at every position of every sample. Which parameters are linear maps is a
property of the module types alone (:func:`linear_maps`; the server knows it without any
client's word, also on the meta device):

* ``nn.Linear``: ``weight`` / ``bias``, input the module's input;
* ``nn.Conv2d``: ``weight`` (as ``[out, c kh kw]``) / ``bias``, input the im2col patches of the
  module's input (:mod:`fedfusion.im2col`);
* ``nn.MultiheadAttention`` with one packed projection (``_qkv_same_embed_dim``, the default):
  ``in_proj_weight`` ``[3d, d]`` / ``in_proj_bias`` ``[3d]``. In self-attention (query, key
  and value the same tensor ``x``, as in ``nn.TransformerEncoderLayer``) the stacked query,
  key and value projections are ONE linear map of ``x``: ``[q; k; v] = W_in x + b_in`` at every
  position. Its ``out_proj`` (an ``nn.Linear``) maps the attention output ``o`` (the heads'
  ``softmax(q k^T / sqrt(d_h)) v``, concatenated) to the module's output.

Every other parameter (LayerNorm, BatchNorm, Embedding, a learned position ``nn.Parameter``,
a user's ``F.linear`` on its own ``nn.Parameter``, an attention with separate
``q/k/v_proj_weight`` and its ``out_proj``) is not a linear map of a captured input: it gets a
diagonal curvature block, and RegMean averages it.

Capturing (:class:`LinearInputs`): ``nn.Linear`` / ``nn.Conv2d`` by forward hooks.
``nn.MultiheadAttention`` reads ``in_proj_weight`` and ``out_proj.weight`` through
``F.multi_head_attention_forward`` and never calls ``out_proj``, so a hook cannot see them;
a forward hook on the attention module recomputes its output from explicit pieces,
``qkv = F.linear(x, W_in, b_in)`` (captured), the attention core by
``F.multi_head_attention_forward`` itself with identity projections (so masks, ``bias_k``,
``add_zero_attn`` and ``is_causal`` follow PyTorch's own code), and
``out = F.linear(o, W_out, b_out)`` (captured); the recomputed output replaces the module's
and is checked against it (a mismatch raises, so the curvature never describes a different
function). During capture PyTorch's fused "fast path" of ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` (taken in eval mode without grad; it bypasses every
submodule; recent PyTorch also skips it when a submodule has hooks) is switched off
(``torch.backends.mha.set_fastpath_enabled``), and restored after.

A linear map the forward pass never reaches this way yields no record: unused (its curvature
and Gram are exactly zero) or read without a capturable call (a Linear's weight in a user's
matmul, a packed attention projection in cross-attention, where query and key/value differ
and the three row blocks of ``W_in`` see different inputs): the callers tell the two apart.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

#: relative tolerance of the recomputed attention output against the module's own
ATTENTION_RTOL = 1e-4


@dataclass(frozen=True)
class LinearMap:
    """One linear map: its weight's and bias's parameter names, the module that owns them and
    its kind (``"linear"``, ``"conv"``, ``"attention"`` for a packed in-projection)."""

    weight: str
    bias: str | None
    module: nn.Module
    kind: str

    @property
    def in_features(self) -> int:
        """Columns of the weight's matrix view (``in``, ``c kh kw`` or ``d``)."""
        if self.kind == "conv":
            conv = self.module
            assert isinstance(conv, nn.Conv2d)
            return conv.in_channels // conv.groups * conv.kernel_size[0] * conv.kernel_size[1]
        if self.kind == "attention":
            return int(self.module.embed_dim)  # type: ignore[arg-type]
        return int(self.module.in_features)  # type: ignore[arg-type]


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def linear_maps(model: nn.Module) -> dict[str, LinearMap]:
    """Every linear map of ``model`` (see the module docstring), keyed by its weight's name, in
    ``named_modules`` order; from the module types alone (works on the meta device)."""
    maps: dict[str, LinearMap] = {}
    # an attention with separate q/k/v weights is not recomputed: its out_proj stays diagonal
    separate = {_joined(name, "out_proj") for name, m in model.named_modules()
                if isinstance(m, nn.MultiheadAttention) and not m._qkv_same_embed_dim}
    for name, module in model.named_modules():
        if name in separate:
            continue
        if isinstance(module, nn.Linear | nn.Conv2d):
            kind = "conv" if isinstance(module, nn.Conv2d) else "linear"
            bias = _joined(name, "bias") if module.bias is not None else None
            maps[_joined(name, "weight")] = LinearMap(_joined(name, "weight"), bias, module,
                                                      kind)
        elif isinstance(module, nn.MultiheadAttention) and module._qkv_same_embed_dim:
            bias = _joined(name, "in_proj_bias") if module.in_proj_bias is not None else None
            weight = _joined(name, "in_proj_weight")
            maps[weight] = LinearMap(weight, bias, module, "attention")
    return maps


def linear_map_parameters(model: nn.Module) -> frozenset[str]:
    """The parameters (weights and biases) of :func:`linear_maps`: those with Kron factors."""
    return frozenset(n for m in linear_maps(model).values() for n in (m.weight, m.bias) if n)


@dataclass
class Call:
    """One application of a linear map: its input (the module's input; the im2col patches are
    built by the caller) and, when kept, its output in the autograd graph."""

    inputs: torch.Tensor
    output: torch.Tensor | None


@contextmanager
def unfused_attention() -> Iterator[None]:
    """PyTorch's fused attention kernels off inside the block (they bypass the submodules and
    have no vmap rule), the previous setting restored after."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@dataclass
class LinearInputs:
    """Records every call of the linear maps ``maps`` of ``model`` while active (a context
    manager, see :meth:`active`): ``calls[weight name]`` in call order. ``keep_outputs``: the
    outputs stay in the graph (K-FAC's output gradients); the network goes on with a copy, so
    that an in-place op after the layer cannot change a kept output."""

    model: nn.Module
    maps: dict[str, LinearMap]
    keep_outputs: bool = False
    calls: dict[str, list[Call]] = field(default_factory=dict)

    def clear(self) -> None:
        self.calls.clear()

    def _record(self, weight: str, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        self.calls.setdefault(weight, []).append(
            Call(inputs.detach(), output if self.keep_outputs else None))
        return output.clone() if self.keep_outputs else output

    def _module_hook(self, weight: str):  # noqa: ANN202 (a torch forward hook)
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
                 ) -> torch.Tensor:
            return self._record(weight, args[0], out)
        return hook

    def _attention_hook(self, in_map: LinearMap, out_weight: str):  # noqa: ANN202
        signature = inspect.signature(nn.MultiheadAttention.forward)

        def hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict, output: tuple
                 ) -> tuple:
            bound = signature.bind(module, *args, **kwargs)
            bound.apply_defaults()
            out, weights = attention_forward(module, bound.arguments, self, in_map.weight,
                                             out_weight)
            reference = output[0]
            scale = float(reference.detach().abs().max()) if reference.numel() else 0.0
            error = float((out.detach() - reference.detach()).abs().max()) if scale else 0.0
            if error > ATTENTION_RTOL * max(scale, 1.0):
                raise ValueError(
                    f"capturing the inputs of {in_map.weight!r}: the recomputed attention "
                    f"output differs from the module's (max |diff| {error:.3g}); use "
                    "hessian_structure='diag' for this model")
            return out, weights
        return hook

    @contextmanager
    def active(self) -> Iterator[LinearInputs]:
        """Hooks attached (and PyTorch's fused attention fast path off) inside the block."""
        handles = []
        attention_outs = set()
        modules = dict(self.model.named_modules())
        for weight, lmap in self.maps.items():
            if lmap.kind == "attention":
                prefix = weight[: -len("in_proj_weight")]
                out_weight = f"{prefix}out_proj.weight"
                attention_outs.add(modules[f"{prefix}out_proj"])
                handles.append(lmap.module.register_forward_hook(
                    self._attention_hook(lmap, out_weight), with_kwargs=True))
        for weight, lmap in self.maps.items():
            if lmap.kind != "attention" and lmap.module not in attention_outs:
                handles.append(lmap.module.register_forward_hook(self._module_hook(weight)))
        try:
            with unfused_attention():
                yield self
        finally:
            for handle in handles:
                handle.remove()


def attention_forward(module: nn.MultiheadAttention, arguments: dict, sink: LinearInputs,
                      in_weight: str, out_weight: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``module``'s forward (a packed ``nn.MultiheadAttention``, called with ``arguments``)
    from explicit pieces, recording the in-projection (self-attention only) and the
    out-projection calls in ``sink``; returns what the module returns."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    batched = query.dim() == 3
    key_padding_mask = F._canonical_mask(
        mask=arguments["key_padding_mask"], mask_name="key_padding_mask",
        other_type=F._none_or_dtype(arguments["attn_mask"]), other_name="attn_mask",
        target_type=query.dtype)
    attn_mask = F._canonical_mask(
        mask=arguments["attn_mask"], mask_name="attn_mask", other_type=None, other_name="",
        target_type=query.dtype, check_other=False)
    if module.batch_first and batched:
        query, key, value = (t.transpose(1, 0) for t in (query, key, value))
    weight, bias = module.in_proj_weight, module.in_proj_bias
    if arguments["query"] is arguments["key"] and arguments["key"] is arguments["value"]:
        # self-attention: [q; k; v] is one linear map of the query input
        qkv = sink._record(in_weight, query, F.linear(query, weight, bias))
        q, k, v = qkv.chunk(3, dim=-1)
    else:  # cross-attention: three row blocks of different inputs, not recorded
        biases = bias.chunk(3) if bias is not None else (None, None, None)
        q, k, v = (F.linear(t, w, b) for t, w, b in zip((query, key, value), weight.chunk(3),
                                                        biases, strict=True))
    embed = module.embed_dim
    eye = torch.eye(embed, dtype=q.dtype, device=q.device)
    attended, weights = F.multi_head_attention_forward(
        q, k, v, embed, module.num_heads, None, None, module.bias_k, module.bias_v,
        module.add_zero_attn, module.dropout, eye, None, training=module.training,
        key_padding_mask=key_padding_mask, need_weights=arguments["need_weights"],
        attn_mask=attn_mask, use_separate_proj_weight=True, q_proj_weight=eye,
        k_proj_weight=eye, v_proj_weight=eye,
        average_attn_weights=arguments["average_attn_weights"],
        is_causal=arguments["is_causal"])
    out_proj = module.out_proj
    out = sink._record(out_weight, attended, F.linear(attended, out_proj.weight, out_proj.bias))
    if module.batch_first and batched:
        out = out.transpose(1, 0)
    return out, weights

