"""Client side of the upload format: what a client computes for each upload section.

The server's strategy names the sections it needs (``config["sections"]``); the ClientApp
runs the registered builder of each on every trained member. Builders for curvature and
statistics register here with :func:`register_builder`, and their server-side validator
with :func:`fedfusion.payload.register_section`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from fedfusion.app.config import Settings
from fedfusion.curvature import (
    DEFAULT_BACKEND,
    STRUCTURES,
    DiagCurvature,
    KronCurvature,
    curvature_from_arrays,
    fit_curvature,
)
from fedfusion.curvature.fit import param_shapes
from fedfusion.payload import WEIGHTS, NumpyDict, ParamShapes, SectionValidator, register_section

#: (trained member, client inputs, labels, settings, the member's sections built so far) -> arrays
SectionBuilder = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, Settings, Mapping[str, NumpyDict]], NumpyDict]
_BUILDERS: dict[str, SectionBuilder] = {}


def register_builder(section: str) -> Callable[[SectionBuilder], SectionBuilder]:
    def decorator(builder: SectionBuilder) -> SectionBuilder:
        _BUILDERS[section] = builder
        return builder

    return decorator


def build_section(section: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  settings: Settings, built: Mapping[str, NumpyDict] | None = None
                  ) -> NumpyDict:
    """Section ``section`` of one trained member; ``built`` holds the member's sections
    computed before it (a builder may reuse one: ``diag_full`` reuses ``curvature.diag``)."""
    if section not in _BUILDERS:
        raise ValueError(f"this client cannot compute upload section {section!r}; "
                         f"known: {sorted(_BUILDERS)}")
    return _BUILDERS[section](model, x, y, settings, built or {})


@register_builder(WEIGHTS)
def model_weights(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: Settings,
                  built: Mapping[str, NumpyDict]) -> NumpyDict:
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}


#: prefix of the upload sections that hold a Laplace curvature (fitted with laplace-torch)
CURVATURE_PREFIX = "curvature."


def curvature_section(structure: str) -> str:
    """Upload section holding a member's Laplace curvature of ``structure``."""
    return f"{CURVATURE_PREFIX}{structure}"


def _curvature_builder(structure: str) -> SectionBuilder:
    def build(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: Settings,
              built: Mapping[str, NumpyDict]) -> NumpyDict:
        diagonal = None
        if structure != "kron" and curvature_section("diag") in built:
            diagonal = DiagCurvature.from_arrays(
                built[curvature_section("diag")], param_shapes(model), settings.temperature,
                settings.prior_var)
        curvature = fit_curvature(
            model, x, y, structure,
            temperature=settings.temperature, prior_var=settings.prior_var,
            backend=settings.curvature_backend or DEFAULT_BACKEND,
            batch_size=settings.curvature_batch_size, seed=settings.seed, diagonal=diagonal,
        )
        if isinstance(curvature, KronCurvature):
            return curvature.to_arrays(rank=settings.curvature_rank or None,
                                       eigvec_dtype=np.float16 if settings.curvature_half else None)
        return curvature.to_arrays()
    return build


def _curvature_validator(structure: str) -> SectionValidator:
    def validate(arrays: Mapping[str, np.ndarray], shapes: ParamShapes) -> None:
        # The arrays hold the likelihood curvature only; temperature and prior are the
        # server's choice, so any positive values check the structure.
        curvature_from_arrays(structure, dict(arrays), dict(shapes), 1.0, 1.0)
    return validate


for _structure in STRUCTURES:
    register_builder(curvature_section(_structure))(_curvature_builder(_structure))
    register_section(curvature_section(_structure), _curvature_validator(_structure))


# RegMean's upload section: per Linear/Conv2d weight, the Gram of the layer's inputs.
from fedfusion.gram import layer_grams, validate_grams  # noqa: E402

register_builder("gram")(lambda model, x, y, settings, built: layer_grams(model, x))
register_section("gram", validate_grams)
