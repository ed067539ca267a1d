"""Inputs of any dtype: float images and features, integer token ids (into an
``nn.Embedding``), bool masks.

Inputs travel as the user holds them (:func:`fedfusion.evaluation.as_labelled` casts float
inputs to float32 and keeps integer and bool ones as they are): through the client's
sections (curvature, Gram), the server's validation and test data, evaluation, BatchNorm
recalibration, the chance check and ``distill="val"``. Only what GENERATES inputs needs float
ones: DENSE's and Co-Boosting's generators and ``distill="synthetic"`` make float images and
cannot make token ids, so they refuse a model of integer inputs before anything trains
(:func:`integer_inputs` says why).
"""

from __future__ import annotations

import torch
from torch import nn

from fedfusion.architecture import ModelSpec
from fedfusion.evaluation import Labelled

#: modules that read integer indices, not values: a model whose first layer is one of them
#: takes integer inputs (token ids)
INDEX_MODULES = (nn.Embedding, nn.EmbeddingBag)


def first_layer(spec: ModelSpec) -> tuple[str, nn.Module] | None:
    """The first leaf module ``spec``'s network calls on its input, from a forward on the
    meta device (no memory, no compute); None when it cannot be told (no input shape known,
    a network that cannot be built on the meta device)."""
    if not spec.input_shape:
        return None
    try:
        with torch.device("meta"):
            net = spec.build()
    except Exception:  # noqa: BLE001 (a model_fn that cannot build on meta: no answer)
        return None
    leaves = [(name, m) for name, m in net.named_modules() if not list(m.children())]
    called: list[tuple[str, nn.Module]] = []

    def record(name: str):  # noqa: ANN202 (a forward pre-hook)
        def hook(module: nn.Module, args: tuple) -> None:
            if not called:
                called.append((name, module))
        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in leaves]
    try:
        with torch.no_grad():
            net(torch.zeros(2, *spec.input_shape, device="meta"))
    except Exception:  # noqa: BLE001, S110 (float zeros into an Embedding fail AFTER the hook)
        pass
    finally:
        for handle in handles:
            handle.remove()
    return called[0] if called else None


def integer_inputs(spec: ModelSpec, val: Labelled | None = None) -> str | None:
    """Why the model of ``spec`` takes integer (or bool) inputs, or None when it takes float
    ones (or it cannot be told): the validation inputs' dtype where they are given, else the
    model's first layer being an ``nn.Embedding`` / ``nn.EmbeddingBag``."""
    if val is not None and not val.x.is_floating_point():
        return f"its inputs are {val.x.dtype} (the validation inputs)"
    if val is not None and len(val):
        return None
    first = first_layer(spec)
    if first is not None and isinstance(first[1], INDEX_MODULES):
        return (f"its first layer, module {first[0]!r} ({type(first[1]).__name__}), reads "
                "integer token ids")
    return None
