"""Client side of the upload format: what a client computes for each upload section.

The server's strategy names the sections it needs (``config["sections"]``); the ClientApp
runs the registered builder of each on every trained member. Builders for curvature and
statistics register here with :func:`register_builder`, and their server-side validator
with :func:`fedfusion.wire.register_section`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedfusion.core.state import state_arrays
from fedfusion.curvature import (
    DEFAULT_BACKEND,
    STRUCTURES,
    DiagCurvature,
    KronCurvature,
    curvature_from_arrays,
    fit_curvature,
)
from fedfusion.curvature.fit import param_shapes
from fedfusion.wire import WEIGHTS, NumpyDict, ParamShapes, SectionValidator, register_section


@dataclass(frozen=True)
class SectionOptions:
    """How a client computes its upload sections (keyword arguments of
    :func:`fedfusion.client.make_upload`; the App fills them from its run config).

    ``curvature_backend`` "" = the measured default (:data:`fedfusion.curvature.DEFAULT_BACKEND`);
    ``curvature_rank`` 0 = every Kron eigenpair, r = the top r per factor;
    ``curvature_half`` stores Kron eigenvectors in float16; ``seed`` seeds Monte-Carlo
    curvature backends. ``temperature`` and ``prior_var`` shape the Laplace object fitted on
    the client; the uploaded arrays hold the likelihood curvature only, so the server chooses
    its own. ``accelerate`` (None = ``FEDFUSION_ACCEL``, else off): the optional compiled
    Kron fit of :mod:`fedfusion.accel`, the same factors to float tolerance."""

    curvature_backend: str = ""
    curvature_batch_size: int = 256
    curvature_rank: int = 0
    curvature_half: bool = False
    temperature: float = 0.1
    prior_var: float = 0.1
    seed: int = 0
    accelerate: bool | None = None


#: (trained member, client inputs, labels, options, the member's sections built so far) -> arrays
SectionBuilder = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, SectionOptions, Mapping[str, NumpyDict]], NumpyDict]
_BUILDERS: dict[str, SectionBuilder] = {}


def register_builder(section: str) -> Callable[[SectionBuilder], SectionBuilder]:
    def decorator(builder: SectionBuilder) -> SectionBuilder:
        _BUILDERS[section] = builder
        return builder

    return decorator


def build_section(section: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  options: SectionOptions, built: Mapping[str, NumpyDict] | None = None
                  ) -> NumpyDict:
    """Section ``section`` of one trained member; ``built`` holds the member's sections
    computed before it (a builder may reuse one: ``diag_full`` reuses ``curvature.diag``)."""
    if section not in _BUILDERS:
        raise ValueError(f"this client cannot compute upload section {section!r}; "
                         f"known: {sorted(_BUILDERS)}")
    return _BUILDERS[section](model, x, y, options, built or {})


@register_builder(WEIGHTS)
def model_weights(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: SectionOptions,
                  built: Mapping[str, NumpyDict]) -> NumpyDict:
    """The member's whole ``state_dict``, every entry in its own shape and (wire) dtype."""
    return state_arrays(model)


#: prefix of the upload sections that hold a Laplace curvature (fitted with laplace-torch)
CURVATURE_PREFIX = "curvature."


def curvature_section(structure: str) -> str:
    """Upload section holding a member's Laplace curvature of ``structure``."""
    return f"{CURVATURE_PREFIX}{structure}"


def _curvature_builder(structure: str) -> SectionBuilder:
    def build(model: nn.Module, x: torch.Tensor, y: torch.Tensor, options: SectionOptions,
              built: Mapping[str, NumpyDict]) -> NumpyDict:
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


def _curvature_validator(structure: str) -> SectionValidator:
    def validate(arrays: Mapping[str, np.ndarray], shapes: ParamShapes) -> None:
        # The arrays hold the likelihood curvature only; temperature and prior are the
        # server's choice, so any positive values check the structure.
        curvature_from_arrays(structure, dict(arrays), shapes, 1.0, 1.0)
    return validate


for _structure in STRUCTURES:
    register_builder(curvature_section(_structure))(_curvature_builder(_structure))
    register_section(curvature_section(_structure), _curvature_validator(_structure))


# RegMean's upload section: per Linear/Conv2d weight, the Gram of the layer's inputs.
from fedfusion.gram import layer_grams, validate_grams  # noqa: E402

register_builder("gram")(lambda model, x, y, options, built: layer_grams(model, x))
register_section("gram", validate_grams)
