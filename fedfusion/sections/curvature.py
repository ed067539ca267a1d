"""Upload sections ``curvature.<structure>``: a member's Laplace curvature (fitted with
laplace-torch on the client), one section per structure of :data:`fedfusion.curvature.STRUCTURES`.

The arrays hold the likelihood curvature only; temperature and prior are the server's choice.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from fedfusion.curvature import (
    DEFAULT_BACKEND,
    DiagCurvature,
    KronCurvature,
    curvature_from_arrays,
    fit_curvature,
)
from fedfusion.curvature.fit import param_shapes
from fedfusion.sections.base import MAX_ABS_CURVATURE, Section, SectionBuilder, SectionValidator
from fedfusion.sections.options import SectionOptions

#: prefix of the upload sections that hold a Laplace curvature
CURVATURE_PREFIX = "curvature."


def curvature_section(structure: str) -> str:
    """Upload section holding a member's Laplace curvature of ``structure``."""
    return f"{CURVATURE_PREFIX}{structure}"


def curvature_builder(structure: str) -> SectionBuilder:
    """The client's fit of ``structure``; a non-Kron structure reuses the member's
    ``curvature.diag`` section when it was built first."""
    def build(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: SectionOptions,
              built: Mapping[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        diagonal = None
        if structure != "kron" and curvature_section("diag") in built:
            diagonal = DiagCurvature.from_arrays(
                built[curvature_section("diag")], param_shapes(model), options.temperature,
                options.prior_var)
        curvature = fit_curvature(
            model, x, y, structure,
            temperature=options.temperature, prior_var=options.prior_var,
            backend=options.curvature_backend or DEFAULT_BACKEND,
            batch_size=options.curvature_batch_size, seed=options.seed, diagonal=diagonal,
            accelerate=options.accelerate,
        )
        if isinstance(curvature, KronCurvature):
            return curvature.to_arrays(rank=options.curvature_rank or None,
                                       eigvec_dtype=np.float16 if options.curvature_half else None)
        return curvature.to_arrays()
    return build


def curvature_validator(structure: str) -> SectionValidator:
    """The server's check of ``structure``: the arrays rebuild a curvature of the model."""
    def validate(arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
                 ) -> None:
        # any positive temperature and prior check the structure (the server picks its own)
        curvature_from_arrays(structure, dict(arrays), shapes, 1.0, 1.0)
    return validate


def curvature_entry(structure: str) -> Section:
    return Section(curvature_builder(structure), curvature_validator(structure),
                   MAX_ABS_CURVATURE)
