"""Laplace curvature of one-shot FL members and the stacked Gaussian family over them.

Client side: :func:`fit_curvature` fits laplace-torch to a trained member and returns one
:class:`Curvature` per structure (``kron``: :class:`KronCurvature`, ``diag``:
:class:`DiagCurvature`, ``diag_full``: :class:`DiagFullCurvature`), serialisable with
``to_arrays`` / ``from_arrays``. Server side: :class:`StackedGaussians` evaluates the exact
Gaussian log-densities of all members at R candidate points at once (FedBEns' objective over
them is :mod:`fedfusion.strategies.fedbens.objective`).
"""

from collections.abc import Mapping

import numpy as np

from fedfusion.core.state import StateLayout, kron_parameters, parameter_shapes
from fedfusion.curvature.base import Curvature
from fedfusion.curvature.diag import DiagCurvature, DiagFullCurvature, last_layer_names
from fedfusion.curvature.fit import (
    BACKENDS,
    CURVATURE_CLASSES,
    DEFAULT_BACKEND,
    STRUCTURES,
    fit_curvature,
    fit_laplace,
    import_laplace,
)
from fedfusion.curvature.kron import KronCurvature
from fedfusion.curvature.stacked_gaussians import (
    StackedDiag,
    StackedDiagFull,
    StackedGaussians,
    StackedKron,
)


def curvature_from_arrays(
    structure: str,
    arrays: Mapping[str, np.ndarray],
    param_shapes: Mapping[str, tuple[int, ...]],
    temperature: float,
    prior_var: float,
    *,
    check_input: bool = True,
) -> Curvature:
    """Rebuild a curvature of the named ``structure`` (dispatch to ``<cls>.from_arrays``).

    ``param_shapes`` may be a model's :class:`~fedfusion.core.state.StateLayout`: the curvature
    then covers its parameters (never its buffers), and a Kron curvature must have diagonal
    blocks exactly for the parameters outside Linear / Conv2d. A plain ``{name: shape}``
    mapping is taken to list parameters only. ``check_input=False`` skips the costly value
    checks for arrays that already passed them (:meth:`Curvature.from_arrays`)."""
    if structure not in CURVATURE_CLASSES:
        raise ValueError(f"unknown structure {structure!r}; available: {', '.join(STRUCTURES)}")
    params = parameter_shapes(param_shapes)
    if structure == "kron" and isinstance(param_shapes, StateLayout):
        return KronCurvature.from_arrays(arrays, params, temperature, prior_var,
                                         set(params) - kron_parameters(param_shapes),
                                         check_input=check_input)
    return CURVATURE_CLASSES[structure].from_arrays(arrays, params, temperature, prior_var,
                                                    check_input=check_input)


def curvature_blocks(structure: str, param_shapes: Mapping[str, tuple[int, ...]]
                     ) -> dict[str, list[str]]:
    """Which parameter gets which block of the ``structure``'s precision, from the server's
    layout alone: ``kron``: the linear maps' parameters (Linear, Conv2d, attention
    in-projections; :func:`fedfusion.capture.linear_maps`) a Kronecker block, every other
    one a diagonal block; ``diag``: every parameter diagonal; ``diag_full``: the last
    layer's parameters one dense block, the rest diagonal."""
    if structure not in CURVATURE_CLASSES:
        raise ValueError(f"unknown structure {structure!r}; available: {', '.join(STRUCTURES)}")
    params = list(parameter_shapes(param_shapes))
    if structure == "kron":
        kron = kron_parameters(param_shapes)
        return {"kron": [n for n in params if n in kron],
                "diagonal": [n for n in params if n not in kron]}
    if structure == "diag":
        return {"kron": [], "diagonal": params}
    last = set(last_layer_names(parameter_shapes(param_shapes)))
    return {"full": [n for n in params if n in last],
            "diagonal": [n for n in params if n not in last]}


__all__ = [
    "BACKENDS",
    "CURVATURE_CLASSES",
    "DEFAULT_BACKEND",
    "STRUCTURES",
    "Curvature",
    "DiagCurvature",
    "DiagFullCurvature",
    "KronCurvature",
    "StackedDiag",
    "StackedDiagFull",
    "StackedGaussians",
    "StackedKron",
    "curvature_blocks",
    "curvature_from_arrays",
    "fit_curvature",
    "fit_laplace",
    "import_laplace",
]
