"""Upload section ``weights``: a member's whole ``state_dict``, every entry in its own shape
and wire dtype, checked against the server model's names, shapes and dtypes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn

from fedfusion.core.state import StateLayout, state_arrays
from fedfusion.reasons import name_list
from fedfusion.sections.base import MAX_ABS_WEIGHT, Section
from fedfusion.sections.options import SectionOptions


def check_array_names(arrays: Mapping[str, object], expected: Iterable[str],
                      missing_label: str = "missing array(s)", extra_hint: str = "") -> None:
    """Raise ValueError naming the arrays that are missing from, or not expected in, ``arrays``."""
    expected = set(expected)
    missing = sorted(expected - set(arrays))
    extra = sorted(map(str, set(arrays) - expected))
    if missing:
        raise ValueError(f"{missing_label} {name_list(missing)}")
    if extra:
        raise ValueError(f"unexpected array(s) {name_list(extra)}{extra_hint}")


def check_weight_shapes(actual: Mapping[str, tuple[int, ...]],
                        shapes: Mapping[str, tuple[int, ...]],
                        dtypes: Mapping[str, np.dtype] | None = None) -> None:
    """The weights' names and shapes are exactly the model's ``state_dict``'s (``actual``:
    name -> shape), and, where ``shapes`` is a :class:`~fedfusion.core.state.StateLayout` and
    ``dtypes`` (name -> dtype) is given, so are their wire dtypes (a float where the model
    keeps an integer counter is refused, as is an integer parameter). Raises ValueError; the
    decoder calls it on the declared shapes, before any array is decoded."""
    check_array_names(actual, shapes, extra_hint=" (not in the server model's state_dict)")
    for name, shape in shapes.items():
        kind = "buffer" if isinstance(shapes, StateLayout) and name in shapes.buffers else (
            "array")
        if tuple(actual[name]) != tuple(shape):
            raise ValueError(
                f"{kind} {name!r} has shape {tuple(actual[name])}, expected {tuple(shape)}")
        if dtypes is not None and isinstance(shapes, StateLayout) and (
                dtypes[name].newbyteorder("=") != shapes.wire_dtype(name)):
            raise ValueError(f"{kind} {name!r} has dtype {dtypes[name]}, the server model's "
                             f"entry is {shapes.dtypes[name]} (sent as "
                             f"{shapes.wire_dtype(name)})")


def validate_weights(arrays: Mapping[str, np.ndarray],
                     shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Names, shapes and dtypes as :func:`check_weight_shapes`; running variances >= 0."""
    check_weight_shapes({name: array.shape for name, array in arrays.items()}, shapes,
                        {name: array.dtype for name, array in arrays.items()})
    for name in shapes.variances if isinstance(shapes, StateLayout) else ():
        if (arrays[name] < 0).any():
            raise ValueError(f"buffer {name!r} is a running variance but holds negative "
                             f"values (min {float(arrays[name].min()):.4g})")


def model_weights(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: SectionOptions,
                  built: Mapping[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The member's whole ``state_dict``, every entry in its own shape and (wire) dtype."""
    return state_arrays(model)


WEIGHTS_SECTION = Section(model_weights, validate_weights, MAX_ABS_WEIGHT)
