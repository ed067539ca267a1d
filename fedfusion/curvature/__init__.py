"""Laplace curvature of one-shot FL members and the FedBEns mixture objective.

Client side: :func:`fit_curvature` fits laplace-torch to a trained member and returns one
:class:`Curvature` per structure (``kron``: :class:`KronCurvature`, ``diag``:
:class:`DiagCurvature`, ``diag_full``: :class:`DiagFullCurvature`), serialisable with
``to_arrays`` / ``from_arrays``. Server side: :class:`StackedGaussians` evaluates the exact
Gaussian log-densities of all members at R candidate points at once and
:func:`mixture_log_posterior` the FedBEns objective (Eq. 5).
"""

from collections.abc import Mapping

import numpy as np

from fedfusion.curvature.base import Curvature
from fedfusion.curvature.diag import DiagCurvature, DiagFullCurvature
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
from fedfusion.curvature.mixture import (
    MixtureObjective,
    StackedDiag,
    StackedDiagFull,
    StackedGaussians,
    StackedKron,
    log_prior,
    mixture_log_posterior,
)
from fedfusion.state import StateLayout, kron_parameters, parameter_shapes


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

    ``param_shapes`` may be a model's :class:`~fedfusion.state.StateLayout`: the curvature
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
    "MixtureObjective",
    "StackedGaussians",
    "StackedKron",
    "curvature_from_arrays",
    "fit_curvature",
    "fit_laplace",
    "import_laplace",
    "log_prior",
    "mixture_log_posterior",
]
