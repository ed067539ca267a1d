"""Inputs of any dtype: float images and features, integer token ids (into an
``nn.Embedding``), bool masks.

Inputs travel as the user holds them (:func:`fedfusion.core.evaluation.as_labelled` casts float
inputs to float32 and keeps integer and bool ones as they are): through the client's
sections (curvature, Gram), the server's validation and test data, evaluation, BatchNorm
recalibration, the chance check and ``distill="val"``. Only what GENERATES inputs needs float
ones: DENSE's and Co-Boosting's generators and ``distill="synthetic"`` make float images and
cannot make token ids, so they refuse a model of integer inputs before anything trains
(:func:`integer_reason` says why; :mod:`fedfusion.core.model_check` asks).
"""

from __future__ import annotations

import torch
from torch import nn

#: modules that read integer indices, not values: a model whose first layer is one of them
#: takes integer inputs (token ids)
INDEX_MODULES = (nn.Embedding, nn.EmbeddingBag)


def first_called(net: nn.Module, x: torch.Tensor) -> tuple[str, nn.Module] | None:
    """The first leaf module ``net`` calls in a forward on ``x`` (without gradients), even
    where the forward then fails (float zeros into an ``nn.Embedding``); None if none is."""
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
            net(x)
    except Exception:  # noqa: BLE001, S110 (float zeros into an Embedding fail AFTER the hook)
        pass
    finally:
        for handle in handles:
            handle.remove()
    return called[0] if called else None


def integer_reason(x: torch.Tensor | None, first: tuple[str, nn.Module] | None) -> str | None:
    """Why a model takes integer (or bool) inputs: the inputs ``x`` it runs on are not float
    (with the first module it calls, ``first`` (name, module), where that reads indices);
    None for float inputs or none known."""
    if x is None or x.is_floating_point():
        return None
    reason = f"its inputs are {x.dtype}"
    if first is not None and isinstance(first[1], INDEX_MODULES):
        reason += (f" and its first layer, module {first[0]!r} ({type(first[1]).__name__}), "
                   "reads integer token ids")
    return reason
